"""Apex modules that Megatron-LM/NeMo-era code imports (amp_C, multi_tensor_apply, parallel.LARC,
normalization), on mixprec's ops. mixprec.apex_alias maps apex's module names onto these."""

from . import amp_c
from .larc import LARC
from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["amp_c", "LARC", "MultiTensorApply", "multi_tensor_applier"]
