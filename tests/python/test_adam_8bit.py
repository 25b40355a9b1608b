# The adam_ op with 8-bit block-quantized moments (issue 24; kernels/quant8.h): the code map against
# a float64 reference, one step against dequantize + the fp32 step + requantize, skipped steps, refusals.
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mixprec
from conftest import assert_bitwise_equal, assert_unchanged, random_tensor, scalar, snapshot

BLOCK = 256
MANT_M, MANT_S = 3, 4  # exp_avg: sign + 7 bits; sqrt(exp_avg_sq): 8 bits (the documented map)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


# ---- the float64 reference of the documented code map --------------------------------------------

def table(mant: int) -> np.ndarray:
    """Every code's value x in [0, 1], from the map's definition (not from the kernels' bit tricks)."""
    c = np.arange((15 << mant) + 1)
    e, f = c >> mant, c & ((1 << mant) - 1)
    return np.where(e == 0, f * 2.0 ** -(14 + mant), 2.0 ** (e - 15.0) * (1 + f / 2.0**mant))


def nearest_codes(x: np.ndarray, mant: int) -> np.ndarray:
    """The code nearest to each x (float64 in [0, 1]), ties to the even code."""
    t = table(mant)
    hi = np.clip(np.searchsorted(t, x, side="left"), 1, len(t) - 1)
    lo = hi - 1
    d_lo, d_hi = x - t[lo], t[hi] - x
    return np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)


def _blocks(a: np.ndarray) -> list[np.ndarray]:
    return [a[i:i + BLOCK] for i in range(0, a.size, BLOCK)]


