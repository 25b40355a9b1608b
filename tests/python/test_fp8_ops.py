# Tests of the FP8 op family (fp8_quantize, fp8_amax_, fp8_update_scale_) on CPU and CUDA: bit-exact
# against torch's own FP8 conversion of the saturated value and a float64 round-to-nearest-even model.
from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    NON_FINITE,
    assert_unchanged,
    boundary_sizes,
    check_rejected,
    inject_non_finite,
    random_tensor,
    scalar,
    snapshot,
    sync,
    unaligned_view,
)

import mixprec

pytestmark = pytest.mark.usefixtures("poisoned_empty")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def torch_reference(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """torch's conversion of x * scale (in fp32, as the kernel multiplies) saturated to the range."""
    m = FP8_MAX[dtype]
    return (x.detach().cpu().float() * torch.tensor(scale, dtype=torch.float32)).clamp(-m, m).to(dtype)


def f64_reference(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """An independent model: the nearest of the format's 2^8 values to the fp32 product (ties to the
    even code), found in float64 by a search over the table of all finite codes."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    finite = codes.isfinite() & (torch.arange(256) < 128)  # the non-negative codes (not -0)
    values, order = codes[finite].sort()
    code_of = torch.arange(256)[finite][order]
    v = (x.detach().cpu().float() * torch.tensor(scale, dtype=torch.float32)).double().flatten()
    a = v.abs().clamp(max=FP8_MAX[dtype])
    hi = torch.searchsorted(values, a).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - values[lo], values[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (code_of[hi] % 2 == 0))
    code = torch.where(pick_hi, code_of[hi], code_of[lo])
    code = code | torch.where(v.signbit(), 0x80, 0)
    code = torch.where(v.isnan(), code | 0x7F, code)
    return code.to(torch.uint8).view(dtype).view(x.shape)


def assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Bit equality of FP8 codes, except that any NaN matches any NaN of the same sign."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, msg
    a, e = actual.cpu().view(torch.uint8).int(), expected.cpu().view(torch.uint8).int()
    nan = actual.cpu().float().isnan() & expected.cpu().float().isnan()
    bad = (a != e) & ~(nan & ((a & 0x80) == (e & 0x80)))
    if bool(bad.any()):
        i = bad.flatten().nonzero()[0].item()
        raise AssertionError(f"{msg}: {int(bad.sum())} of {a.numel()} codes differ; first at flat {i}: "
                             f"{a.flatten()[i].item():#04x} != {e.flatten()[i].item():#04x}")


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Every FP8 value, every midpoint between neighbours (the ties), one fp32 ulp either side of
    each, values past the max, fp32 subnormals, zeros, inf and NaN, with both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    pos = codes[codes.isfinite() & (codes >= 0)].sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(0.0))])
    m = FP8_MAX[dtype]
    extra = torch.tensor([m * 1.0001, m * 1.03, m * 1.5, m * 2, 3e38, 1e-45, 1e-40, 0.0, math.inf, math.nan])
    v = torch.cat([pos, mids, near, pos.nextafter(torch.tensor(math.inf)), extra])
    return torch.cat([v, -v])


@pytest.mark.parametrize("fp8", FP8)
def test_every_boundary_value_rounds_like_torch_and_float64(device, fp8):
    x = edge_values(fp8)
    out, out_t = mixprec.fp8_quantize(x.to(device), scalar(1.0, device), fp8)
    assert out_t is None and out.dtype == fp8 and out.device.type == torch.device(device).type
    assert_fp8_equal(out, torch_reference(x, 1.0, fp8), "vs torch")
    assert_fp8_equal(out, f64_reference(x, 1.0, fp8), "vs float64 model")


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("in_dtype", (torch.float16, torch.bfloat16))
def test_every_half_precision_input_bit_pattern(device, fp8, in_dtype, gen):
    # All 65536 bit patterns of the input dtype, with scale 1 and a random non-power-of-two scale.
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(in_dtype)
    for s in (1.0, float(torch.empty(1).uniform_(0.01, 100.0, generator=gen))):
        out, _ = mixprec.fp8_quantize(x.to(device), scalar(s, device), fp8)
        assert_fp8_equal(out, torch_reference(x, s, fp8), f"scale {s} vs torch")
        assert_fp8_equal(out, f64_reference(x, s, fp8), f"scale {s} vs float64 model")


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_flat_cast_boundary_sizes_and_amax(device, fp8, in_dtype, gen, rng):
    for n in boundary_sizes(rng)[:6] + [0, 1, 15, 16, 17]:
        # Magnitudes spread over 2^-24 .. 2^24 so that saturation, normals and subnormals all occur.
        x = random_tensor(n, torch.float32, "cpu", gen) * torch.rand(n, generator=gen).mul(48).sub(24).exp2()
        x = x.to(in_dtype).to(device)
        s = float(torch.empty(1).uniform_(0.5, 4.0, generator=gen))
        prior = 0.0 if n % 2 else 2.0 ** -10
        amax = scalar(prior, device)
        out, _ = mixprec.fp8_quantize(x, scalar(s, device), fp8, amax=amax)
        sync(device)
        assert out.shape == x.shape
        assert_fp8_equal(out, torch_reference(x, s, fp8), f"n={n}")
        expected = max(prior, x.detach().cpu().double().abs().max().item() if n else 0.0)
        assert amax.item() == expected, f"n={n}: amax {amax.item()} != {expected}"


@pytest.mark.parametrize("fp8", FP8)
def test_unaligned_input_takes_the_element_path(device, fp8, gen):
    for in_dtype in IN_DTYPES:
        x, base = unaligned_view(1000 + 3, in_dtype, device, gen, scale=100.0)
        before = base.clone()
        out, _ = mixprec.fp8_quantize(x, scalar(2.0, device), fp8)
        assert_fp8_equal(out, torch_reference(x, 2.0, fp8), f"{in_dtype}")
        assert torch.equal(base, before)


@pytest.mark.parametrize("shape", [(1, 1), (1, 37), (37, 1), (31, 33), (32, 64), (63, 65), (64, 64), (129, 31),
                                   (65, 130), (0, 5), (5, 0), (256, 48)])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_transpose_is_the_cast_transposed(device, shape, in_dtype, gen):
    fp8 = torch.float8_e4m3fn if shape[0] % 2 else torch.float8_e5m2
    x = random_tensor(shape, in_dtype, device, gen, scale=300.0)
    amax = scalar(0.0, device)
    out, out_t = mixprec.fp8_quantize(x, scalar(1.5, device), fp8, transpose=True, amax=amax)
    assert out_t.shape == (shape[1], shape[0]) and out_t.is_contiguous()
    ref = torch_reference(x, 1.5, fp8)
    assert_fp8_equal(out, ref, "out")
    assert_fp8_equal(out_t, ref.t().contiguous(), "out_t")
    expected = x.double().abs().max().item() if x.numel() else 0.0
    assert amax.item() == expected


@pytest.mark.parametrize("where", ("first", "last", "random"))
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("transpose", (False, True))
def test_non_finite_inputs(device, where, value, transpose, gen):
    # inf saturates to +-max, NaN stays NaN; the amax shows either (NaN above inf).
    for in_dtype in IN_DTYPES:
        x = random_tensor((70, 66), torch.float32, "cpu", gen, scale=10.0)
        pos = inject_non_finite(x, where, value, gen)
        x = x.to(in_dtype).to(device)
        amax = scalar(5.0, device)
        out, out_t = mixprec.fp8_quantize(x, scalar(3.0, device), torch.float8_e4m3fn, transpose=transpose,
                                          amax=amax)
        ref = torch_reference(x, 3.0, torch.float8_e4m3fn)
        assert_fp8_equal(out, ref, f"{value} at {where}")
        if transpose:
            assert_fp8_equal(out_t, ref.t().contiguous(), "out_t")
        got = out.float().flatten()[pos].item()
        assert (math.isnan(got) if math.isnan(value) else got == math.copysign(448.0, value))
        a = amax.item()
        assert math.isnan(a) if math.isnan(value) else a == math.inf
        standalone = scalar(0.0, device)
        mixprec.fp8_amax_(x, standalone)
        assert bits_equal(standalone, amax)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (math.isnan(a.item()) and math.isnan(b.item())) or a.item() == b.item()


def test_amax_alone_accumulates(device, gen):
    for in_dtype in IN_DTYPES:
        xs = [random_tensor(n, in_dtype, device, gen, scale=s) for n, s in ((1000, 1.0), (70001, 30.0), (3, 0.1))]
        amax = scalar(0.0, device)
        for x in xs:
            mixprec.fp8_amax_(x, amax)
        assert amax.item() == max(x.double().abs().max().item() for x in xs)


# ---- the scale update ---------------------------------------------------------------------------


def model_update(scale: float, history: list[float], amax: float, fp8: torch.dtype, margin: float,
                 reduction: str) -> tuple[float, list[float]]:
    history = [amax] + history[:-1]
    r = max(history, key=lambda v: math.inf if math.isnan(v) else v) if reduction == "max" else history[0]
    if r == 0 or not math.isfinite(r):
        return scale, history
    s = float(torch.tensor(FP8_MAX[fp8] / r * 2.0 ** -margin, dtype=torch.float64).float())
    return (s if 0 < s < math.inf else scale), history


@pytest.mark.parametrize("reduction", ("max", "most_recent"))
@pytest.mark.parametrize("length", (1, 3, 1024))
def test_update_scale_follows_the_float64_model(device, reduction, length, gen, rng):
    fp8 = rng.choice(FP8)
    margin = rng.choice((0.0, 1.0, 2.5))
    scale_t, hist_t, amax_t = scalar(1.0, device), torch.zeros(length, device=device), scalar(0.0, device)
    scale, hist = 1.0, [0.0] * length
    amaxes = [0.0] + [float(torch.rand(1, generator=gen)) * 10 ** rng.randint(-40, 38) for _ in range(20)]
    amaxes[rng.randrange(1, 21)] = math.inf
    amaxes[rng.randrange(1, 21)] = math.nan
    amaxes[rng.randrange(1, 21)] = 1e-45  # fp8_max / amax overflows: the scale is kept
    for step, a in enumerate(amaxes):
        amax_t.fill_(a)
        mixprec.fp8_update_scale_(scale_t, hist_t, amax_t, fp8, margin, reduction)
        scale, hist = model_update(scale, hist, float(torch.tensor(a).float()), fp8, margin, reduction)
        assert amax_t.item() == 0.0
        assert bits_equal(scale_t, torch.tensor(scale)), f"step {step}: {scale_t.item()} != {scale}"
        got = hist_t.cpu().tolist()
        assert all((math.isnan(g) and math.isnan(h)) or g == h for g, h in zip(got, hist)), f"step {step}"


def test_current_scaling_in_three_ops_saturates_nothing(device, gen):
    x = random_tensor((96, 80), torch.bfloat16, device, gen, scale=1e-3)
    scale, hist, amax = scalar(1.0, device), torch.zeros(1, device=device), scalar(0.0, device)
    mixprec.fp8_amax_(x, amax)
    mixprec.fp8_update_scale_(scale, hist, amax, torch.float8_e4m3fn)
    assert scale.item() == pytest.approx(448.0 / x.double().abs().max().item(), rel=1e-6)
    out, _ = mixprec.fp8_quantize(x, scale, torch.float8_e4m3fn)
    assert out.float().abs().max().item() == 448.0  # the largest element lands on the max, none past it


# ---- bad input: a clear error, nothing changed ------------------------------------------------------------


def test_quantize_rejects_bad_arguments(device, gen):
    x = random_tensor((16, 16), torch.bfloat16, device, gen)
    s, amax = scalar(1.0, device), scalar(0.5, device)
    e4 = torch.float8_e4m3fn
    q = mixprec.fp8_quantize
    check_rejected(lambda: q(x.double(), s, e4, amax=amax), [x, s, amax], TypeError, "fp8_quantize", "x")
    check_rejected(lambda: q(x.int(), s, e4, amax=amax), [x, s, amax], TypeError, "fp8_quantize", "x")
    check_rejected(lambda: q(x.t(), s, e4, amax=amax), [x, s, amax], ValueError, "fp8_quantize", "x")
    check_rejected(lambda: q(x.view(2, 8, 16), s, e4, transpose=True, amax=amax), [x, s, amax], ValueError,
                   "fp8_quantize", "x")
    check_rejected(lambda: q(x, s, torch.float16, amax=amax), [x, s, amax], TypeError, "fp8_quantize", "dtype")
    check_rejected(lambda: q(x, s.double(), e4, amax=amax), [x, s, amax], TypeError, "fp8_quantize", "scale")
    check_rejected(lambda: q(x, torch.ones(2, device=device), e4, amax=amax), [x, s, amax], ValueError,
                   "fp8_quantize", "scale")
    check_rejected(lambda: q(x, s, e4, amax=amax.half()), [x, s, amax], TypeError, "fp8_quantize", "amax")
    check_rejected(lambda: q(x, s, e4, amax=torch.zeros(3, device=device)), [x, s, amax], ValueError,
                   "fp8_quantize", "amax")
    xf = x.float()
    check_rejected(lambda: q(xf, s, e4, amax=xf.view(-1)[3:4]), [xf, s], ValueError, "fp8_quantize", "amax")
    check_rejected(lambda: mixprec.fp8_amax_(x.t(), amax), [x, amax], ValueError, "fp8_amax_", "x")
    if device == "cuda":
        check_rejected(lambda: q(x, s.cpu(), e4), [x, s], RuntimeError, "fp8_quantize", "scale")


def test_update_scale_rejects_bad_arguments(device):
    s, h, a = scalar(2.0, device), torch.full((4,), 3.0, device=device), scalar(7.0, device)
    u = mixprec.fp8_update_scale_
    e4 = torch.float8_e4m3fn
    state = [s, h, a]
    check_rejected(lambda: u(s, h, a, e4, -1.0), state, ValueError, "fp8_update_scale_", "margin")
    check_rejected(lambda: u(s, h, a, e4, math.nan), state, ValueError, "fp8_update_scale_", "margin")
    check_rejected(lambda: u(s, h, a, e4, 0.0, "mean"), state, ValueError, "fp8_update_scale_", "reduction")
    check_rejected(lambda: u(s, h, a, torch.bfloat16), state, TypeError, "fp8_update_scale_", "dtype")
    check_rejected(lambda: u(s, h.view(2, 2), a, e4), state, ValueError, "fp8_update_scale_", "amax_history")
    check_rejected(lambda: u(s, h[:0], a, e4), state, ValueError, "fp8_update_scale_", "amax_history")
    check_rejected(lambda: u(s, h.double(), a, e4), state, TypeError, "fp8_update_scale_", "amax_history")
    check_rejected(lambda: u(s.half(), h, a, e4), state, TypeError, "fp8_update_scale_", "scale")
    check_rejected(lambda: u(s, h, a.view(1, 1).expand(2, 1), e4), state, ValueError, "fp8_update_scale_", "amax")
    before = snapshot(state)
    with pytest.raises(ValueError, match="mixprec::fp8_update_scale_: amax and amax_history share memory"):
        u(s, h, h[1:2], e4)
    assert_unchanged(before, state)


# ---- dispatcher: opcheck (schema, fake tensors, autograd registration) ------------------------


def test_opcheck(device, gen):
    x = random_tensor((48, 32), torch.bfloat16, device, gen, scale=50.0)
    for fp8 in FP8:
        for transpose in (False, True):
            torch.library.opcheck(torch.ops.mixprec.fp8_quantize.default,
                                  (x, scalar(2.0, device), fp8, transpose, scalar(0.0, device)))
        torch.library.opcheck(torch.ops.mixprec.fp8_quantize.default, (x.float().view(3, 16, 32),
                                                                       scalar(0.5, device), fp8))
    torch.library.opcheck(torch.ops.mixprec.fp8_amax_.default, (x, scalar(0.0, device)))
    torch.library.opcheck(torch.ops.mixprec.fp8_update_scale_.default,
                          (scalar(1.0, device), torch.rand(5, device=device), scalar(3.0, device),
                           torch.float8_e5m2, 1.0, "most_recent"))


@pytest.mark.cuda
def test_cuda_ops_never_sync():
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    scale, hist, amax = scalar(1.0, "cuda"), torch.zeros(16, device="cuda"), scalar(0.0, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mixprec.fp8_amax_(x, amax)
        mixprec.fp8_update_scale_(scale, hist, amax, torch.float8_e4m3fn)
        mixprec.fp8_quantize(x, scale, torch.float8_e4m3fn, transpose=True, amax=amax)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert amax.item() == x.float().abs().max().item()


@pytest.mark.cuda
def test_cuda_graph_replays_current_scaling():
    # Scale and amax live on the device, so current scaling's three ops capture in one graph and a
    # replay on new data equals the eager ops.
    e4 = torch.float8_e4m3fn
    x = torch.randn(256, 192, device="cuda", dtype=torch.bfloat16)
    scale, hist, amax = scalar(1.0, "cuda"), torch.zeros(1, device="cuda"), scalar(0.0, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mixprec.fp8_quantize(x, scale, e4, transpose=True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mixprec.fp8_amax_(x, amax)
        mixprec.fp8_update_scale_(scale, hist, amax, e4)
        out, out_t = mixprec.fp8_quantize(x, scale, e4, transpose=True)
    for mag in (3.0, 1e-3):
        x.copy_(torch.randn(256, 192, device="cuda", dtype=torch.bfloat16) * mag)
        graph.replay()
        torch.cuda.synchronize()
        s = 448.0 / x.float().abs().max().item()
        assert scale.item() == pytest.approx(s, rel=1e-6)
        ref = torch_reference(x, scale.item(), e4)
        assert_fp8_equal(out, ref, f"graph out, magnitude {mag}")
        assert_fp8_equal(out_t, ref.t().contiguous(), f"graph out_t, magnitude {mag}")
