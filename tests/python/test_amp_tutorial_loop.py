# The loop most Apex tutorials taught: optimizer.step() (and zero_grad) inside the scale_loss
# block, right after scaled_loss.backward(). It must train exactly as the same loop with step()
# after the block -- the pending unscale, overflow check and skip happen before the step, and the
# block's exit adds nothing -- at every opt level and with any optimizer, and warn once.
from __future__ import annotations

import math
import warnings

import pytest
import torch

import mixprec.amp._process as amp_process
from amp_support import fresh, make_model, one_cpu_thread  # noqa: F401  (autouse fixture)
from conftest import DEVICES, random_tensor
from mixprec import amp
from mixprec.optimizers import FusedAdam, FusedLAMB, FusedSGD

OPTIMIZERS = {
    "torch_sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "torch_adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-3),
    "fused_adam": lambda ps: FusedAdam(ps, lr=1e-2),
    "fused_sgd": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
    "fused_lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
}
LEVELS = [("O0", torch.float16), ("O1", torch.float16), ("O2", torch.float16), ("O3", torch.float16),
          ("O1", torch.bfloat16), ("O2", torch.bfloat16)]
POISON_STEP = 2


@pytest.fixture(autouse=True)
def warn_again(monkeypatch):
    monkeypatch.setattr(amp_process, "_warned", set(), raising=False)


def run(model, opt, batches, inside: bool, clip: bool = False, poison: bool = True):
    for step, (x, y) in enumerate(batches):
        if not inside:
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if poison and step == POISON_STEP:  # only where amp checks (dynamic scaling)
                next(model.parameters()).grad.view(-1)[1] = math.inf
            if inside:
                if clip:
                    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
                opt.step()
                opt.zero_grad()
        if not inside:
            if clip:
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
            opt.step()
    return [p.detach().clone() for p in model.parameters()], amp.loss_scale(), amp.skipped_steps()


def twin_runs(level, dtype, opt_name, device, gen, clip=False):
    base = make_model(gen, device)
    batches = [(random_tensor((16, 8), torch.float32, device, gen), random_tensor((16, 4), torch.float32, device, gen))
               for _ in range(5)]
    dynamic = dtype == torch.float16 and level in ("O1", "O2")
    results = []
    for inside in (False, True):
        model = fresh(base)
        model, opt = amp.initialize(model, OPTIMIZERS[opt_name](model.parameters()), opt_level=level, dtype=dtype,
                                    verbosity=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append((run(model, opt, batches, inside, clip, poison=dynamic),
                            [str(w.message) for w in caught]))
    return results


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("level, dtype", LEVELS)
def test_step_inside_the_block_trains_as_after_it(level, dtype, opt_name, device, gen):
    (after, after_warnings), (inside, inside_warnings) = twin_runs(level, dtype, opt_name, device, gen)
    params_after, scale_after, skipped_after = after
    params_inside, scale_inside, skipped_inside = inside
    for i, (a, b) in enumerate(zip(params_after, params_inside)):
        assert torch.equal(a, b), f"param {i} differs"
        assert torch.isfinite(b).all()
    assert scale_inside == scale_after and skipped_inside == skipped_after
    dynamic = dtype == torch.float16 and level in ("O1", "O2")
    assert skipped_after >= 1 if dynamic else skipped_after == 0  # the injected inf (and any natural overflow)
    assert not after_warnings
    scaled = level == "O2" or dynamic  # a block with nothing to scale or copy needs no completing
    placement = [w for w in inside_warnings if "usual placement is after the with block" in w]
    assert len(placement) == (1 if scaled else 0), inside_warnings


@pytest.mark.parametrize("opt_name", ["torch_adam", "fused_adam"])
def test_clipping_master_params_inside_the_block_sees_unscaled_gradients(opt_name, gen):
    (after, _), (inside, _) = twin_runs("O2", torch.float16, opt_name, "cpu", gen, clip=True)
    for a, b in zip(after[0], inside[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("opt_name", ["torch_sgd_momentum", "fused_adam"])
def test_initialize_with_its_return_value_ignored(opt_name, gen):
    base = make_model(gen, "cpu")
    batches = [(random_tensor((16, 8), torch.float32, "cpu", gen), random_tensor((16, 4), torch.float32, "cpu", gen))
               for _ in range(4)]
    results = []
    for keep_return in (True, False):
        model = fresh(base)
        opt = OPTIMIZERS[opt_name](model.parameters())
        if keep_return:
            model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        else:
            amp.initialize(models=model, optimizers=opt, opt_level="O2", verbosity=0)
        results.append(run(model, opt, batches, inside=False))
    assert all(p.dtype == torch.float16 for p in results[1][0][:1])
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    assert results[0][1:] == results[1][1:]
