"""FusedAdam's 8-bit moments on the host side: zero state, and the conversions a checkpoint load or a
``state_dtype`` change makes, with the kernels' code map (csrc/kernels/quant8.h) in torch ops.

A param's 8-bit state is four tensors: ``exp_avg`` (int8 codes of m, the param's shape and layout),
``exp_avg_sq`` (uint8 codes of sqrt(v)), and ``exp_avg_scale`` / ``exp_avg_sq_scale`` (float32, one
absmax per BLOCK elements, in the param's storage order). The float32 arithmetic below is the
kernels', step for step, so a conversion gives the codes the op itself would store.
"""

from __future__ import annotations

import torch

BLOCK = 256  # elements per scale: kernels::kQuantBlock
KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")
_EXP_MAX = 15
MANT_SIGNED, MANT_UNSIGNED = 3, 4  # exp_avg: sign + 7 bits; sqrt(exp_avg_sq): 8 bits
MAX_SIGNED, MAX_UNSIGNED = _EXP_MAX << MANT_SIGNED, _EXP_MAX << MANT_UNSIGNED  # 120, 240: codes of the absmax


def blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def is_quantized(state: dict) -> bool:
    """Whether a param's state holds 8-bit moments (its codes, or any scale)."""
    m = state.get("exp_avg")
    return any(k in state for k in SCALE_KEYS) or (isinstance(m, torch.Tensor) and m.dtype == torch.int8)


def zeros(p: torch.Tensor) -> dict:
    """Fresh 8-bit state for `p`: zero codes in its layout (the op walks an entry's tensors in one
    storage order) and zero scales."""
    n = blocks(p.numel())
    return {"exp_avg": torch.zeros_like(p, dtype=torch.int8, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.preserve_format),
            "exp_avg_scale": torch.zeros(n, dtype=torch.float32, device=p.device),
            "exp_avg_sq_scale": torch.zeros(n, dtype=torch.float32, device=p.device)}


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one run of its storage exactly (any order of dimensions)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage_order(t: torch.Tensor) -> torch.Tensor:
    # A dense tensor's elements fill [offset, offset + numel) of its storage: this is that run.
    return t.as_strided((t.numel(),), (1,))


def _blocked(flat: torch.Tensor) -> torch.Tensor:
    pad = blocks(flat.numel()) * BLOCK - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def _code(x: torch.Tensor, mant: int) -> torch.Tensor:
    """x (float32 in [0, 1]) -> codes (int32): the mantissa rounded to `mant` bits on the bits, to
    nearest even, below 2^-14 even steps rounded half to even; NaN -> 0."""
    shift = 23 - mant
    b = x.view(torch.int32)
    normal = ((b + ((1 << (shift - 1)) - 1) + ((b >> shift) & 1)) >> shift) - ((127 - _EXP_MAX) << mant)
    sub = torch.round(x * float(2 ** (14 + mant))).to(torch.int32)
    zero = torch.zeros_like(normal)
    return torch.where(x >= 2.0 ** -14, normal, torch.where(x > 0, sub, zero))


def _value(code: torch.Tensor, mant: int) -> torch.Tensor:
    """codes (int32) -> x in [0, 1] (float32), exactly."""
    e = code >> mant
    normal = (((e + 127 - _EXP_MAX) << 23) | ((code & ((1 << mant) - 1)) << (23 - mant))).view(torch.float32)
    return torch.where(e == 0, code.to(torch.float32) * float(2.0 ** -(14 + mant)), normal)


