"""``apex.optimizers`` under mixprec's alias: mixprec's fused optimizers, with Apex's defaults
where they differ from mixprec's own (FusedSGD's momentum in the param's dtype)."""

from __future__ import annotations

from torch.optim.optimizer import required

from ..optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedOptimizer,
)
from ..optimizers import FusedSGD as _MixprecFusedSGD
from ..optimizers.fused_sgd import PARAM_DTYPE


class FusedSGD(_MixprecFusedSGD):
    """mixprec.optimizers.FusedSGD with Apex's momentum storage as the default: Apex's step makes
    each buffer as ``zeros_like(param)`` and its kernel stores it in the weight's dtype, so fp16/bf16
    params without masters get fp16/bf16 buffers (``state_dtype="param"``); mixprec's own class
    keeps float32 buffers unless told otherwise. Anything else is mixprec's FusedSGD."""

    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False, *,
                 master_weights=False, maximize=False, state_dtype=PARAM_DTYPE, rounding="nearest", seed=0):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum,
                         materialize_master_grads, set_grad_none, master_weights=master_weights,
                         maximize=maximize, state_dtype=state_dtype, rounding=rounding, seed=seed)


__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedOptimizer",
           "FusedSGD"]
