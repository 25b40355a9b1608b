"""Apex's ``apex.normalization`` (FusedLayerNorm, FusedRMSNorm, their Mixed* forms and functional
forms) on mixprec's layer_norm and rms_norm ops: statistics in float32, autograd by the ops."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch.nn import init
from torch.nn.parameter import Parameter

from .. import _ops
from ._errors import named, not_provided_getattr


def _normalized_shape(call: str, normalized_shape) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
    if not shape or not all(isinstance(d, numbers.Integral) and d > 0 for d in shape):
        raise ValueError(f"{call}: invalid normalized_shape {normalized_shape!r}; expected a positive int "
                         "or a non-empty sequence of positive ints")
    return tuple(int(d) for d in shape)


def _check_eps(call: str, eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{call}: invalid eps {eps!r}; expected a finite number >= 0")


def _autocast_cast(tensors):
    """Apex's _cast_if_autocast_enabled: under CUDA autocast, CUDA float tensors go to the autocast
    dtype (so FusedLayerNorm's output is in that dtype, not float32 as torch's LayerNorm gives).
    mixprec's ops have no autocast kernels, so nothing casts them again."""
    if not torch.is_autocast_enabled("cuda"):
        return tensors
    dtype = torch.get_autocast_dtype("cuda")
    return [t.to(dtype) if t is not None and t.is_cuda and t.is_floating_point() and t.dtype != torch.float64
            else t for t in tensors]


def _norm(call: str, input, weight, bias, normalized_shape, eps, mixed: bool, rms: bool):
    """Runs the op in the wider of input's and weight's dtypes (mixprec's ops take one dtype), and
    returns the output in input's dtype, or weight's for the Mixed* forms (Apex's rule: the mixed
    kernels write the parameters' dtype, e.g. fp16 params on an fp32 residual stream)."""
    shape = _normalized_shape(call, normalized_shape)
    _check_eps(call, eps)
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{call}: input is a {type(input).__name__}; expected a tensor")
    if not input.is_floating_point():
        # Promoted to the weight's float dtype, then cast back, an integer input came out as
        # truncated (mostly zero) integers; Apex's kernels refuse it.
        raise TypeError(f"{call}: input has dtype {input.dtype}; expected a floating-point tensor")
    if mixed and weight is None:
        raise ValueError(f"{call}: weight is None; the mixed-dtype forms need a weight")
    input, weight, bias = _autocast_cast([input, weight, bias])
    out_dtype = weight.dtype if mixed else input.dtype
    dtype = input.dtype
    for t in (weight, bias):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    cast = [None if t is None else t.to(dtype) for t in (input, weight, bias)]
    with named(call):
        if rms:
            out = _ops.rms_norm(cast[0], list(shape), cast[1], float(eps))
        else:
            out = _ops.layer_norm(cast[0], list(shape), cast[1], cast[2], float(eps))
    return out.to(out_dtype)


# memory_efficient: Apex saves the output instead of the input for backward; mixprec's ops save
# the input. The argument is accepted and changes nothing (results are the same either way).

def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("fused_layer_norm_affine", input, weight, bias, normalized_shape, eps, mixed=False, rms=False)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("fused_layer_norm", input, None, None, normalized_shape, eps, mixed=False, rms=False)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("mixed_dtype_fused_layer_norm_affine", input, weight, bias, normalized_shape, eps,
                 mixed=True, rms=False)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("fused_rms_norm_affine", input, weight, None, normalized_shape, eps, mixed=False, rms=True)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("fused_rms_norm", input, None, None, normalized_shape, eps, mixed=False, rms=True)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("mixed_dtype_fused_rms_norm_affine", input, weight, None, normalized_shape, eps,
                 mixed=True, rms=True)


class _FusedNorm(torch.nn.Module):
    """What the four modules share; FusedRMSNorm is no FusedLayerNorm (isinstance), as in Apex."""

    _rms = False
    _mixed = False

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__()
        call = type(self).__name__
        self.normalized_shape = torch.Size(_normalized_shape(call, normalized_shape))
        _check_eps(call, eps)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = Parameter(torch.empty(self.normalized_shape))
            if not self._rms:
                self.bias = Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            if not self._rms:
                self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)
            if not self._rms:
                init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias: Optional[torch.Tensor] = None if self._rms else self.bias
        return _norm(type(self).__name__, input, self.weight, bias, self.normalized_shape, self.eps,
                     mixed=self._mixed, rms=self._rms)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedLayerNorm(_FusedNorm):
    """``torch.nn.LayerNorm`` under Apex's name and arguments: parameters ``weight`` (ones) and
    ``bias`` (zeros) of ``normalized_shape`` when ``elementwise_affine``; output in input's dtype."""


class FusedRMSNorm(_FusedNorm):
    """RMSNorm (y = x / sqrt(mean(x^2) + eps) * weight) under Apex's name and arguments: one
    parameter ``weight`` (ones) when ``elementwise_affine``; output in input's dtype."""

    _rms = True


def _mixed_init(self, base, normalized_shape, eps, memory_efficient, kwargs):
    # Apex's Mixed* take elementwise_affine only as a (warned about) True.
    name = type(self).__name__
    if "elementwise_affine" in kwargs:
        import warnings
        warnings.warn(f"{name} does not support `elementwise_affine` argument")
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{name} does not support `elementwise_affine = False`")
    if kwargs:
        raise TypeError(f"{name}.__init__: unexpected keyword arguments {sorted(kwargs)}")
    base.__init__(self, normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient)


class MixedFusedLayerNorm(FusedLayerNorm):
    """FusedLayerNorm whose parameters keep their own dtype (e.g. fp32) while the input may be
    another; the output takes the parameters' dtype, as Apex's mixed kernels write it."""

    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_init(self, FusedLayerNorm, normalized_shape, eps, memory_efficient, kwargs)


class MixedFusedRMSNorm(FusedRMSNorm):
    """FusedRMSNorm with MixedFusedLayerNorm's dtype rule (output in the weight's dtype)."""

    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_init(self, FusedRMSNorm, normalized_shape, eps, memory_efficient, kwargs)


#: Apex's autograd Functions: mixprec's ops carry their own (C++) autograd nodes.
NOT_PROVIDED = dict.fromkeys(
    ("FusedLayerNormAffineFunction", "FusedLayerNormAffineMixedDtypesFunction", "FusedLayerNormFunction",
     "FusedRMSNormAffineFunction", "FusedRMSNormAffineMixedDtypesFunction", "FusedRMSNormFunction"),
    "the functional forms (fused_layer_norm_affine, ...): mixprec's ops carry their own autograd")

__getattr__ = not_provided_getattr("apex.normalization.fused_layer_norm", NOT_PROVIDED)

__all__ = [
    "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
    "fused_layer_norm", "fused_layer_norm_affine", "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm", "fused_rms_norm_affine", "mixed_dtype_fused_rms_norm_affine",
]
