# Tests of mixprec.rms_norm and its ops (rms_norm_forward / rms_norm_backward) on CPU and CUDA
# against float64 references (F.rms_norm upcast), within twice torch's own error in the same dtype:
# widths around the vectors and the register-held strides, an fp32 weight on fp16/bf16 inputs,
# eps=None, poisoned outputs, deterministic weight gradients, masks, bad inputs, opcheck,
# torch.compile, and amp O2 swapping nn.RMSNorm.
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixprec
from conftest import FLOAT_DTYPES, check_rejected, peer_bound, random_tensor, rel_err

pytestmark = pytest.mark.usefixtures("poisoned_empty")  # an unwritten output element reads NaN

# (One column normalizes to +-1, whose input gradient is 0 up to eps: a relative error means nothing.)
WIDTHS = (2, 3, 7, 8, 255, 256, 257, 768, 1280)
ROWS = (1, 5, 129)
LOW = (torch.float16, torch.bfloat16)


def run(fn, x, normalized_shape, w, dy, eps):
    """Output and (input, weight) gradients of fn on leaf copies of the arguments."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w)]
    y = fn(leaves[0], normalized_shape, leaves[1], eps)
    y.backward(dy)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def default_eps(dtype: torch.dtype) -> float:
    """What eps=None means to torch's F.rms_norm kernels: the epsilon of the type they compute in
    (float32 for fp16/bf16), not finfo(dtype).eps as its documentation says."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def check_against_float64(x, normalized_shape, w, dy, what, eps=1e-5):
    """Output and gradients within twice the error of torch's rms_norm in x's dtype (weight cast
    to it), against float64; each in its dtype (the weight's gradient in the weight's)."""
    ours = run(mixprec.rms_norm, x, normalized_shape, w, dy, eps)
    peer = run(F.rms_norm, x, normalized_shape, None if w is None else w.to(x.dtype), dy, eps)
    as64 = [t.cpu().double() if t is not None else None for t in (x, w)]
    ref_eps = default_eps(x.dtype) if eps is None else eps
    ref = run(F.rms_norm, as64[0], normalized_shape, as64[1], dy.cpu().double(), ref_eps)
    dtypes = (x.dtype, x.dtype, None if w is None else w.dtype)
    for name, got, theirs, want, dtype in zip(("output", "grad input", "grad weight"), ours, peer, ref, dtypes):
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == dtype and got.shape == want.shape, f"{what} {name}"
        bound = peer_bound(x.dtype, theirs, want)
        err = rel_err(got, want)
        assert err <= bound, f"{what} {name}: relative error {err:.3g} > {bound:.3g} (torch's {rel_err(theirs, want):.3g})"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_matches_float64_within_torchs_error(device, dtype, rows, gen):
    for cols in WIDTHS:
        x, dy = (random_tensor((rows, cols), dtype, device, gen) for _ in range(2))
        w = random_tensor(cols, dtype, device, gen)
        check_against_float64(x, (cols,), w, dy, f"{dtype} [{rows}, {cols}]")


