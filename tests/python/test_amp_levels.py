# mixprec.amp at every opt level, in fp16 and bf16, against an fp32 reference run: one or several
# losses x one or several optimizers x gradient accumulation x inf/NaN injected at chosen steps;
# and the dtype of every parameter, gradient, output and master weight at each level.
from __future__ import annotations

import math

import pytest
import torch

from amp_support import (
    LEVELS,
    OPT_KINDS,
    flat_params,
    fresh,
    injections,
    make_batches,
    make_model,
    make_optimizers,
    one_cpu_thread,  # noqa: F401  (autouse fixture)
    train_amp,
    train_o2_by_hand,
    train_plain,
)
from conftest import DEVICES, rel_err
from mixprec import amp

DTYPES = (torch.bfloat16, torch.float16)


def peer_run(level, dtype, kind, model0, batches, n_losses, skip):
    """Plain PyTorch in the same precision: autocast for O1, O2 written out by hand (fp32
    masters), a low-precision model with low-precision optimizer state for O3."""
    if level == "O2":
        return train_o2_by_hand(model0, kind, dtype, batches, n_losses, skip)
    model = fresh(model0)
    if level == "O3":
        model = model.to(dtype)
    opts = make_optimizers(kind, model)
    if level == "O1":
        train_plain(model, opts, batches, n_losses, skip, autocast=dtype)
    elif level == "O3":
        train_plain(model, opts, batches, n_losses, skip, cast=dtype)
    else:
        train_plain(model, opts, batches, n_losses, skip)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", OPT_KINDS)
@pytest.mark.parametrize("n_losses", [1, 2])
@pytest.mark.parametrize("accum", [1, 2])
def test_training_matches_fp32_reference(device, level, dtype, kind, n_losses, accum, gen):
    # Dynamic scaling at every level (so injected overflows are skipped), starting at 2**8 so
    # that only the injected steps overflow and the reference knows which steps to skip.
    model0 = make_model(gen, device)
    batches = make_batches(gen, device, 6, accum)
    inject = injections(n_losses, accum)
    skip = {s for s, _, _ in inject}

    model = fresh(model0)
    opts = make_optimizers(kind, model)
    model, opts = amp.initialize(model, opts, opt_level=level, dtype=dtype, loss_scale="dynamic",
                                 max_loss_scale=2.0**8, num_losses=n_losses, verbosity=0)
    train_amp(model, opts, batches, n_losses, inject)
    assert amp.skipped_steps() == len(inject)
    for lid in range(n_losses):
        assert amp.loss_scale(lid) < 2.0**8 or n_losses > 1

    reference = fresh(model0)
    train_plain(reference, make_optimizers(kind, reference), batches, n_losses, skip)
    ref = flat_params(reference)
    # O2 trains fp32 masters (the model holds their rounding): judged, like its peer, on them.
    trained = (torch.cat([m.detach().float().flatten().cpu() for opt in opts for m in amp.master_params(opt)])
               if level == "O2" else flat_params(model))
    err = rel_err(trained, ref)
    assert math.isfinite(err), "an overflowing step leaked into the weights"
    if level == "O0":
        bound = 1e-5
    else:
        # O3 keeps the weights themselves in fp16/bf16: every step rounds each of them, and mixprec's
        # fused update and the peer's round at different points, so over the 6 steps their errors
        # differ by a few ulps of the dtype either way (seed 3662617522: 3.0e-3 against the peer's
        # 5.8e-4 in fp16, the same before and after this session's changes). An error in the
        # scaling itself is orders of magnitude larger.
        floor = 4 * torch.finfo(dtype).eps if level == "O3" else 1e-5
        bound = max(2.0 * rel_err(flat_params(peer_run(level, dtype, kind, model0, batches, n_losses, skip)), ref),
                    floor)
    assert err < bound, f"{level}/{dtype}/{kind}: error {err:.3e} vs bound {bound:.3e}"