def ref_quantize(values: np.ndarray, mant: int, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """float32 values (storage order) -> (codes, float32 scales): per block A = max|value|,
    x = float32(|value| / A), code = the nearest on the map."""
    codes, scales = [], []
    for b in _blocks(values.astype(np.float32)):
        a = np.abs(b).max()
        x = (np.abs(b) / a).astype(np.float64) if a > 0 else np.zeros(b.size)
        c = nearest_codes(x, mant)
        codes.append(np.where(b < 0, -c, c) if signed else c)
        scales.append(a)
    return np.concatenate(codes), np.array(scales, dtype=np.float32)


def ref_decode(codes: np.ndarray, scales: np.ndarray, mant: int) -> np.ndarray:
    """codes -> float32 values x * A (the float64 product of the two is exact, so one rounding)."""
    a = np.repeat(scales.astype(np.float64), BLOCK)[:codes.size]
    v = (table(mant)[np.abs(codes)] * a).astype(np.float32)
    return np.where(codes < 0, -v, v)


def ref_state(m: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float moments -> (int8 codes, scales, uint8 codes of sqrt(v), scales) in m's layout."""
    flat = lambda t: t.detach().cpu().float().as_strided((t.numel(),), (1,)).numpy()
    cm, sm = ref_quantize(flat(m), MANT_M, True)
    cs, ss = ref_quantize(np.sqrt(flat(v)), MANT_S, False)
    codes_m = torch.empty_like(m, dtype=torch.int8)
    codes_s = torch.empty_like(m, dtype=torch.uint8)
    codes_m.as_strided((m.numel(),), (1,)).copy_(torch.from_numpy(cm.astype(np.int8)))
    codes_s.as_strided((m.numel(),), (1,)).copy_(torch.from_numpy(cs.astype(np.uint8)))
    dev = m.device
    return codes_m, torch.from_numpy(sm).to(dev), codes_s, torch.from_numpy(ss).to(dev)


def ref_moments(codes_m, sm, codes_s, ss) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 moments an 8-bit state stands for, in the codes' layout."""
    flat = lambda t: t.detach().cpu().as_strided((t.numel(),), (1,)).numpy()
    m = ref_decode(flat(codes_m).astype(np.int64), flat(sm), MANT_M)
    s = ref_decode(flat(codes_s).astype(np.int64), flat(ss), MANT_S)
    v = (s.astype(np.float64) ** 2).astype(np.float32)
    out_m, out_v = torch.empty_like(codes_m, dtype=torch.float32), torch.empty_like(codes_m, dtype=torch.float32)
    out_m.as_strided((m.size,), (1,)).copy_(torch.from_numpy(m))
    out_v.as_strided((m.size,), (1,)).copy_(torch.from_numpy(v))
    return out_m.to(codes_m.device), out_v.to(codes_m.device)


def state_of(params, gen, device):
    """A valid 8-bit state per param: random moments (wide magnitudes, some zero blocks) quantized."""
    out = []
    for p in params:
        m = random_tensor(p.shape, torch.float32, "cpu", gen) * torch.exp2(torch.randint(-20, 4, p.shape, generator=gen))
        v = random_tensor(p.shape, torch.float32, "cpu", gen).square() * 1e-3
        m.view(-1)[:BLOCK] = 0.0  # an all-zero first block: scale 0
        cm, sm, cs, ss = ref_state(m, v)
        layout = lambda c: torch.empty_like(p, dtype=c.dtype).copy_(c)
        out.append((layout(cm), sm.to(device), layout(cs), ss.to(device)))
    return [[s[k] for s in out] for k in range(4)]


def adam8(params, grads, state, **kw):
    cm, sm, cs, ss = state
    mixprec.adam_(params, grads, cm, cs, exp_avg_scales=sm, exp_avg_sq_scales=ss, **kw)


# ---- the code map -----------------------------------------------------------------------------------

SIZES = [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 65536 + 300]


def values_of(kind: str, n: int, gen) -> torch.Tensor:
    x = random_tensor(n, torch.float32, "cpu", gen)
    if kind == "wide":  # magnitudes over 2^-40 .. 2^8 in each block: the map's range and past it
        return x * torch.exp2(torch.randint(-40, 8, (n,), generator=gen)).float()
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "subnormal":  # float32 subnormals: the scale itself is one
        return x * 1e-41
    if kind == "huge":
        return x * 1e18  # squares stay finite
    if kind == "equal":
        return torch.full((n,), -3.0)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["wide", "zeros", "subnormal", "huge", "equal"])
@pytest.mark.parametrize("n", SIZES)
def test_quantizer_matches_the_float64_map_and_its_error_bound(kind, n, device, gen):
    # beta1 = beta2 = 0 and lr = 0: the step stores exactly m = g and v = g*g, so the codes it
    # writes are the quantizer's of values we choose.
    g = values_of(kind, n, gen)
    p = random_tensor(n, torch.float32, device, gen)
    state = [torch.full((n,), 77, dtype=torch.int8, device=device), torch.full((-(-n // BLOCK),), 5.0, device=device),
             torch.full((n,), 99, dtype=torch.uint8, device=device), torch.full((-(-n // BLOCK),), 5.0, device=device)]
    before = p.clone()
    adam8([p], [g.to(device)], [[t] for t in state], lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, step=1)
    assert_bitwise_equal(p, before, "lr=0 moved the param")
    want = ref_state(g, g * g)
    for got, exp, what in zip(state, want, ["exp_avg codes", "exp_avg scales", "exp_avg_sq codes", "exp_avg_sq scales"]):
        assert_bitwise_equal(got.cpu(), exp.cpu(), f"{kind} n={n}: {what}")
    # The documented bound, against the exact values in float64.
    m, v = ref_moments(*[t.cpu() for t in state])
    for mant, exact, got, scales in [(MANT_M, g.double(), m.double(), state[1]),
                                     (MANT_S, (g * g).sqrt().double(), v.double().sqrt(), state[3])]:
        a = scales.cpu().double().repeat_interleave(BLOCK)[:n]
        # (+ 2^-149: float32's own rounding of a subnormal decoded product, for subnormal scales)
        bound = torch.maximum(2.0 ** -(mant + 1) * exact.abs(), 2.0 ** -(15 + mant) * a) * (1 + 2.0**-16) + 2.0**-149
        err = (got - exact).abs()
        assert bool((err <= bound).all()), f"{kind} n={n}: error {float((err - bound).max())} past the bound"
    # Each block's absmax decodes exactly: no drift of the scale over steps.
    if kind != "zeros":
        assert bool((m.abs().max() == g.abs().max()))


def test_map_constants_and_worst_case():
    # 121 (exp_avg) and 241 codes; the largest relative gap between neighbours in the normal range
    # is 2^-M at the bottom of a binade, so a round trip errs by at most half of it.
    t3, t4 = table(MANT_M), table(MANT_S)
    assert len(t3) == 121 and len(t4) == 241 and t3[-1] == 1.0 and t4[-1] == 1.0
    normal = t3[8:]
    assert np.max(np.diff(normal) / normal[:-1]) == 2.0**-3
    x = np.float64(1.0 + 2.0**-4)  # midway between 1 and 1.125: the worst case, ties to 1 (even)
    assert nearest_codes(np.array([x / 2]), MANT_M)[0] == 112  # code 112 = 2^-1, even


# ---- one step ----------------------------------------------------------------------------------------

CASES = {
    "fp32": dict(dtype=torch.float32),
    "fp32_l2_maximize": dict(dtype=torch.float32, kw=dict(adam_w_mode=False, weight_decay=0.1, maximize=True)),
    "fp32_grad_scale": dict(dtype=torch.float32, grad_scale=1024.0, kw=dict(weight_decay=0.05)),
    "bf16_masters": dict(dtype=torch.bfloat16, masters="fp32"),
    "bf16_remainder": dict(dtype=torch.bfloat16, masters="remainder", grad_scale=8.0),
    "bf16_stochastic": dict(dtype=torch.bfloat16, kw=dict(stochastic_rounding=True, seed=3)),
    "fp16_masters_no_bias_correction": dict(dtype=torch.float16, masters="fp32", kw=dict(bias_correction=False)),
    "channels_last": dict(dtype=torch.float32, channels_last=True),
}
SHAPES = [(3, 5), (BLOCK,), (2, BLOCK + 1), (65536 + 2 * BLOCK + 3,)]


def make_params(case, device, gen):
    shapes = [(2, 3, 9, 13), (4, 8, 3, 3)] if case.get("channels_last") else SHAPES
    masters, dtype = case.get("masters"), case["dtype"]
    params, extra = [], []
    for s in shapes:
        w = random_tensor(s, torch.float32, device, gen)
        if case.get("channels_last"):
            w = w.contiguous(memory_format=torch.channels_last)
        params.append(w.to(dtype))
        if masters == "fp32":
            extra.append(w.clone())
        elif masters == "remainder":
            extra.append((w.view(torch.int32) & 0xFFFF).to(torch.int16))
            params[-1] = ((w.view(torch.int32) >> 16).to(torch.int16)).view(torch.bfloat16)
    return params, extra


def check_step(params, grads, masters, state, kw, what):
    """One 8-bit step against its reference: the fp32 moments decoded from the state, the fp32
    op's step on them (checked against float64 in test_adam.py), its moments requantized by the
    reference map; params, grads, masters, codes and scales bit for bit."""
    device = params[0].device
    ref_p, ref_g, ref_masters = [p.clone() for p in params], [g.clone() for g in grads], [m.clone() for m in masters]
    moments = [ref_moments(*(s[i] for s in state)) for i in range(len(params))]
    ref_m, ref_v = [m for m, _ in moments], [v for _, v in moments]
    mixprec.adam_(ref_p, ref_g, ref_m, ref_v, **dict(kw, step_tensor=scalar(4.0, device), master_params=ref_masters))
    step_tensor = scalar(4.0, device)
    adam8(params, grads, state, **dict(kw, step_tensor=step_tensor, master_params=masters))
    assert float(step_tensor) == 5.0
    for i, p in enumerate(params):
        assert_bitwise_equal(p, ref_p[i], f"{what}: params[{i}]")
        assert_bitwise_equal(grads[i], ref_g[i], f"{what}: grads[{i}]")
        if masters:
            assert_bitwise_equal(masters[i], ref_masters[i], f"{what}: master_params[{i}]")
        want = ref_state(ref_m[i], ref_v[i])
        for k, name in enumerate(["exp_avg codes", "exp_avg scales", "exp_avg_sq codes", "exp_avg_sq scales"]):
            assert_bitwise_equal(state[k][i], want[k], f"{what}: {name}[{i}]")


@pytest.mark.parametrize("case_name", CASES)
def test_step_is_dequantize_then_the_fp32_step_then_requantize(case_name, device, gen):
    case = CASES[case_name]
    params, masters = make_params(case, device, gen)
    scale = case.get("grad_scale")
    grads = [random_tensor(p.shape, p.dtype, device, gen, scale=scale or 1.0).contiguous(
        memory_format=torch.channels_last if case.get("channels_last") else torch.contiguous_format) for p in params]
    kw = dict(HYPER, **case.get("kw", {}))
    if scale:
        kw["grad_scale"] = scalar(scale, device)
    check_step(params, grads, masters, state_of(params, gen, device), kw, case_name)


def test_step_on_unaligned_views(device, gen):
    # Views at an odd element offset take the CUDA kernel's element-wise path (no vector loads).
    params, grads = [], []
    for n in [BLOCK + 9, 3 * BLOCK]:
        params.append(random_tensor(n + 1, torch.float32, device, gen)[1:])
        grads.append(random_tensor(n + 1, torch.float32, device, gen)[1:])
    cm, sm, cs, ss = state_of(params, gen, device)
    shifted = lambda ts: [torch.empty(t.numel() + 1, dtype=t.dtype, device=device)[1:].copy_(t) for t in ts]
    check_step(params, grads, [], [shifted(cm), sm, shifted(cs), ss], dict(HYPER, weight_decay=0.1), "unaligned")


@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_skipped_step_changes_nothing(where, bad, device, gen):
    from conftest import inject_non_finite
    params, _ = make_params(CASES["fp32"], device, gen)
    grads = [random_tensor(p.shape, p.dtype, device, gen) for p in params]
    inject_non_finite(grads[-1], where, bad, gen)
    state = state_of(params, gen, device)
    found_inf = torch.zeros(1, device=device)
    mixprec.non_finite_check_and_unscale_(grads, found_inf, scalar(1.0, device))
    assert float(found_inf) == 1.0
    step_tensor = scalar(2.0, device)
    everything = params + grads + [t for lst in state for t in lst] + [step_tensor]
    before = snapshot(everything)
    adam8(params, grads, state, **HYPER, step_tensor=step_tensor, found_inf=found_inf, grad_scale=scalar(2.0, device))
    assert_unchanged(before, everything, "skipped 8-bit step")


@pytest.mark.parametrize("where", ["first", "last", "random"])
def test_a_nan_moment_makes_its_block_scale_nan_never_a_finite_one(where, device, gen):
    # No found_inf (the grads are finite): a NaN weight under L2 decay makes m and v NaN there. The
    # block's scales must say so; decoding then gives NaN for the block instead of plausible numbers.
    from conftest import inject_non_finite
    n = 3 * BLOCK + 5
    p = random_tensor(n, torch.float32, device, gen)
    pos = inject_non_finite(p, where, math.nan, gen)
    state = state_of([p], gen, device)
    adam8([p], [random_tensor(n, torch.float32, device, gen)], state, **HYPER, adam_w_mode=False, weight_decay=0.1,
          step=2)
    for k in (1, 3):
        scales = state[k][0].cpu()
        assert bool(scales[pos // BLOCK].isnan()), f"scale list {k}: block of the NaN is {float(scales[pos // BLOCK])}"
        others = torch.cat([scales[:pos // BLOCK], scales[pos // BLOCK + 1:]])
        assert bool(torch.isfinite(others).all())


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["wide", "subnormal", "huge", "equal"])
def test_cpu_and_cuda_quantize_to_the_same_bits(kind, gen):
    # The code map is the same integer and IEEE float32 operations on both (kernels/quant8.h; nvcc
    # builds without fast-math). Whole 8-bit steps are compared across devices in
    # test_cpu_cuda_bits.py, now that neither backend contracts into FMAs.
    n = 65536 + 3 * BLOCK + 7
    g = values_of(kind, n, gen)
    runs = {}
    for dev in ("cpu", "cuda"):
        state = [torch.zeros(n, dtype=torch.int8, device=dev), torch.zeros(-(-n // BLOCK), device=dev),
                 torch.zeros(n, dtype=torch.uint8, device=dev), torch.zeros(-(-n // BLOCK), device=dev)]
        p = torch.ones(n, device=dev)
        adam8([p], [g.to(dev)], [[t] for t in state], lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, step=1)
        runs[dev] = [t.cpu() for t in state]
    for k, (a, b) in enumerate(zip(runs["cpu"], runs["cuda"])):
        assert_bitwise_equal(b, a, f"{kind}: state tensor {k}, CUDA vs CPU")


def test_opcheck_with_8bit_moments(device, gen):
    params, _ = make_params(CASES["fp32"], device, gen)
    grads = [random_tensor(p.shape, p.dtype, device, gen) for p in params]
    cm, sm, cs, ss = state_of(params, gen, device)
    args = (params, grads, cm, cs, [], [], sm, ss, scalar(2.0, device))
    torch.library.opcheck(torch.ops.mixprec.adam_.default, args, dict(HYPER, grad_scale=scalar(4.0, device)))
