"""Apex modules that Megatron-LM/NeMo-era code imports (amp_C, multi_tensor_apply, parallel.LARC,
normalization), on mixprec's ops. mixprec.apex_alias maps apex's module names onto these."""

from . import amp_c
from .larc import LARC
from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier
from .normalization import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)

__all__ = [
    "amp_c", "LARC", "MultiTensorApply", "multi_tensor_applier",
    "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
    "fused_layer_norm", "fused_layer_norm_affine", "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm", "fused_rms_norm_affine", "mixed_dtype_fused_rms_norm_affine",
]
