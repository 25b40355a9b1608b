"""Python wrappers of the FP8 ops (csrc/kernels/fp8.*, csrc/ops/fp8.cpp, fp8_linear.cpp): the fused
amax + cast, the on-device scale update, and the FP8 Linear that mixprec.fp8.Fp8Linear runs."""

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


def fp8_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], scale: torch.Tensor,
               amax: torch.Tensor, amax_history: torch.Tensor, forward_dtype: torch.dtype, backward_dtype: torch.dtype,
               *, delayed: bool = False, margin: float = 0.0, reduction: str = "max", group_name: Optional[str] = None,
               saturation: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with its three GEMMs on FP8 operands, differentiable: input
    and weight cast to ``forward_dtype``, the output gradient to ``backward_dtype``, fp32
    accumulation, outputs in input's dtype. ``scale``, ``amax`` [3] and ``amax_history`` [3, L]
    (float32, rows input / weight / grad_output) are updated on the device as each cast runs:
    current scaling measures each tensor just before its cast, ``delayed=True`` takes the scale from
    the history (``reduction``, ``margin``) and records the amax in the cast. ``group_name``: current
    scaling's amaxes are all-reduced with MAX over that process group. ``saturation`` [3, 2]
    float64 accumulates (elements, clipped elements) per row. in/out_features and the token count
    must be multiples of 16."""
    return _ops.fp8_linear(input, weight, bias, scale, amax, amax_history, forward_dtype, backward_dtype,
                           bool(delayed), float(margin), reduction, group_name, saturation)


def fp8_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                  emulate: Optional[bool] = None) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) (+ bias)`` for FP8 ``a`` (row-major) and ``b`` (column-major),
    accumulated in fp32 and rounded once to ``out_dtype``: ``torch._scaled_mm``, or with
    ``emulate`` (default: off CUDA) the FP8 values widened exactly to fp32 and one fp32 matmul."""
    return _ops.fp8_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, emulate)
