"""amp.scale_loss (Apex's context manager: several losses, several optimizers, gradient
accumulation with delay_unscale) and the on-request views of the loss scalers."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from .._loss_scale import combine_found
from ..distributed import agree_found_inf_
from ._scaler import LossScaler, _amp_state


def _scaler(loss_id: int) -> LossScaler:
    if not _amp_state.initialized:
        raise RuntimeError("mixprec.amp is not initialized: call amp.initialize(...) first")
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(_amp_state.loss_scalers):
        raise ValueError(f"loss_id must be an int in [0, num_losses={len(_amp_state.loss_scalers)}), got {loss_id!r}")
    return _amp_state.loss_scalers[loss_id]


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """Yields ``loss.float() * scale`` for ``.backward()``; on exit unscales the gradients of
    ``optimizers``' params (into fp32 master grads under O2) and updates loss ``loss_id``'s scale.

    - ``delay_unscale=True``: leave the gradients scaled, to accumulate several backward passes
      with the same loss; the last one (``delay_unscale=False``) unscales them all.
    - Several ``scale_loss`` blocks before one step (several losses, or accumulation without
      delay_unscale) add up correctly: each block's gradients are unscaled with its own scale.
    - An overflow anywhere makes the next ``optimizer.step()`` of every optimizer in the block a
      no-op, decided on the device (no host sync); the scale backs off.
    - ``delay_overflow_check=True``: the scale update waits for the next ``optimizer.step()``.
    ``model`` is accepted for Apex compatibility and unused.
    """
    if not _amp_state.initialized:
        raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
                           "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
                           "before `with amp.scale_loss`.")
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for opt in optimizers:
        if not hasattr(opt, "_amp_stash"):
            raise RuntimeError(f"amp.scale_loss: the optimizer {type(opt).__name__} was not returned by "
                               "amp.initialize; pass every optimizer through amp.initialize first")
    scaler = _scaler(loss_id)
    props = _amp_state.opt_properties
    unit = not scaler.dynamic and scaler.state.init_scale == 1.0
    if not props.master_weights and unit:
        yield loss.float()  # nothing to scale, check or copy (fp32, or bf16 without scaling)
        return

    if not delay_unscale:
        for opt in optimizers:
            if not opt._amp_stash.params_have_scaled_gradients:
                opt._amp_stash.prepare_backward()
    scale = scaler.scale_tensor(loss.device)
    try:
        yield loss.float() * scale if not unit else loss.float()
    except BaseException:
        for opt in optimizers:
            opt._amp_stash.abort_backward()
        raise
    if delay_unscale:
        for opt in optimizers:
            opt._amp_stash.params_have_scaled_gradients = True
        return

    found: Optional[dict] = {} if scaler.dynamic else None
    inv = None if unit else scaler.state.inv_scale()
    for opt in optimizers:
        opt._amp_stash.post_backward(None if unit else scale, inv, found)
        opt._amp_stash.params_have_scaled_gradients = False
    if found is None:
        return
    combined = combine_found(found.values(), scale.device) if found else torch.zeros((), device=scale.device)
    agree_found_inf_(combined, _amp_state.process_group)  # every rank skips, and scales, alike
    for opt in optimizers:
        opt._amp_stash.add_found(combined)
    if delay_overflow_check:
        _amp_state.deferred_updates.append((scaler, combined))
    else:
        scaler.update(combined, _amp_state.verbosity)


def skipped_steps(loss_id: Optional[int] = None) -> int:
    """How many scale updates saw an overflow: for one loss, or summed over all (syncs)."""
    if loss_id is None:
        if not _amp_state.initialized:
            raise RuntimeError("mixprec.amp is not initialized: call amp.initialize(...) first")
        return sum(s.state.get_skipped() for s in _amp_state.loss_scalers)
    return _scaler(loss_id).state.get_skipped()


def loss_scale(loss_id: int = 0) -> float:
    """The current scale of loss ``loss_id`` (syncs)."""
    return _scaler(loss_id).state.get_scale()


def scale_history(loss_id: int = 0, with_overflow: bool = False) -> list:
    """The scale each of the last ``scale_history`` (an initialize keyword) updates of loss
    ``loss_id`` used, oldest first; with ``with_overflow`` as (scale, overflowed) pairs. Kept on
    the device, materialized here (one sync)."""
    return _scaler(loss_id).state.scale_history(with_overflow)