def _ratio(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|values| / scale per block row (one float32 division, as q8_ratio); 0 where scale is 0 or NaN."""
    scale = scale[:, None]
    return torch.where(scale > 0, values.abs() / scale, torch.zeros_like(values))


def quantize(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, like: torch.Tensor) -> dict:
    """Float moments (any float dtype, `like`'s shape and layout) -> 8-bit state for param `like`."""
    out = zeros(like)
    m = _blocked(_storage_order(exp_avg.detach().to(torch.float32)))
    s = _blocked(_storage_order(exp_avg_sq.detach().to(torch.float32))).sqrt()
    n = like.numel()
    m_scale, s_scale = m.abs().amax(dim=1), s.amax(dim=1)  # amax keeps NaN, as the kernels do
    mag = _code(_ratio(m, m_scale), MANT_SIGNED)
    m_codes = torch.where(m < 0, -mag, mag).to(torch.int8).view(-1)[:n]
    s_codes = _code(_ratio(s, s_scale), MANT_UNSIGNED).to(torch.uint8).view(-1)[:n]
    _storage_order(out["exp_avg"]).copy_(m_codes)
    _storage_order(out["exp_avg_sq"]).copy_(s_codes)
    out["exp_avg_scale"].copy_(m_scale)
    out["exp_avg_sq_scale"].copy_(s_scale)
    return out


def dequantize(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit state -> (exp_avg, exp_avg_sq) in float32, in the codes' shape and layout."""
    codes_m, codes_s = state["exp_avg"], state["exp_avg_sq"]
    n = codes_m.numel()
    cm = _blocked(_storage_order(codes_m).to(torch.int32))
    cs = _blocked(_storage_order(codes_s).to(torch.int32))
    m = _value(cm.abs(), MANT_SIGNED) * state["exp_avg_scale"].reshape(-1, 1)
    m = torch.where(cm < 0, -m, m)
    s = _value(cs, MANT_UNSIGNED) * state["exp_avg_sq_scale"].reshape(-1, 1)
    out_m = torch.empty_like(codes_m, dtype=torch.float32)
    out_v = torch.empty_like(codes_s, dtype=torch.float32)
    _storage_order(out_m).copy_(m.view(-1)[:n])
    _storage_order(out_v).copy_((s * s).view(-1)[:n])
    return out_m, out_v


def check_saved(state: dict, p: torch.Tensor, where: str) -> None:
    """Refuses (ValueError naming `where` and the key) a saved 8-bit state that the op could not
    take or that no step made: codes of the wrong dtype or shape, scales of the wrong size,
    negative or non-finite scales, codes outside the map."""
    lacking = [k for k in KEYS if k not in state]
    if lacking:
        raise ValueError(f"{where} holds 8-bit moments but lacks {lacking}; expected all of {list(KEYS)}")
    if "max_exp_avg_sq" in state:
        raise ValueError(f"{where} holds 8-bit moments and 'max_exp_avg_sq'; 8-bit moments keep no amsgrad maximum")
    want = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8, "exp_avg_scale": torch.float32,
            "exp_avg_sq_scale": torch.float32}
    for key, dtype in want.items():
        t = state[key]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}[{key!r}] is {got}; expected a {dtype} tensor (8-bit moments)")
        shape = tuple(p.shape) if key in ("exp_avg", "exp_avg_sq") else (blocks(p.numel()),)
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}[{key!r}] has shape {tuple(t.shape)}; expected {shape} for the parameter's "
                             f"{tuple(p.shape)} ({BLOCK} elements per scale)")
        if key in ("exp_avg", "exp_avg_sq") and not _dense(t):
            raise ValueError(f"{where}[{key!r}] is not dense; expected codes laid out like a parameter")
    for key in SCALE_KEYS:
        t = state[key]
        if t.numel() and not bool((torch.isfinite(t) & (t >= 0)).all()):
            raise ValueError(f"{where}[{key!r}] holds negative, inf or NaN scales; expected finite values >= 0")
    if p.numel():
        if int(state["exp_avg"].to(torch.int16).abs().max()) > MAX_SIGNED:
            raise ValueError(f"{where}['exp_avg'] holds codes outside [-{MAX_SIGNED}, {MAX_SIGNED}]")
        if int(state["exp_avg_sq"].max()) > MAX_UNSIGNED:
            raise ValueError(f"{where}['exp_avg_sq'] holds codes above {MAX_UNSIGNED}")
