# What the second misuse probe (issue 20) found and fixed: O2 steps that silently ignored or
# double-counted gradients, checkpoints that switched O2's masters off, dtype changes after
# amp.initialize, flags given as strings, NaN tensor learning rates, integer norm inputs. Each
# refused call is checked to change nothing, bit for bit.
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from amp_support import amp_world, assert_same_world, make_model, one_cpu_thread  # noqa: F401  (autouse)
from conftest import random_tensor
import mixprec
from mixprec import amp
from mixprec.optimizers import FusedAdam, FusedLAMB, FusedSGD


def batch(gen):
    return random_tensor((16, 8), torch.float32, "cpu", gen)


def scaled_backward(model, opt, gen, **kwargs):
    loss = model(batch(gen)).float().pow(2).mean()
    with amp.scale_loss(loss, opt, **kwargs) as scaled:
        scaled.backward()


def o2(gen, opt_cls=torch.optim.SGD, level="O2", dtype=None, **kwargs):
    model = make_model(gen, "cpu")
    opt = opt_cls(model.parameters(), lr=0.1, **kwargs)
    return amp.initialize(model, opt, opt_level=level, verbosity=0, dtype=dtype)


# -- O2 with a torch optimizer: the masters get gradients only through scale_loss ---------------------
def _plain(model, opt, gen):
    opt.zero_grad()
    model(batch(gen)).float().pow(2).mean().backward()


def _onto_zeroed(model, opt, gen):
    scaled_backward(model, opt, gen)
    opt.step()
    opt.zero_grad(set_to_none=False)  # zeroed in place: the plain backward accumulates into them
    model(batch(gen)).float().pow(2).mean().backward()


def _after_a_block(model, opt, gen):
    opt.zero_grad()
    scaled_backward(model, opt, gen)
    model(batch(gen)).float().pow(2).mean().backward()  # a second loss outside the block


def _clipped_model_grads(model, opt, gen):
    opt.zero_grad()
    scaled_backward(model, opt, gen)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # O2's recipe clips amp.master_params(opt)


STRAY = [(f, torch.optim.SGD) for f in (_plain, _onto_zeroed, _after_a_block, _clipped_model_grads)] + [
    (f, FusedSGD) for f in (_after_a_block, _clipped_model_grads)]  # a fused one steps a plain backward as is


