# Bit-exactness of non_finite_check_and_unscale_ on CPU and CUDA: every fp16 and bf16 bit pattern
# (converted, checked in every lane of a vector, scaled in place) and float32's rounding to them,
# against torch's conversions; the paths the CUDA kernels take two 2-byte values at a time.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import CHUNK, assert_bitwise_equal, poisoned_like, scalar, unaligned_view
from test_loss_scale import expected_unscaled, f32  # shared helpers


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_converts_exactly(device, in_dtype):
    # All 65536 fp16/bf16 values, subnormals, infs and NaNs included, into fp32 and back.
    x = every_16_bit_pattern(in_dtype).to(device)
    out = [poisoned_like(x, torch.float32)]
    found = scalar(0.0, device)
    mixprec.non_finite_check_and_unscale_([x], found, None, out)
    assert found.item() == 1.0
    assert_bitwise_equal(out[0].cpu(), x.cpu().to(torch.float32), f"{in_dtype} -> float32", nan_equal=True)
    back = [poisoned_like(x)]
    mixprec.non_finite_check_and_unscale_(out, None, None, back)
    assert_bitwise_equal(back[0].cpu(), x.cpu(), f"{in_dtype} -> float32 -> {in_dtype}", nan_equal=True)


def every_16_bit_pattern(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_non_finite_16_bit_pattern_is_found_in_every_lane(device, dtype, gen):
    # The CUDA kernels test two 2-byte values of a word at once on their raw bits. Each inf and
    # NaN pattern (fp16: 2048, bf16: 256) sits alone in an otherwise finite 16-element tensor (two
    # whole 16-byte vectors), at a lane that does not follow the pattern's low bit; +-inf and a
    # NaN sit in each of the 16 lanes; and single bad values sit where a thread's later vectors,
    # a later loop iteration, a chunk's cut-off last vector and an unaligned tensor are read. Every
    # such tensor must raise its own flag, in place and read-only, and no finite pattern may.
    bits = every_16_bit_pattern(dtype)
    bad = bits[~torch.isfinite(bits.float())]
    assert len(bad) == (2048 if dtype == torch.float16 else 256)
    tensors = []

    def planted(size: int, index: int, value) -> torch.Tensor:
        t = torch.ones(size, dtype=dtype)
        t[index] = value
        return t.to(device)

    tensors += [planted(16, (i + i // 16) % 16, value) for i, value in enumerate(bad)]
    tensors += [planted(16, lane, value) for value in (math.inf, -math.inf, math.nan) for lane in range(16)]
    # 4096 elements apart: the next vector of the same thread; 16384: the next loop iteration.
    tensors += [planted(40000, i, math.nan) for i in (4096 + 3, 16384 + 2 * 4096 + 5, 39999)]
    tensors.append(planted(2 * CHUNK + 5, 2 * CHUNK + 4, -math.inf))  # in the last, cut-off vector
    view, _ = unaligned_view(CHUNK + 9, dtype, device, gen)
    view[CHUNK // 2] = math.inf
    tensors.append(view)
    finite = bits[torch.isfinite(bits.float())].to(device)
    for inv in (None, 0.5):  # read-only check, in place
        grads = [t.clone() for t in tensors] + [finite.clone()]
        flags = torch.zeros(len(grads), device=device)
        found = scalar(0.0, device)
        mixprec.non_finite_check_and_unscale_(grads, found, None if inv is None else scalar(inv, device),
                                              per_tensor_found=flags)
        assert found.item() == 1.0
        missed = (flags[:-1] != 1).nonzero().flatten().tolist()
        assert not missed, f"inv={inv}: tensors {missed[:8]} held inf/NaN but their flags stayed 0"
        assert flags[-1].item() == 0.0, "a finite pattern was taken for inf or NaN"


@pytest.mark.parametrize("inv", [0.5, 2.0**-10, 1.0 / 1021.0, 256.0],
                         ids=["half", "2^-10", "not_pow2", "256_overflows"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_finite_16_bit_pattern_scales_in_place_like_torch(device, dtype, inv):
    # In place, 2-byte values are scaled two to a word and rounded back by a paired convert:
    # every finite pattern (subnormals included) must come out as one fp32 product rounded once,
    # overflowing to inf where that product does (a scale above 1: the loss scale fell below 1);
    # the inputs are finite, so found_inf stays 0.
    bits = every_16_bit_pattern(dtype)
    x = bits[torch.isfinite(bits.float())]
    g = x.to(device, copy=True)  # a copy on the CPU too: x stays the reference's input
    found = scalar(0.0, device)
    inv32 = f32(inv)
    mixprec.non_finite_check_and_unscale_([g], found, scalar(inv32, device))
    assert found.item() == 0.0
    assert_bitwise_equal(g.cpu(), expected_unscaled(x, inv32, dtype), f"{dtype} x {inv32} in place")


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_rounds_to_nearest_even_like_torch(device, out_dtype, gen):
    # Random bit patterns over every float32 exponent (overflow, subnormal results, ties) and
    # exact ties and boundaries of the 16-bit formats.
    bits = torch.randint(-(2**31), 2**31, (CHUNK + 3,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    ties = torch.tensor([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14, 1 + 2.0**-11,
                         1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.3895314e38, -0.0, 0.0, 1e-45])
    x = torch.cat([x, ties, -ties]).to(device)
    out = [poisoned_like(x, out_dtype)]
    mixprec.non_finite_check_and_unscale_([x], scalar(0.0, device), None, out)
    assert_bitwise_equal(out[0].cpu(), x.cpu().to(out_dtype), f"float32 -> {out_dtype}", nan_equal=True)
