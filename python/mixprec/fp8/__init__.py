"""FP8 training on Hopper: an nn.Linear whose three GEMMs run on FP8 operands with per-tensor
scales held on the device (current or delayed scaling), built on mixprec's fused amax + cast ops.

    from mixprec import fp8
    converted, skipped = fp8.convert(model, fp8.Fp8Recipe(scaling="delayed"))

amp.initialize(..., opt_level="O4") does this for every eligible Linear (docs/fp8.md)."""

from .linear import ALIGN, Fp8Linear, convert, fp8_linear, ineligibility, scaled_mm
from .recipe import FP8_MAX, Fp8Recipe
from .report import Fp8LayerReport, Fp8TensorReport, format_fp8_report, fp8_report, track_saturation
from .state import ROLES, Fp8ScalingState

__all__ = ["ALIGN", "FP8_MAX", "Fp8LayerReport", "Fp8Linear", "Fp8Recipe", "Fp8ScalingState", "Fp8TensorReport",
           "ROLES", "convert", "format_fp8_report", "fp8_linear", "fp8_report", "ineligibility", "scaled_mm",
           "track_saturation"]
