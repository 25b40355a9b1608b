# A model moved (or its params replaced) after amp.initialize: O1 keeps training on the new device,
# its loss scale following; O2, whose fp32 masters stay where initialize made them, and O2/O3 whose
# params were replaced, refuse at the first forward, scale_loss or step, changing nothing.
from __future__ import annotations

import copy
import math

import pytest
import torch

from amp_support import amp_world, assert_same_world, make_model, one_cpu_thread  # noqa: F401  (autouse)
from conftest import random_tensor
from mixprec import amp
from mixprec.optimizers import FusedAdam


def batch(gen, device="cpu"):
    return random_tensor((16, 8), torch.float32, device, gen)


def scaled_backward(model, opt, gen, device="cpu", poison=None):
    loss = model(batch(gen, device)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if poison is not None:
            model[0].weight.grad.view(-1)[1] = poison


def full_step(model, opt, gen):
    opt.zero_grad()
    scaled_backward(model, opt, gen)
    opt.step()


REPLACED = r"parameter '0.weight' is no longer the tensor amp.initialize cast: the model's parameters were replaced"


@pytest.mark.parametrize("level,opt_cls", [("O2", torch.optim.SGD), ("O2", FusedAdam), ("O3", FusedAdam)])
def test_a_model_moved_to_meta_is_refused_at_its_forward(level, opt_cls, gen):
    """cpu -> meta cannot keep the Parameter objects (torch makes new ones): the optimizer, and O2's
    masters, went on holding the old ones, and every later step trained nothing, silently."""
    model = make_model(gen, "cpu")
    opt = opt_cls(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    model.to("meta")
    before = amp_world([], [opt])
    with pytest.raises(RuntimeError, match=f"Sequential.forward: {REPLACED} .*model.to\\(device\\) .*meta"):
        model(batch(gen).to("meta"))
    assert_same_world(before, amp_world([], [opt]))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_params_replaced_by_an_assigning_load_are_refused(level, gen):
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match=f"{REPLACED} .*assign=True"):
        model(batch(gen))
    assert_same_world(before, amp_world([model], [opt]))


def test_a_master_on_another_device_is_named_before_anything_changes(gen):
    """The check scale_loss and step make (the real move, to a GPU, is below): a fused optimizer's
    master that is not where its param is."""
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    last = model[3].bias
    opt.state[last]["master_param"] = opt.state[last]["master_param"].to("meta")
    loss = model(batch(gen)).float().pow(2).mean()
    before = amp_world([model], [])
    with pytest.raises(RuntimeError, match=r"amp.scale_loss: optimizers\[0\] \(FusedAdam\): the model's torch.float16 "
                                           r"parameter of shape \(4,\) is on cpu, but its fp32 master weight is on "
                                           r"meta.*moved after amp.initialize.*nothing was changed"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    assert_same_world(before, amp_world([model], []))
    loss.backward()  # a plain backward, which a fused optimizer steps as it is
    before = amp_world([model], [])
    with pytest.raises(RuntimeError, match=r"FusedAdam.step\(\): the model's .*is on cpu, but its fp32 master .*"
                                           r"nothing was stepped"):
        opt.step()
    assert_same_world(before, amp_world([model], []))


# -- on a GPU: the real move ---------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedAdam])
def test_o2_model_moved_to_the_gpu_after_initialize_is_refused(opt_cls, gen):
    """Apex made O2's masters at initialize, on the CPU here; the moved model's gradients then met
    CPU masters (Apex failed inside its copy; mixprec unscaled across devices or failed in an op)."""
    model = make_model(gen, "cpu")
    opt = opt_cls(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    model.cuda()
    assert model[0].weight.device.type == "cuda"  # the same Parameter objects, moved
    loss = model(batch(gen, "cuda")).float().pow(2).mean()
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match=rf"amp.scale_loss: optimizers\[0\] \({opt_cls.__name__}\): the model's "
                                           r"torch.float16 parameter of shape .* is on cuda:0, but its fp32 master "
                                           r"weight is on cpu.*amp.initialize\(model.cuda\(\), optimizer"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    assert_same_world(before, amp_world([model], [opt]))


@pytest.mark.cuda
def test_o1_model_moved_to_the_gpu_keeps_training(gen):
    """O1 has no masters: the optimizer holds the moved params, and the loss scale made on the CPU
    by the first steps follows the loss to the GPU. Each GPU step is the one plain PyTorch makes
    (autocast, loss times the scale, gradients divided by it), bit for bit; an overflow is skipped."""
    model = make_model(gen, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    for _ in range(2):  # the scale's device values are made on the CPU
        full_step(model, opt, gen)
    model.cuda()
    scale = amp.loss_scale()
    for step in range(3):
        x = batch(gen, "cuda")
        ref = copy.deepcopy(model)  # plain PyTorch from the same weights (deepcopy keeps amp's forward: unwrap it)
        del ref.__dict__["forward"]
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        with torch.autocast("cuda", dtype=torch.float16):
            out = ref(x)
        (out.float().pow(2).mean() * scale).backward()
        for p in ref.parameters():
            p.grad.mul_(1.0 / scale)
        ref_opt.step()
        opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters()]
        loss = model(x).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if step == 1:
                model[0].weight.grad.view(-1)[2] = math.inf
        opt.step()
        scaler = amp._amp_state.loss_scalers[0]
        assert scaler.state.scale.device.type == "cuda"
        if step == 1 or scaler._has_overflow:  # skipped (injected, or a batch that overflowed), the scale halved
            assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
            assert amp.loss_scale() == scale / 2
            scale /= 2
        else:
            assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), model.parameters()))
            assert amp.loss_scale() == scale


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_copies_of_a_model_check_their_own_params(level, gen, tmp_path):
    """A deepcopy (an EMA model) shares the forward's closure with the original: the param amp
    compares lives in each model's own attributes, so the copy runs (it was refused as replaced),
    and a copy moved to meta is refused for itself. A pickled whole model still loads."""
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    ema = copy.deepcopy(model)
    x = batch(gen)
    assert torch.equal(ema(x), model(x))
    ema.to("meta")
    with pytest.raises(RuntimeError, match=REPLACED):
        ema(x.to("meta"))
    model(x)  # the original is untouched by its copy's move
    torch.save(model, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