@pytest.mark.parametrize("backward,opt_cls", STRAY, ids=lambda v: getattr(v, "__name__", "").lstrip("_"))
def test_o2_step_refuses_gradients_amp_did_not_unscale(backward, opt_cls, gen):
    """Apex's O2 step silently ignored them (its masters had no gradient, or only the block's); a
    fused optimizer divided them by the block's scale along with the block's own."""
    model, opt = o2(gen, opt_cls, momentum=0.9)
    backward(model, opt, gen)
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match=rf"{opt_cls.__name__}.step\(\): the model's torch.float16 parameter .* "
                                           r"amp did not unscale: a backward outside .*nothing was stepped"):
        opt.step()
    assert_same_world(before, amp_world([model], [opt]))
    # Training goes on: a step is taken within a few iterations (an fp16 overflow at the dynamic
    # scale, which some seeds' batches reach, skips a step and halves the scale, as it should).
    weights = [p.detach().clone() for p in model.parameters()]
    for _ in range(4):
        opt.zero_grad()
        scaled_backward(model, opt, gen)
        opt.step()
        if any(not torch.equal(w, p) for w, p in zip(weights, model.parameters())):
            break
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters())), "no step taken after the refusal"


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedSGD])
def test_scale_loss_refuses_to_drop_a_plain_backwards_gradients(opt_cls, gen):
    """A loss backpropagated before the block, outside it: the block set the model's float16
    gradients aside as scaled leftovers (Apex did too), dropping that loss silently."""
    model, opt = o2(gen, opt_cls)
    _plain(model, opt, gen)
    loss = model(batch(gen)).float().pow(2).mean()
    before = amp_world([model], [opt])  # after the forward, which moves BatchNorm's running stats
    with pytest.raises(RuntimeError, match=rf"amp.scale_loss: optimizers\[0\] \({opt_cls.__name__}\): the model's "
                                           r"torch.float16 parameter .*this block would drop it"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    assert_same_world(before, amp_world([model], [opt]))


def test_a_fused_optimizer_steps_a_plain_backward_as_it_is(gen):
    """No block, so nothing scaled: the fused kernel reads the model's gradients as they are."""
    model, opt = o2(gen, FusedSGD)
    _plain(model, opt, gen)
    weight, grad = model[0].weight.detach().float(), model[0].weight.grad.float()
    opt.step()
    assert torch.allclose(model[0].weight.float(), weight - 0.1 * grad, atol=1e-3)


def test_o2_gradients_amp_has_seen_step_as_before(gen):
    """No false alarm: a second step, a step after zero_grad(set_to_none=False), a delay_unscale
    chain, a step inside the block and an added param group all step as they did."""
    model, opt = o2(gen, momentum=0.9)
    scaled_backward(model, opt, gen)
    opt.step()
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.step()
    opt.zero_grad()
    for i in range(3):
        scaled_backward(model, opt, gen, delay_unscale=i < 2)
    opt.step()
    opt.zero_grad()
    loss = model(batch(gen)).float().pow(2).mean()
    with pytest.warns(UserWarning, match="inside"), amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        opt.step()
    extra = torch.nn.Linear(4, 4).half()
    opt.add_param_group({"params": list(extra.parameters())})
    opt.zero_grad()
    loss = extra(model(batch(gen)).half()).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    weight = extra.weight.detach().clone()
    opt.step()
    assert not torch.equal(weight, extra.weight)


# -- O2 with a torch optimizer: add_param_group --------------------------------------------------------
@pytest.mark.parametrize("params", ["in_a_group", "twice_in_the_new_group"])
def test_o2_add_param_group_refuses_a_param_given_twice(params, gen):
    """The groups hold masters, so torch's own duplicate check missed a model param given again: it
    got a second master, and the two masters' updates overwrote each other."""
    model, opt = o2(gen)
    group = {"params": [model[0].weight] if params == "in_a_group" else [model[3].weight, model[3].weight]}
    if params == "twice_in_the_new_group":
        opt.param_groups[0]["params"] = opt.param_groups[0]["params"][:2]  # model[3] not yet optimized
        opt._amp_stash.low_params[:] = opt._amp_stash.low_params[:1]
        opt._amp_stash.low_masters[:] = opt._amp_stash.low_masters[:1]
    before, n_low = amp_world([model], [opt]), len(opt._amp_stash.low_params)
    with pytest.raises(ValueError, match=r"SGD.add_param_group: params\[\d\] is already optimized .*more than one"):
        opt.add_param_group(group)
    assert_same_world(before, amp_world([model], [opt]))
    assert len(opt._amp_stash.low_params) == len(opt._amp_stash.low_masters) == n_low


def test_o2_add_param_group_refused_by_torch_leaves_amp_as_it_was(gen):
    model, opt = o2(gen)
    extra = torch.nn.Linear(4, 4).half()
    group = {"params": [extra.weight, "not a tensor"]}
    stash = opt._amp_stash
    before, n_low = amp_world([model], [opt]), len(stash.low_params)
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors"):
        opt.add_param_group(group)
    assert_same_world(before, amp_world([model], [opt]))
    assert len(stash.low_params) == len(stash.low_masters) == len(stash.master_ids) == n_low
    assert group["params"][0] is extra.weight  # the caller's group is not left holding a master


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedSGD])
def test_add_param_group_without_params_names_the_key(opt_cls, gen):
    model, opt = o2(gen, opt_cls)
    before = amp_world([model], [opt])
    with pytest.raises(KeyError, match=f"{opt_cls.__name__}.add_param_group: param_group has no 'params'"):
        opt.add_param_group({"lr": 0.1})
    assert_same_world(before, amp_world([model], [opt]))


