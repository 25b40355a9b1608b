# Tests of mixprec.linear_bias_grad (a Linear's bias gradient: the output gradient summed over its
# rows in fp32) on CPU and CUDA against float64 sums: column counts around the 16-byte vectors and
# the 32-lane tiles, row counts around the splits, unaligned rows, inf/NaN, determinism, bad
# inputs, opcheck, and CUDA-graph capture. mixprec.linear is tested in test_linear.py.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import FLOAT_DTYPES, check_rejected, random_tensor, sync

pytestmark = pytest.mark.usefixtures("poisoned_empty")  # an unwritten output element reads NaN

OP = "linear_bias_grad"
# Columns: one, around a 4- and 8-element vector, around a 256-column tile of 2-byte values (128
# of fp32), and GPT-2's widths. Rows: empty, one, around the CPU's 1024-row split and CUDA's
# 128-row minimum per split, and GPT-2 large's 4096 tokens.
COLS = (1, 3, 4, 7, 8, 9, 127, 129, 255, 257, 768, 1280, 3840)
ROWS = (0, 1, 127, 129, 1023, 1025, 4096)


def reference(grad: torch.Tensor) -> torch.Tensor:
    """The float64 sum, rounded once to grad's dtype: what an fp32 accumulation should return
    within its own rounding."""
    return grad.double().sum(0)


def check(got: torch.Tensor, grad: torch.Tensor, what: str) -> None:
    """`got` (on any device) against the float64 sum of `grad` (on the CPU)."""
    got = got.cpu()
    ref = reference(grad)
    assert got.dtype == grad.dtype and got.shape == (grad.shape[1],), what
    # fp32 accumulation over `rows` values: |error| <= rows * eps32 * sum|x| (plus the final rounding).
    bound = grad.shape[0] * 2.0**-23 * grad.double().abs().sum(0) + torch.finfo(grad.dtype).eps * ref.abs()
    err = (got.double() - ref).abs()
    assert bool((err <= bound + 1e-30).all()), f"{what}: max error {float(err.max()):.3g}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_sums_every_column_within_fp32_rounding(device, dtype, rows, gen):
    for cols in COLS:
        grad = random_tensor((rows, cols), dtype, device, gen)
        check(mixprec.linear_bias_grad(grad), grad.cpu(), f"{dtype} [{rows}, {cols}]")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unaligned_rows_and_leading_dimensions(device, dtype, gen):
    # An odd offset (no 16-byte loads) and a width whose rows break the alignment of the next.
    base = random_tensor(3 * 1025 * 7 + 1, dtype, device, gen)
    grad = base[1:].view(3, 1025, 7)
    got = mixprec.linear_bias_grad(grad)  # [..., N]: every leading dimension is summed
    check(got, grad.reshape(-1, 7).cpu(), f"{dtype} unaligned")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_is_deterministic(device, dtype, gen):
    grad = random_tensor((4099, 1283), dtype, device, gen, scale=100.0)
    first = mixprec.linear_bias_grad(grad)
    for _ in range(3):
        assert torch.equal(mixprec.linear_bias_grad(grad), first)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_values_reach_their_column_only(device, value, gen):
    grad = random_tensor((2000, 300), torch.float16, device, gen)
    grad[1777, 261] = value
    got = mixprec.linear_bias_grad(grad).cpu()
    if math.isnan(value):
        assert math.isnan(got[261])
    else:
        assert got[261] == value
    others = torch.cat([got[:261], got[262:]])
    assert torch.isfinite(others).all()


def test_large_values_overflow_like_the_dtype(device):
    # fp32 accumulation: 4096 x 60000 fits in fp32 but not in fp16, where it must round to inf.
    grad = torch.full((4096, 16), 60000.0, dtype=torch.float16, device=device)
    assert torch.isinf(mixprec.linear_bias_grad(grad)).all()
    assert torch.equal(mixprec.linear_bias_grad(grad.float()).cpu(), torch.full((16,), 4096 * 60000.0))


def test_bad_inputs_are_named(device):
    ok = torch.zeros(4, 3, device=device)
    check_rejected(lambda: mixprec.linear_bias_grad(ok.double()), [ok], TypeError, OP, "grad")
    check_rejected(lambda: mixprec.linear_bias_grad(ok.to(torch.int32)), [ok], TypeError, OP, "grad")
    check_rejected(lambda: torch.ops.mixprec.linear_bias_grad(ok.view(12)), [ok], ValueError, OP, "grad")
    check_rejected(lambda: torch.ops.mixprec.linear_bias_grad(ok.view(2, 2, 3)), [ok], ValueError, OP, "grad")
    check_rejected(lambda: mixprec.linear_bias_grad(ok.t()), [ok], RuntimeError, OP, "grad")
    with pytest.raises(ValueError, match="mixprec::linear_bias_grad: grad must have an out_features dimension"):
        mixprec.linear_bias_grad(torch.tensor(1.0, device=device))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_opcheck(device, dtype, gen):
    grad = random_tensor((257, 129), dtype, device, gen)
    torch.library.opcheck(torch.ops.mixprec.linear_bias_grad.default, (grad,))


@pytest.mark.cuda
def test_cuda_matches_cpu_within_rounding_and_captures_in_a_graph(gen):
    grad = random_tensor((4096, 1280), torch.float16, "cuda", gen)
    out = mixprec.linear_bias_grad(grad)
    check(out, grad.cpu(), "cuda fp16 [4096, 1280]")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mixprec.linear_bias_grad(grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mixprec.linear_bias_grad(grad)
    grad.mul_(2)
    graph.replay()
    sync("cuda")
    assert torch.equal(captured, mixprec.linear_bias_grad(grad))
