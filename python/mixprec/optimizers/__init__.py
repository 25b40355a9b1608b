"""mixprec's fused optimizers, with Apex's class names, constructor arguments and defaults."""

from ._base import FusedOptimizer
from .fused_adam import FusedAdam

__all__ = ["FusedAdam", "FusedOptimizer"]