# -- O2 with a fused optimizer: a checkpoint saved without masters ----------------------------------------
@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedSGD, FusedLAMB])
def test_a_checkpoint_without_masters_keeps_o2_masters_on(opt_cls, model_first, gen):
    """An O1 (or plain) checkpoint holds master_weights=False in its groups: loaded under O2 it
    used to step the float16 weights directly, with no masters, silently."""
    kwargs = {"momentum": 0.9} if opt_cls is FusedSGD else {}
    src, src_opt = o2(gen, opt_cls, level="O1", **kwargs)
    scaled_backward(src, src_opt, gen)
    src_opt.step()
    model_state, opt_state = src.state_dict(), src_opt.state_dict()
    model, opt = o2(gen, opt_cls, **kwargs)
    if model_first:
        model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    if not model_first:
        model.load_state_dict(model_state)
    assert all(group["master_weights"] is True for group in opt.param_groups)
    low = [p for p in model.parameters() if p.dtype == torch.float16]
    masters = [opt.state[p]["master_param"] for p in low]
    # Started from the loaded weights as the model holds them (Apex's masters came from the model).
    assert all(m.dtype == torch.float32 and torch.equal(m, p.float()) for p, m in zip(low, masters))
    assert torch.equal(opt.state[low[0]]["exp_avg" if opt_cls is not FusedSGD else "momentum_buffer"],
                       src_opt.state[src[0].weight]["exp_avg" if opt_cls is not FusedSGD else "momentum_buffer"])
    for _ in range(2):
        opt.zero_grad()
        scaled_backward(model, opt, gen)
        opt.step()
    assert all(torch.equal(p, m.half()) for p, m in zip(low, masters))  # the model is the masters' copy
    assert any(not torch.equal(m, m.half().float()) for m in masters)  # and they hold more than fp16


# -- the model's dtype changed after amp.initialize -------------------------------------------------------
@pytest.mark.parametrize("change", ["float", "double", "half_at_bf16", "to_float32"])
@pytest.mark.parametrize("level,opt_cls", [("O2", FusedAdam), ("O2", torch.optim.Adam), ("O3", FusedAdam)])
def test_a_forward_after_a_dtype_change_says_what_happened(level, opt_cls, change, gen):
    """torch's answer was "mat1 and mat2 must have the same dtype" (Apex's too): now the error
    names the parameter, both dtypes and the call that changed them."""
    dtype = torch.bfloat16 if change == "half_at_bf16" else torch.float16
    model = make_model(gen, "cpu")
    opt = opt_cls(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    {"float": model.float, "double": model.double, "half_at_bf16": model.half,
     "to_float32": lambda: model.to(torch.float32)}[change]()
    now = next(model.parameters()).dtype
    with pytest.raises(RuntimeError, match=rf"Sequential.forward: parameter '0.weight' is {now}, but amp.initialize "
                                           rf"left it {dtype}: the model's dtype was changed after amp.initialize"):
        model(batch(gen))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_o1_forward_after_a_dtype_change_refuses_to_train_low_weights(dtype, gen):
    """Under O1 the forward ran on (autocast takes float16 weights), and the optimizer stepped the
    float16 weights with no fp32 masters, silently."""
    model, opt = o2(gen, FusedAdam, level="O1", dtype=dtype)
    model.to(dtype)
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match=rf"parameter '0.weight' is {dtype}, but amp.initialize left it "
                                           r"torch.float32: .*under O1 .*without fp32 masters"):
        model(batch(gen))
    assert_same_world(before, amp_world([model], [opt]))
    model.float()  # put back: trains as before
    opt.zero_grad()
    scaled_backward(model, opt, gen)
    opt.step()


def test_other_forward_errors_pass_through(gen):
    model, _ = o2(gen, FusedAdam)
    with pytest.raises(ValueError, match="in_features") as info:
        model(random_tensor((16, 5), torch.float32, "cpu", gen))
    assert "amp.initialize" not in str(info.value)


