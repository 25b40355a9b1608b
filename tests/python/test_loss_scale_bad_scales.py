# Tests that a loss scale of 0, inf or NaN can never let an unscale pass as clean (issue 20):
# non_finite_check_and_unscale_ flags an inv_scale of inf, NaN or 0 in every grad it visits.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import CHUNK, FLOAT_DTYPES, assert_bitwise_equal, poisoned_like, random_tensor, scalar, sync
from test_loss_scale import GRAD_SCALE, assert_unscaled, expected_unscaled, random_inv_scale

# inv_scale = 1 / scale for scale 0, -0, NaN, inf, -inf.
BAD_INV = {"scale_0": math.inf, "scale_-0": -math.inf, "scale_nan": math.nan, "scale_inf": 0.0, "scale_-inf": -0.0}


def _grads(device, gen):
    # Finite values only, every dtype, sizes around the chunk boundary and an empty tensor, so a
    # flag can come only from the scale.
    shapes = [(1,), (CHUNK + 3,), (0,), (7, 5), (CHUNK,)]
    return [random_tensor(s, FLOAT_DTYPES[i % 3], device, gen, GRAD_SCALE) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("mode", ["in_place", "out"])
@pytest.mark.parametrize("case", sorted(BAD_INV))
def test_bad_inv_scale_sets_found_inf_and_every_per_tensor_flag(device, case, mode, gen):
    inv = BAD_INV[case]
    grads = _grads(device, gen)
    before = [g.clone() for g in grads]
    out = [poisoned_like(g, torch.float32) for g in grads] if mode == "out" else []
    found = scalar(0.0, device)
    per_tensor = torch.zeros(len(grads), device=device)
    mixprec.non_finite_check_and_unscale_(grads, found, scalar(inv, device), out, per_tensor)
    sync(device)
    assert found.item() == 1.0, f"{case}: a scale of {1 / inv if inv else 'inf'} passed as clean"
    nonempty = torch.tensor([float(g.numel() > 0) for g in grads])
    assert_bitwise_equal(per_tensor.cpu(), nonempty, f"{case}: per_tensor_found")
    # The products are still written as torch writes them (the step that reads them is skipped).
    for i, (b, o) in enumerate(zip(before, out or grads)):
        assert_bitwise_equal(o.cpu(), expected_unscaled(b, inv, o.dtype), f"{case}: {mode}[{i}]", nan_equal=True)


def test_good_inv_scales_are_not_flagged(device, gen, rng):
    # Negative, tiny (subnormal) and huge finite multipliers are plain multipliers: no flag, and
    # the products are torch's (scale_ multiplies by clip coefficients of any finite value).
    for inv in (random_inv_scale(rng), -random_inv_scale(rng), 1e-45, 2.0**100, 1.0):
        grads = _grads(device, gen)
        before = [g.clone() for g in grads]
        found = scalar(0.0, device)
        per_tensor = torch.zeros(len(grads), device=device)
        mixprec.non_finite_check_and_unscale_(grads, found, scalar(inv, device), [], per_tensor)
        sync(device)
        # 2^100 overflows fp16/bf16/fp32 products of ~1000: torch's contract (inputs are tested,
        # not products) holds, so no flag.
        assert found.item() == 0.0 and not bool(per_tensor.any()), f"inv {inv} was flagged"
        # Products bitwise torch's (fp32 product rounded once); ordinary ones also within the bound
        # of the float64 product (subnormal and overflowing ones are only rounding's).
        for i, (g, b) in enumerate(zip(grads, before)):
            assert_bitwise_equal(g.cpu(), expected_unscaled(b, inv, g.dtype), f"inv {inv}: grads[{i}]")
            if inv not in (1e-45, 2.0**100):
                assert_unscaled(g, b, inv, f"inv {inv}: grads[{i}]")


def test_check_only_and_pure_scaling_ignore_the_rule(device, gen):
    # Without inv_scale nothing is multiplied, so there is no scale to test; scale_ (found_inf
    # None) multiplies by 0 as asked (a clip coefficient of 0 is legal).
    grads = _grads(device, gen)
    found = scalar(0.0, device)
    mixprec.non_finite_check_and_unscale_(grads, found, None)
    assert found.item() == 0.0
    mixprec.scale_(grads, scalar(0.0, device))
    sync(device)
    assert all(not bool(g.any()) for g in grads)


def test_bad_scale_through_update_never_reaches_the_weights(device, gen):
    # The chain a scaler runs: unscale with 1/scale, skip the step on found_inf, update the scale.
    # Scale 0 (inv inf): flagged, backs off to the floor 2^-126 and recovers from there; scale
    # NaN: flagged on every step and stays NaN. The weights never move while either is bad.
    for start, after in ((0.0, 2.0**-126), (math.nan, math.nan)):
        w = random_tensor((CHUNK + 1,), torch.float32, device, gen)
        w0 = w.clone()
        scale = scalar(start, device)
        growth = torch.zeros(1, dtype=torch.int32, device=device)
        for _ in range(3):
            g = random_tensor((CHUNK + 1,), torch.float32, device, gen) * scale
            found = scalar(0.0, device)
            inv = scale.double().reciprocal().float()
            mixprec.non_finite_check_and_unscale_([g], found, inv)
            w.sub_(torch.where(found != 0, torch.zeros_like(g), g))  # a step skipped on the device
            mixprec.update_scale_(scale, growth, found, 2.0, 0.5, 1)
            assert found.item() == 1.0 or not math.isnan(after), "a NaN scale passed a step"
            assert_bitwise_equal(w.cpu(), w0.cpu(), f"scale {start}: the weights moved")
            if math.isnan(after):
                assert math.isnan(scale.item())
            else:
                assert scale.item() == after, f"scale {start} -> {scale.item()}"
                break