@pytest.mark.parametrize("dtype", LOW)
def test_fp32_weight_on_low_precision_input(device, dtype, gen):
    # Apex's MixedFusedRMSNorm: the weight stays fp32, the output takes the input's dtype and
    # the weight's gradient the weight's.
    for cols in (8, 257, 1024):
        x, dy = (random_tensor((67, cols), dtype, device, gen) for _ in range(2))
        w = random_tensor(cols, torch.float32, device, gen)
        check_against_float64(x, (cols,), w, dy, f"{dtype} input, fp32 weight, {cols}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("strides", range(1, 10))
def test_every_register_held_row_width_and_the_first_past_them(device, dtype, strides, gen):
    # As layer_norm's: each of the CUDA kernels' stride counts at its widest and with a short
    # last vector, and 9 strides (re-read from the cache).
    lane_cols = 32 * (16 // torch.empty((), dtype=dtype).element_size())
    for cols in (strides * lane_cols, strides * lane_cols - 3) if strides <= 8 else (8 * lane_cols + 1,):
        x, dy = (random_tensor((37, cols), dtype, device, gen) for _ in range(2))
        w = random_tensor(cols, dtype, device, gen)
        check_against_float64(x, (cols,), w, dy, f"{dtype} [37, {cols}]")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_eps_none_is_torchs_default_and_no_weight(device, dtype, gen):
    # Small rows, so that eps matters (bf16's 2^-7 against float32's 1.2e-7 changes the output).
    x, dy = (random_tensor((33, 96), dtype, device, gen, scale=0.05) for _ in range(2))
    torch.testing.assert_close(mixprec.rms_norm(x, (96,)), F.rms_norm(x, (96,)), msg=f"{dtype} eps=None")
    check_against_float64(x, (96,), None, dy, f"{dtype} eps=None", eps=None)
    w = random_tensor(96, dtype, device, gen)
    check_against_float64(x, (96,), w, dy, f"{dtype} eps=None, weight", eps=None)


def test_several_normalized_dimensions_and_a_non_contiguous_input(device, gen):
    x = random_tensor((6, 5, 9, 4), torch.float32, device, gen).transpose(0, 1)  # not contiguous
    w = random_tensor((9, 4), torch.float32, device, gen)
    dy = random_tensor((5, 6, 9, 4), torch.float32, device, gen)
    check_against_float64(x, (9, 4), w, dy, "normalized (9, 4)")
    _, rstd = torch.ops.mixprec.rms_norm_forward(x.contiguous(), [9, 4], w, 1e-5)
    assert rstd.shape == (5, 6) and rstd.dtype == torch.float32


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unaligned_rows(device, dtype, gen):
    x = random_tensor(65 * 264 + 1, dtype, device, gen)[1:].view(65, 264)
    dy = random_tensor(65 * 264 + 1, dtype, device, gen)[1:].view(65, 264)
    w = random_tensor(264 + 1, torch.float32, device, gen)[1:]
    check_against_float64(x, (264,), w, dy, f"{dtype} unaligned")


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_input_stays_in_its_row(device, value, gen):
    x, dy = (random_tensor((40, 96), torch.float16, device, gen) for _ in range(2))
    w = random_tensor(96, torch.float16, device, gen)
    x[17, 5] = value
    y, dx, dw = (t.cpu() for t in run(mixprec.rms_norm, x, (96,), w, dy, 1e-5))
    assert torch.isnan(y[17]).any() and torch.isfinite(torch.cat([y[:17], y[18:]])).all()
    assert torch.isfinite(torch.cat([dx[:17], dx[18:]])).all()
    assert torch.isnan(dw).any()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_weight_gradient_is_deterministic(device, dtype, gen):
    x, dy = (random_tensor((2053, 768), dtype, device, gen) for _ in range(2))
    w = random_tensor(768, dtype, device, gen)
    first = run(mixprec.rms_norm, x, (768,), w, dy, 1e-5)
    for _ in range(2):
        again = run(mixprec.rms_norm, x, (768,), w, dy, 1e-5)
        assert all(torch.equal(a, f) for a, f in zip(again, first))


@pytest.mark.parametrize("mask", [(True, False), (False, True)])
def test_backward_computes_what_the_mask_asks(device, mask, gen):
    x, dy = (random_tensor((300, 64), torch.bfloat16, device, gen) for _ in range(2))
    w = random_tensor(64, torch.float32, device, gen)
    _, rstd = torch.ops.mixprec.rms_norm_forward(x, [64], w, 1e-5)
    got = torch.ops.mixprec.rms_norm_backward(dy, x, [64], rstd, w, list(mask))
    full = torch.ops.mixprec.rms_norm_backward(dy, x, [64], rstd, w, [True, True])
    for wanted, g, f in zip(mask, got, full):
        assert torch.equal(g, f) if wanted else g is None


def test_no_rows_and_frozen_weight(device, gen):
    w = torch.ones(16, device=device, requires_grad=True)
    y = mixprec.rms_norm(torch.empty(0, 16, device=device), (16,), w)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w.grad.cpu(), torch.zeros(16))
    x = random_tensor((8, 32), torch.float32, device, gen).requires_grad_(True)
    frozen = random_tensor(32, torch.float32, device, gen)
    mixprec.rms_norm(x, (32,), frozen).sum().backward()
    assert x.grad is not None and frozen.grad is None


def test_float64_uses_torchs_rms_norm(device, gen):
    x = torch.randn(4, 3, 5, dtype=torch.float64, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(5, dtype=torch.float64, generator=gen).to(device).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: mixprec.rms_norm(x, (5,), w), (x, w))


def test_bad_inputs_are_named_and_change_nothing(device):
    x, w = torch.ones(4, 6, device=device), torch.ones(6, device=device)
    fwd, bwd = torch.ops.mixprec.rms_norm_forward, torch.ops.mixprec.rms_norm_backward
    check_rejected(lambda: mixprec.rms_norm(x, (5,), w), [x, w], ValueError, "rms_norm_forward", "input")
    check_rejected(lambda: mixprec.rms_norm(x, (6,), w[:5]), [x, w], ValueError, "rms_norm_forward", "weight")
    check_rejected(lambda: fwd(x.half(), [6], w.bfloat16(), 1e-5), [x, w], TypeError, "rms_norm_forward", "weight")
    check_rejected(lambda: fwd(x, [6], w.half(), 1e-5), [x, w], TypeError, "rms_norm_forward", "weight")
    check_rejected(lambda: fwd(x.t(), [4], None, 1e-5), [x], RuntimeError, "rms_norm_forward", "input")
    check_rejected(lambda: fwd(x.to(torch.int32), [6], None, 1e-5), [x], TypeError, "rms_norm_forward", "input")
    _, rstd = fwd(x, [6], w, 1e-5)
    check_rejected(lambda: bwd(x[:3], x, [6], rstd, w, [True, True]), [x, rstd], ValueError, "rms_norm_backward",
                   "grad_out")
    check_rejected(lambda: bwd(x, x, [6], rstd.half(), w, [True, True]), [x, rstd], TypeError, "rms_norm_backward",
                   "rstd")
    check_rejected(lambda: bwd(x, x, [6], rstd[:3], w, [True, True]), [x, rstd], ValueError, "rms_norm_backward",
                   "rstd")


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.float32)], ids=str)
def test_opcheck(device, dtype, weight_dtype, gen):
    x, dy = (random_tensor((67, 40), dtype, device, gen) for _ in range(2))
    w = random_tensor(40, weight_dtype, device, gen)
    torch.library.opcheck(torch.ops.mixprec.rms_norm_forward.default, (x, [40], w, 1e-5))
    _, rstd = torch.ops.mixprec.rms_norm_forward(x, [40], w, 1e-5)
    torch.library.opcheck(torch.ops.mixprec.rms_norm_backward.default, (dy, x, [40], rstd, w, [True, True]))
    leaves = [t.detach().requires_grad_(True) for t in (x, w)]
    torch.library.opcheck(torch.ops.mixprec.rms_norm.default, (leaves[0], [40], leaves[1], None))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_traces_through(device, backend, gen):
    torch._dynamo.reset()
    x = random_tensor((8, 3, 64), torch.bfloat16, device, gen).requires_grad_(True)
    w = random_tensor(64, torch.float32, device, gen).requires_grad_(True)

    def f(x, w):
        return mixprec.rms_norm(x, 64, w, eps=1e-6).float().square().sum()

    eager = f(x, w)
    grads = torch.autograd.grad(eager, (x, w))
    compiled = torch.compile(f, backend=backend, fullgraph=True)(x, w)
    assert torch.equal(compiled, eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(compiled, (x, w)), grads))


def test_amp_o2_swaps_and_trains_rms_norm(device):
    from mixprec import amp
    from mixprec.amp import _layers
    from mixprec.optimizers import FusedAdam

    def train(layer_kernels):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.RMSNorm(64), torch.nn.GELU(),
                                    torch.nn.RMSNorm(64, elementwise_affine=False), torch.nn.Linear(64, 8)).to(device)
        opt = FusedAdam(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0,
                                    layer_kernels=layer_kernels)
        gen = torch.Generator().manual_seed(4)
        losses = []
        for _ in range(6):
            x, y = torch.randn(32, 16, generator=gen).to(device), torch.randn(32, 8, generator=gen).to(device)
            loss = F.mse_loss(model(x).float(), y)
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return model, losses

    model, ours = train(True)
    peer, theirs = train(False)
    assert type(model[1]) is _layers.RMSNorm and type(model[3]) is _layers.RMSNorm
    assert type(peer[1]) is torch.nn.RMSNorm
    assert model[1].weight.grad is not None and ours[-1] < ours[0]
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
