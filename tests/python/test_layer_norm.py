# Tests of mixprec.layer_norm and its ops (layer_norm_forward / layer_norm_backward) on CPU and CUDA
# against float64 references, within twice the error of torch's own LayerNorm in the same dtype:
# widths around the 16-byte vectors and a warp's 32 vectors, every row width the CUDA kernels
# hold in registers and the first past them, GPT-2's widths, several row counts, absent weight or
# bias, several normalized dimensions, non-contiguous and unaligned inputs, inf/NaN, determinism,
# poisoned outputs, output masks, bad inputs, opcheck, CUDA-graph capture and torch's fallback
# past the CUDA width limit.
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixprec
from conftest import FLOAT_DTYPES, check_rejected, peer_bound, random_tensor, rel_err, sync

pytestmark = pytest.mark.usefixtures("poisoned_empty")  # an unwritten output element reads NaN

# (One or two columns normalize to exactly 0 or +-1, whose input gradient is 0: a relative error
# against it means nothing.)
WIDTHS = (3, 7, 8, 255, 256, 257, 768, 1280)
ROWS = (1, 5, 129)


def run(fn, x, normalized_shape, w, b, dy):
    """Output and (input, weight, bias) gradients of fn on leaf copies of the arguments."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    y = fn(leaves[0], normalized_shape, leaves[1], leaves[2])
    y.backward(dy)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def check_against_float64(x, normalized_shape, w, b, dy, what):
    """mixprec's output and gradients within twice torch's own error against float64."""
    ours = run(mixprec.layer_norm, x, normalized_shape, w, b, dy)
    peer = run(F.layer_norm, x, normalized_shape, w, b, dy)
    as64 = [t.cpu().double() if t is not None else None for t in (x, w, b)]
    ref = run(F.layer_norm, as64[0], normalized_shape, as64[1], as64[2], dy.cpu().double())
    for name, got, theirs, want in zip(("output", "grad input", "grad weight", "grad bias"), ours, peer, ref):
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == x.dtype and got.shape == want.shape, f"{what} {name}"
        bound = peer_bound(x.dtype, theirs, want)
        err = rel_err(got, want)
        assert err <= bound, f"{what} {name}: relative error {err:.3g} > {bound:.3g} (torch's {rel_err(theirs, want):.3g})"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_matches_float64_within_torchs_error(device, dtype, rows, gen):
    for cols in WIDTHS:
        x = random_tensor((rows, cols), dtype, device, gen)
        w = random_tensor(cols, dtype, device, gen)
        b = random_tensor(cols, dtype, device, gen)
        dy = random_tensor((rows, cols), dtype, device, gen)
        check_against_float64(x, (cols,), w, b, dy, f"{dtype} [{rows}, {cols}]")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 1024, 768), (4, 1024, 1280), (3, 7, 12288)])
def test_gpt2_shapes_and_the_widest_on_cuda(dtype, shape, gen):
    x, dy = (random_tensor(shape, dtype, "cuda", gen) for _ in range(2))
    w, b = (random_tensor(shape[-1], dtype, "cuda", gen) for _ in range(2))
    check_against_float64(x, shape[-1:], w, b, dy, f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("strides", range(1, 10))
def test_every_register_held_row_width_and_the_first_past_them(device, dtype, strides, gen):
    # The CUDA forward and backward hold rows of up to 8 strides of 32 16-byte vectors in
    # registers, one kernel per stride count: each count at its widest row and with a short last
    # vector, and 9 strides (the first width past them, which re-reads the row from the cache).
    lane_cols = 32 * (16 // torch.empty((), dtype=dtype).element_size())
    for cols in (strides * lane_cols, strides * lane_cols - 3) if strides <= 8 else (8 * lane_cols + 1,):
        x, dy = (random_tensor((37, cols), dtype, device, gen) for _ in range(2))
        w, b = (random_tensor(cols, dtype, device, gen) for _ in range(2))
        check_against_float64(x, (cols,), w, b, dy, f"{dtype} [37, {cols}]")


@pytest.mark.parametrize("affine", ["weight", "bias", "neither"])
def test_without_weight_or_bias(device, affine, gen):
    x, dy = (random_tensor((33, 257), torch.float16, device, gen) for _ in range(2))
    w = random_tensor(257, torch.float16, device, gen) if affine == "weight" else None
    b = random_tensor(257, torch.float16, device, gen) if affine == "bias" else None
    check_against_float64(x, (257,), w, b, dy, affine)


def test_several_normalized_dimensions_and_a_non_contiguous_input(device, gen):
    base = random_tensor((6, 5, 9, 4), torch.float32, device, gen)
    x = base.transpose(0, 1)  # [5, 6, 9, 4], not contiguous
    w, b = (random_tensor((9, 4), torch.float32, device, gen) for _ in range(2))
    dy = random_tensor((5, 6, 9, 4), torch.float32, device, gen)
    check_against_float64(x, (9, 4), w, b, dy, "normalized (9, 4)")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unaligned_rows(device, dtype, gen):
    # A view at an odd offset: no 16-byte loads on any row.
    x = random_tensor(65 * 264 + 1, dtype, device, gen)[1:].view(65, 264)
    w, b = (random_tensor(264, dtype, device, gen) for _ in range(2))
    dy = random_tensor(65 * 264 + 1, dtype, device, gen)[1:].view(65, 264)
    check_against_float64(x, (264,), w, b, dy, f"{dtype} unaligned")


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_input_stays_in_its_row(device, value, gen):
    x, dy = (random_tensor((40, 96), torch.float16, device, gen) for _ in range(2))
    w, b = (random_tensor(96, torch.float16, device, gen) for _ in range(2))
    x[17, 5] = value
    y, dx, dw, db = (t.cpu() for t in run(mixprec.layer_norm, x, (96,), w, b, dy))
    assert torch.isnan(y[17]).any() and torch.isfinite(torch.cat([y[:17], y[18:]])).all()
    assert torch.isfinite(torch.cat([dx[:17], dx[18:]])).all()
    assert torch.isfinite(db).all()  # dy alone: the bad row's x never enters
    assert torch.isnan(dw).any()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_parameter_gradients_are_deterministic(device, dtype, gen):
    x, dy = (random_tensor((2053, 768), dtype, device, gen) for _ in range(2))
    w, b = (random_tensor(768, dtype, device, gen) for _ in range(2))
    first = run(mixprec.layer_norm, x, (768,), w, b, dy)
    for _ in range(2):
        again = run(mixprec.layer_norm, x, (768,), w, b, dy)
        assert all(torch.equal(a, f) for a, f in zip(again, first))


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)])
def test_backward_computes_what_the_mask_asks(device, mask, gen):
    x, dy = (random_tensor((300, 64), torch.bfloat16, device, gen) for _ in range(2))
    w = random_tensor(64, torch.bfloat16, device, gen)
    _, mean, rstd = torch.ops.mixprec.layer_norm_forward(x, w, None, 1e-5)
    got = torch.ops.mixprec.layer_norm_backward(dy, x, mean, rstd, w, list(mask))
    full = torch.ops.mixprec.layer_norm_backward(dy, x, mean, rstd, w, [True, True, True])
    for wanted, g, f in zip(mask, got, full):
        if wanted:
            assert torch.equal(g, f)
        else:
            assert g is None


def test_no_rows(device):
    x = torch.empty(0, 16, device=device)
    w = torch.ones(16, device=device, requires_grad=True)
    b = torch.zeros(16, device=device, requires_grad=True)
    y = mixprec.layer_norm(x, (16,), w, b)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w.grad.cpu(), torch.zeros(16)) and torch.equal(b.grad.cpu(), torch.zeros(16))


def test_frozen_parameters_get_no_gradient(device, gen):
    x = random_tensor((8, 32), torch.float32, device, gen).requires_grad_(True)
    w = random_tensor(32, torch.float32, device, gen)  # frozen
    b = random_tensor(32, torch.float32, device, gen).requires_grad_(True)
    mixprec.layer_norm(x, (32,), w, b).sum().backward()
    assert x.grad is not None and b.grad is not None and w.grad is None


def test_float64_uses_torchs_layer_norm(device, gen):
    x = torch.randn(4, 3, 5, dtype=torch.float64, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(5, dtype=torch.float64, generator=gen).to(device).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: mixprec.layer_norm(x, (5,), w), (x, w))


def test_bad_inputs_are_named(device):
    x, w = torch.zeros(4, 6, device=device), torch.zeros(6, device=device)
    check_rejected(lambda: mixprec.layer_norm(x, (5,), w), [x, w], ValueError, "layer_norm", "input")
    check_rejected(lambda: mixprec.layer_norm(x, (6,), w[:5]), [x, w], ValueError, "layer_norm", "weight")
    check_rejected(lambda: mixprec.layer_norm(x, (6,), None, w.view(2, 3)), [x, w], ValueError, "layer_norm", "bias")
    fwd = torch.ops.mixprec.layer_norm_forward
    check_rejected(lambda: fwd(x, w.half(), None, 1e-5), [x, w], TypeError, "layer_norm_forward", "weight")
    check_rejected(lambda: fwd(x.view(24), None, None, 1e-5), [x], ValueError, "layer_norm_forward", "input")
    check_rejected(lambda: fwd(x.t(), None, None, 1e-5), [x], RuntimeError, "layer_norm_forward", "input")
    check_rejected(lambda: fwd(x.to(torch.int32), None, None, 1e-5), [x], TypeError, "layer_norm_forward", "input")
    _, mean, rstd = fwd(x, w, None, 1e-5)
    bwd = torch.ops.mixprec.layer_norm_backward
    mask = [True, True, True]
    check_rejected(lambda: bwd(x[:3], x, mean, rstd, w, mask), [x, mean, rstd], ValueError, "layer_norm_backward",
                   "grad_out")
    check_rejected(lambda: bwd(x, x, mean.half(), rstd, w, mask), [x, mean, rstd], TypeError, "layer_norm_backward",
                   "mean")
    check_rejected(lambda: bwd(x, x, mean, rstd[:3], w, mask), [x, mean, rstd], ValueError, "layer_norm_backward",
                   "rstd")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_opcheck(device, dtype, gen):
    x, dy = (random_tensor((67, 40), dtype, device, gen) for _ in range(2))
    w, b = (random_tensor(40, dtype, device, gen) for _ in range(2))
    torch.library.opcheck(torch.ops.mixprec.layer_norm_forward.default, (x, w, b, 1e-5))
    _, mean, rstd = torch.ops.mixprec.layer_norm_forward(x, w, b, 1e-5)
    torch.library.opcheck(torch.ops.mixprec.layer_norm_backward.default, (dy, x, mean, rstd, w, [True, True, True]))
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    torch.library.opcheck(torch.ops.mixprec.layer_norm.default, (leaves[0], [40], leaves[1], leaves[2], 1e-5))


@pytest.mark.cuda
def test_captures_in_a_cuda_graph(gen):
    x = random_tensor((4096, 1280), torch.float16, "cuda", gen).requires_grad_(True)
    w = random_tensor(1280, torch.float16, "cuda", gen).requires_grad_(True)
    b = random_tensor(1280, torch.float16, "cuda", gen).requires_grad_(True)
    dy = random_tensor((4096, 1280), torch.float16, "cuda", gen)

    def step():
        for t in (x, w, b):
            t.grad = None
        mixprec.layer_norm(x, (1280,), w, b).backward(dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    captured = [t.grad for t in (x, w, b)]
    with torch.no_grad():
        dy.mul_(2)
    graph.replay()
    sync("cuda")
    replayed = [g.clone() for g in captured]
    step()
    assert all(torch.equal(r, t.grad) for r, t in zip(replayed, (x, w, b)))


@pytest.mark.cuda
def test_past_the_cuda_width_limit_torch_serves(gen):
    x, dy = (random_tensor((3, 12289), torch.float16, "cuda", gen) for _ in range(2))
    w = random_tensor(12289, torch.float16, "cuda", gen)
    ours = run(mixprec.layer_norm, x, (12289,), w, None, dy)
    torchs = run(F.layer_norm, x, (12289,), w, None, dy)
    assert all(torch.equal(a, t) for a, t in zip(ours[:3], torchs[:3]))
    _, mean, rstd = torch.ops.mixprec.layer_norm_forward(x, w, None, 1e-5)
    with pytest.raises(ValueError, match="mixprec::layer_norm_backward: input .* at most 12288"):
        torch.ops.mixprec.layer_norm_backward(dy, x, mean, rstd, w, [True, True, True])