# -- amp.initialize's arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(enabled="False"), "enabled must be True or False, got 'False'"),
    (dict(master_weights="False"), "master_weights must be True or False .*got 'False'"),
    (dict(patch_torch_functions="no"), "patch_torch_functions must be True or False"),
    (dict(master_weights=2), "master_weights must be True or False"),
])
def test_initialize_refuses_flags_that_are_not_bools(kwargs, match, gen):
    """Apex tested them for truth: enabled="False" or master_weights="False" (an argparse or config
    string) meant True."""
    model, opt = o2(gen, FusedAdam)
    other = make_model(gen, "cpu")
    before = amp_world([model, other], [opt])
    with pytest.raises(TypeError, match=f"amp.initialize: {match}"):
        amp.initialize(other, opt_level="O2", **kwargs)
    assert_same_world(before, amp_world([model, other], [opt]))


def test_initialize_takes_numpy_scale_bounds(gen):
    model = make_model(gen, "cpu")
    amp.initialize(model, opt_level="O2", min_loss_scale=np.float32(4.0), max_loss_scale=np.float32(1024.0),
                   verbosity=0)
    assert amp.loss_scale() == 1024.0
    assert amp._amp_state.loss_scalers[0].state.min_scale == 4.0


def test_numpy_ints_count_losses_as_in_apex(gen):
    """Apex indexed its list of scalers with loss_id and ranged over num_losses: a sweep's numpy ints
    worked there; mixprec refused them as not ints."""
    model = make_model(gen, "cpu")
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=np.int64(2), scale_history=np.int32(2),
                                verbosity=0)
    amp._amp_state.loss_scalers[1]._loss_scale = 64.0
    for loss_id in np.arange(2):
        loss = model(batch(gen)).float().pow(2).mean()
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            assert (scaled / loss).item() == (2.0**16, 64.0)[loss_id]
            scaled.backward()
    assert amp.loss_scale(np.int64(1)) == 64.0 and len(amp.scale_history(np.int64(0))) == 1
    with pytest.raises(ValueError, match=r"loss_id must be an int in \[0, num_losses=2\), got np.int64\(2\)"):
        amp.loss_scale(np.int64(2))


def test_initialize_names_a_tuple(gen):
    with pytest.raises(TypeError, match=r"models must be either a single model or a list of models. .*tuple"):
        amp.initialize((make_model(gen, "cpu"),), opt_level="O2")


def test_a_missing_checkpoint_file_is_named_as_missing(gen, tmp_path):
    """It was a ValueError calling the file "truncated, corrupt, or holding more than tensors"."""
    model, opt = o2(gen, FusedAdam)
    before = amp_world([model], [opt])
    with pytest.raises(FileNotFoundError, match="amp.load_checkpoint_state: cannot open checkpoint .*nope.pt: No such"):
        amp.load_checkpoint_state(tmp_path / "nope.pt", model, opt)
    with pytest.raises(ValueError, match="not a mixprec.amp checkpoint .*got bytes; expected its dict, or a path"):
        amp.load_checkpoint_state(b"\x00", model, opt)
    assert_same_world(before, amp_world([model], [opt]))


def test_reading_the_scale_of_a_disabled_amp_says_why(gen):
    amp.initialize(make_model(gen, "cpu"), enabled=False)
    for read in (amp.loss_scale, amp.scale_history, lambda: amp.skipped_steps(0)):
        with pytest.raises(RuntimeError, match="enabled=False, which keeps no loss scaler"):
            read()


def test_a_model_built_under_inference_mode_is_refused_before_anything_changes(gen):
    """It used to be cast, and the first step failed inside an op: "Inference tensors do not track
    version counter"."""
    model, opt = o2(gen, FusedAdam)
    with torch.inference_mode():
        frozen = make_model(gen, "cpu")
    frozen_opt = FusedAdam(frozen.parameters(), lr=1e-3)
    before = amp_world([model, frozen], [opt, frozen_opt])
    with pytest.raises(RuntimeError, match=r"amp.initialize: models\[0\] parameter 0.weight was created under "
                                           r"torch.inference_mode\(\)"):
        amp.initialize(frozen, frozen_opt, opt_level="O2")
    assert_same_world(before, amp_world([model, frozen], [opt, frozen_opt]))


