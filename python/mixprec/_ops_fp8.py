"""Python wrappers of the FP8 ops (csrc/kernels/fp8.*, csrc/ops/fp8.cpp): the fused amax + cast
and the on-device scale update that mixprec.fp8's scaling state is built on."""

from __future__ import annotations

from typing import Optional

import torch

from ._ops import _ops


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, transpose: bool = False,
                 amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x * scale`` saturated to ``dtype``'s range (``torch.float8_e4m3fn``: 448,
    ``torch.float8_e5m2``: 57344; inf saturates, NaN stays NaN) and rounded to nearest even, in
    one read of ``x`` (contiguous float32/float16/bfloat16). Returns ``(out, out_t)``: ``out``
    shaped like ``x``; with ``transpose=True`` (``x`` 2-D) ``out_t`` is ``out.t()`` contiguous, the
    column-major operand ``torch._scaled_mm`` wants, else None. ``scale`` is a float32 scalar on
    ``x``'s device; ``amax``, when given, becomes ``max(amax, max |x|)`` on the device (NaN if
    ``x`` holds NaN), so delayed scaling records its history at no extra pass or sync."""
    out, out_t = _ops.fp8_quantize(x, scale, dtype, bool(transpose), amax)
    return out, (out_t if transpose else None)


def fp8_amax_(x: torch.Tensor, amax: torch.Tensor) -> None:
    """``amax = max(amax, max |x|)`` on the device, in one read of ``x``: the amax current
    scaling needs before the scale of the cast exists."""
    _ops.fp8_amax_(x, amax)


def fp8_update_scale_(scale: torch.Tensor, amax_history: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype,
                      margin: float = 0.0, reduction: str = "max") -> None:
    """Delayed (or, with a history of length 1, current) scaling's update, on the device with no
    host sync: ``amax`` is pushed into ``amax_history`` (float32 vector, newest first) and reset
    to 0; the history is reduced (``"max"`` over it or ``"most_recent"``) and ``scale`` becomes
    ``fp8_max(dtype) / (reduced * 2**margin)``, unless the reduced amax is 0, inf or NaN, in which
    case the previous scale is kept."""
    _ops.fp8_update_scale_(scale, amax_history, amax, dtype, float(margin), reduction)