def bn_params(model):
    return {id(p) for p in model[1].parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_dtypes_at_each_level(device, level, dtype, kind, gen):
    model = make_model(gen, device)
    opts = make_optimizers(kind, model)
    model, opt = amp.initialize(model, opts[0], opt_level=level, dtype=dtype, verbosity=0)
    low = dtype if level in ("O2", "O3") else torch.float32
    bn = bn_params(model)
    for p in model.parameters():
        want = torch.float32 if (level == "O2" and id(p) in bn) else low
        assert p.dtype == want, f"{level}: param {tuple(p.shape)} is {p.dtype}"
    x = torch.randn(16, 8, device=device)
    out = model(x)
    assert out.dtype == torch.float32  # O1 too: the loss runs in fp32, as under Apex's patched functions
    with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
        assert scaled.dtype == torch.float32
        scaled.backward()
    for p in model.parameters():
        assert p.grad.dtype == p.dtype
    masters = list(amp.master_params(opt))
    for m in masters:
        assert m.dtype == (torch.float32 if level in ("O0", "O1", "O2") else m.dtype)
        assert m.grad is not None and m.grad.dtype == m.dtype
    if level == "O2":
        assert all(m.dtype == torch.float32 for m in masters)
        assert {m.data_ptr() for m in masters}.isdisjoint(
            {p.data_ptr() for p in model.parameters() if p.dtype != torch.float32})
    opt.step()
    # The returned objects are the user's: same classes, model.state_dict() keeps its keys.
    assert type(opt) is type(opts[0]) and isinstance(model, torch.nn.Sequential)
    sd = model.state_dict()
    assert list(sd) == list(make_model(torch.Generator().manual_seed(0), "cpu").state_dict())
    if level in ("O2", "O3"):
        assert all(v.dtype != dtype for v in sd.values() if v.is_floating_point()), "fp32 values, as Apex's hook"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_o2_masters_follow_the_model_after_each_step(device, kind, gen):
    model = make_model(gen, device)
    opts = make_optimizers(kind, model)
    model, opt = amp.initialize(model, opts[0], opt_level="O2", verbosity=0, max_loss_scale=2.0**8)
    originals = None
    for step in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(16, 8, device=device)).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        if originals is None:
            originals = [m.detach().clone() for m in amp.master_params(opt)]
    masters = list(amp.master_params(opt))
    assert any(not torch.equal(a, b) for a, b in zip(originals, masters)), "the masters must train"
    # master_params follows the param groups, which follow model.parameters() here.
    for p, m in zip(model.parameters(), masters):
        assert m.dtype == torch.float32
        assert torch.equal(p, m.to(p.dtype)), "the model holds its masters, rounded"


@pytest.mark.parametrize("device", DEVICES)
def test_clipping_master_grads_under_o2_fused_takes_effect(device, gen):
    # FusedAdam keeps masters itself and leaves the model's grads scaled; asking for
    # amp.master_params() between backward and step hands out unscaled fp32 grads (Apex's
    # semantics), and changes made to them (clipping) reach the step. Halving them must equal
    # halving the loss (power-of-two scaling is exact in float).
    model0 = make_model(gen, device)
    x = torch.randn(16, 8, device=device)
    results = []
    for halve_grads in (True, False):
        model = fresh(model0)
        model, opt = amp.initialize(model, make_optimizers("fused", model)[0], opt_level="O2", verbosity=0,
                                    max_loss_scale=2.0**8)
        loss = model(x).pow(2).mean()
        with amp.scale_loss(loss if halve_grads else loss * 0.5, opt) as scaled:
            scaled.backward()
        if halve_grads:
            scaled_grads = {id(p): p.grad.clone() for p in model.parameters()}
            masters = list(amp.master_params(opt))
            for p, m in zip(model.parameters(), masters):
                assert torch.equal(m.grad, scaled_grads[id(p)].float() / 2.0**8), "unscaled fp32 master grads"
                m.grad.mul_(0.5)
        opt.step()
        results.append(flat_params(model))
    assert rel_err(results[0], results[1]) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_defaults_to_no_loss_scaling(device, level, gen):
    model = make_model(gen, device)
    model, opt = amp.initialize(model, make_optimizers("fused", model)[0], opt_level=level, dtype=torch.bfloat16,
                                verbosity=0)
    loss = model(torch.randn(16, 8, device=device)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss.float())
        scaled.backward()
    opt.step()
    assert amp.loss_scale() == 1.0 and amp.skipped_steps() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_o1_defaults_to_dynamic_scaling_starting_at_2_16(device, gen):
    model = make_model(gen, device)
    model, opt = amp.initialize(model, make_optimizers("torch", model)[0], opt_level="O1", verbosity=0)
    loss = model(torch.randn(16, 8, device=device)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.allclose(scaled, loss.float() * 2.0**16)
        scaled.backward()
    opt.step()
    assert amp.loss_scale() in (2.0**16, 2.0**15)