@pytest.mark.parametrize("opt_cls", [FusedAdam, torch.optim.Adam])
def test_a_scheduler_made_before_initialize_does_not_warn(opt_cls, gen, recwarn):
    """torch's schedulers found amp's step without their wrapper's mark and warned that
    optimizer.step() had been overridden."""
    model = make_model(gen, "cpu")
    opt = opt_cls(model.parameters(), lr=0.1)
    early = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for _ in range(3):
        opt.zero_grad()
        scaled_backward(model, opt, gen)
        opt.step()
        early.step()
    assert not [w for w in recwarn.list if "lr_scheduler" in str(w.message)], [str(w.message) for w in recwarn.list]
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**3
    model, opt = o2(gen, opt_cls)
    late = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # made after: a real misordering still warns
    with pytest.warns(UserWarning, match=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"):
        late.step()


# -- a tensor learning rate -----------------------------------------------------------------------------------
BAD_TENSOR_LR = {"nan": torch.tensor(math.nan), "negative": torch.tensor(-1e-3), "inf": torch.tensor(math.inf),
                 "meta": torch.tensor(1e-3, device="meta")}


@pytest.mark.parametrize("lr", list(BAD_TENSOR_LR))
@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedSGD, FusedLAMB])
def test_a_bad_tensor_lr_is_refused_like_a_number(opt_cls, lr, gen):
    """torch.optim refuses a NaN or negative tensor lr; mixprec took any one-element tensor and
    trained to NaN (or uphill) silently."""
    bad = BAD_TENSOR_LR[lr]
    params = [torch.nn.Parameter(random_tensor((5, 3), torch.float32, "cpu", gen)) for _ in range(2)]
    match = rf"{opt_cls.__name__}: {{}}: invalid lr tensor\(.*expected a finite number >= 0, or a one-element"
    with pytest.raises(ValueError, match=match.format("defaults")):
        opt_cls(params, lr=bad)
    opt = opt_cls(params[:1], lr=torch.tensor(1e-2))
    with pytest.raises(ValueError, match=match.format("param group 1")):
        opt.add_param_group({"params": params[1:], "lr": bad})
    for p in params:
        p.grad = random_tensor(p.shape, p.dtype, "cpu", gen)
    opt.step()
    opt.param_groups[0]["lr"] = bad  # as a scheduler would write it
    before = [t.clone() for t in [params[0], *opt.state[params[0]].values()] if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError, match=match.format("param group 0")):
        opt.step()
    after = [t for t in [params[0], *opt.state[params[0]].values()] if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# -- the norm ops on integer input ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [mixprec.layer_norm, mixprec.rms_norm], ids=lambda f: f.__name__)
def test_norms_name_an_integer_input(op):
    """ATen's kernel lookup answered: "LayerNormKernelImpl" not implemented for 'Long'."""
    with pytest.raises(TypeError, match=rf"mixprec.{op.__name__}: input has dtype torch.int64; expected float32"):
        op(torch.ones(2, 3, dtype=torch.int64), 3)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "saved_by_a_graph"])
def test_scale_refuses_a_tensor_autograd_tracks(leaf):
    """The op bumps no version counter: scaling a tensor a graph saved gave wrong gradients, silently."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    x = w if leaf else w * 1.0
    y = (x * x).sum()
    with pytest.raises(RuntimeError, match=r"mixprec.scale_: tensors\[1\] requires grad while grad mode is on"):
        mixprec.scale_([torch.ones(2), x], torch.tensor([2.0]))
    assert torch.equal(x.detach(), torch.tensor([1.0, 2.0]))
    y.backward()
    assert torch.equal(w.grad, torch.tensor([2.0, 4.0]))
    with torch.no_grad():  # an optimizer's use: params, outside autograd
        mixprec.scale_([w], torch.tensor([2.0]))
    assert torch.equal(w.detach(), torch.tensor([2.0, 4.0]))
