"""mixprec.amp under Hugging Face accelerate: ``Accelerator(mixed_precision="no")`` with amp.initialize
before ``accelerator.prepare``, and the two calls that must see past accelerate's optimizer wrapper."""

from __future__ import annotations

from typing import Any

import torch

from .. import amp
from ._session import unwrap_optimizer


def _amp_optimizer(optimizer: Any, call: str) -> torch.optim.Optimizer:
    inner = unwrap_optimizer(optimizer)
    if not hasattr(inner, "_amp_stash"):
        # amp.master_params would fall back to the wrapper's (low-precision model) params: clipping
        # them would leave the fp32 master gradients, the ones the step uses, unclipped.
        raise TypeError(f"mixprec.integrations.accelerate.{call}: optimizer must be one that went through "
                        f"amp.initialize (or accelerate's wrapper of it), got {type(optimizer).__name__}")
    return inner


def backward(accelerator: Any, loss: torch.Tensor, optimizer: Any, **kwargs: Any) -> None:
    """``accelerator.backward(loss)`` with amp's loss scaling: the loss scaled, and after the
    backward the gradients unscaled into the fp32 masters (O2), checked for inf/NaN (an overflow
    makes the next ``optimizer.step()`` a no-op on the device) and the scale updated.

    Use it in place of ``accelerator.backward(loss)``; ``optimizer`` is what
    ``accelerator.prepare`` returned (or the one amp.initialize returned)."""
    inner = _amp_optimizer(optimizer, "backward")
    with amp.scale_loss(loss, inner) as scaled:
        accelerator.backward(scaled, **kwargs)


def clip_grad_norm_(accelerator: Any, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``accelerator.clip_grad_norm_`` over amp's master params (their gradients are the
    unscaled fp32 ones the step uses); returns the norm before clipping."""
    inner = _amp_optimizer(optimizer, "clip_grad_norm_")
    return accelerator.clip_grad_norm_(list(amp.master_params(inner)), max_norm, norm_type=norm_type)


__all__ = ["backward", "clip_grad_norm_"]
