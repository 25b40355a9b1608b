"""amp.scale_loss (Apex's context manager: several losses, several optimizers, gradient
accumulation with delay_unscale) and the on-request views of the loss scalers."""

from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence, Union

import torch

from .._loss_scale import combine_found
from ..distributed import agree_found_inf_
from ._grad_marks import stray_message
from ._optimizer import OPTIMIZER_TYPES
from ._scaler import LossScaler, _amp_state


def _scaler(loss_id: int, call: str) -> LossScaler:
    scalers = _amp_state.loss_scalers
    if type(loss_id) is int and 0 <= loss_id < len(scalers):  # the common case first: one check per step
        return scalers[loss_id]
    if not _amp_state.initialized:
        raise RuntimeError("mixprec.amp is not initialized: call amp.initialize(...) first")
    if not scalers:
        raise RuntimeError("mixprec.amp was initialized with enabled=False, which keeps no loss scaler: there is no "
                           "loss scale, scale history or skipped-step count to read")
    # Integral: a numpy int from np.arange indexes Apex's list of scalers too.
    if isinstance(loss_id, bool) or not isinstance(loss_id, numbers.Integral) or not 0 <= loss_id < len(scalers):
        raise ValueError(f"{call}: loss_id must be an int in [0, num_losses={len(scalers)}), got {loss_id!r}")
    return scalers[int(loss_id)]


def scale_loss(loss: torch.Tensor, optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
               loss_id: int = 0, model: Any = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> "_ScaleLoss":
    """A context manager that yields ``loss.float() * scale`` for ``.backward()``; on exit it
    unscales the gradients of ``optimizers``' params (into fp32 master grads under O2) and
    updates loss ``loss_id``'s scale.

    - ``delay_unscale=True``: leave the gradients scaled, to accumulate several backward passes
      with the same loss; the last one (``delay_unscale=False``) unscales them all.
    - Several ``scale_loss`` blocks before one step (several losses, or accumulation without
      delay_unscale) add up correctly: each block's gradients are unscaled with its own scale.
    - An overflow anywhere makes the next ``optimizer.step()`` of every optimizer in the block a
      no-op, decided on the device (no host sync); the scale backs off.
    - ``delay_overflow_check=True``: the scale update waits for the next ``optimizer.step()``.
    ``model`` is accepted for Apex compatibility and unused.
    """
    return _ScaleLoss(loss, optimizers, loss_id, delay_unscale, delay_overflow_check)


def _optimizer_list(optimizers) -> list:
    if isinstance(optimizers, OPTIMIZER_TYPES):
        return [optimizers]
    if isinstance(optimizers, (list, tuple)) and all(isinstance(o, OPTIMIZER_TYPES) for o in optimizers):
        if not optimizers:
            # Nothing would unscale the gradients this backward makes: refuse before scaling.
            raise ValueError("amp.scale_loss: optimizers is empty; pass the optimizer (or list of optimizers) "
                             "whose parameters this loss's backward reaches, as returned by amp.initialize")
        return list(optimizers)
    raise TypeError("amp.scale_loss: optimizers must be an optimizer returned by amp.initialize, or a list of "
                    f"them, got {type(optimizers).__name__}")


class _ScaleLoss:
    """scale_loss's context manager. A class rather than a contextlib generator, which costs
    several Python calls more on every step; everything still happens on entering and exiting
    the ``with`` block, as with the generator.

    Each block it opens is recorded on its optimizers' stashes (``unfinished``) until its
    gradients are unscaled, so that nothing can step on scaled gradients: a ``step()`` (or
    ``amp.master_params``) reached while the block is open, or after ``delay_unscale=True``
    blocks that no final block closed, completes it first (:meth:`complete`)."""

    __slots__ = ("loss", "optimizers", "loss_id", "delay_unscale", "delay_overflow_check", "stashes", "scaler",
                 "scale", "unit", "active")

    def __init__(self, loss, optimizers, loss_id: int, delay_unscale: bool, delay_overflow_check: bool) -> None:
        self.loss, self.optimizers, self.loss_id = loss, optimizers, loss_id
        self.delay_unscale, self.delay_overflow_check = delay_unscale, delay_overflow_check
        self.active = False  # True from __enter__ until the backward it prepared is finished or aborted
        self.stashes: list = []

    def __enter__(self) -> torch.Tensor:
        props = _amp_state.opt_properties
        if props is None:  # not _amp_state.initialized
            raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
                               "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
                               "before `with amp.scale_loss`.")
        loss = self.loss
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"amp.scale_loss: loss must be the tensor to call .backward() on, got "
                            f"{type(loss).__name__} (a Python number has no graph to differentiate)")
        options = props.options  # the dict behind Properties' attributes, read without its __getattr__
        if not options["enabled"]:
            return loss
        stashes = []
        for i, opt in enumerate(_optimizer_list(self.optimizers)):
            stash = getattr(opt, "_amp_stash", None)
            if stash is None:
                raise RuntimeError(f"amp.scale_loss: optimizers[{i}] ({type(opt).__name__}) was not returned by "
                                   "amp.initialize; pass every optimizer through amp.initialize first")
            if stash.poisoned:
                raise RuntimeError(stash.poisoned_message("amp.scale_loss"))
            if stash.unfinished is not None and stash.unfinished.active:
                # Its exit would take the inner block's gradients, already unscaled, for its own.
                raise RuntimeError(f"amp.scale_loss: optimizers[{i}] ({type(opt).__name__}) is in an open `with "
                                   "amp.scale_loss` block already: nested blocks over one optimizer would unscale the "
                                   "inner block's gradients twice. End one block before opening the next (nothing "
                                   "was changed)")
            stashes.append(stash)
        scaler = _scaler(self.loss_id, "amp.scale_loss")
        unit = not scaler.dynamic and scaler.state.init_scale == 1.0
        if not options["master_weights"] and unit:
            return loss.float()  # nothing to scale, check or copy (fp32, or bf16 without scaling)

        for i, stash in enumerate(stashes):
            moved = stash.moved_param()
            if moved is not None:
                raise RuntimeError(f"amp.scale_loss: optimizers[{i}] ({type(stash.optimizer).__name__}): {moved} "
                                   "(nothing was changed)")
            stray = None if stash.params_have_scaled_gradients else stash.stray_gradient()
            if stray is not None:
                raise RuntimeError(f"amp.scale_loss: optimizers[{i}] ({type(stash.optimizer).__name__}): "
                                   f"{stray_message(stray)}, so this block would drop it (nothing was changed). Call "
                                   "optimizer.zero_grad() first, or backpropagate that loss through amp.scale_loss too")
        # Unscaled gradients already there (an earlier block, or a delayed chain completed early
        # by amp.master_params) are set aside, delay_unscale or not: scaled ones must never be
        # added onto them. They come back when the chain is completed.
        for stash in stashes:
            if not stash.params_have_scaled_gradients:
                stash.prepare_backward()
        scale = scaler.state.scale
        if scale is None:
            scale = scaler.scale_tensor(loss.device)
        elif scale.device != loss.device:  # the model was moved since the last scaled loss
            scaler.follow(loss.device)
            scale = scaler.state.scale
        try:
            scaled = loss.float() * scale if not unit else loss.float()
        except BaseException:
            for stash in stashes:
                stash.abort_backward()
            raise
        self.stashes, self.scaler, self.scale, self.unit, self.active = stashes, scaler, scale, unit, True
        for stash in stashes:
            stash.unfinished = self
        if scaled.requires_grad and not unit:
            scaled.register_hook(self._backward_started)
        return scaled

    def _backward_started(self, grad: torch.Tensor) -> None:
        """Runs as a backward of the scaled loss begins. After the block has ended (nothing is left
        to unscale the gradients this backward makes), the optimizers refuse to step on them."""
        if not self.active and self.stashes[0].unfinished is not self:
            for stash in self.stashes:
                stash.poisoned = ("the scaled loss of a `with amp.scale_loss(...)` block was backpropagated after the "
                                  "block ended, so its gradients were never unscaled (call .backward() inside the "
                                  "block)")

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.active:
            return False  # nothing prepared, or a step() inside the block already completed it
        if exc_type is not None:
            # The backward (or code after it) raised and the caller may catch it: drop the
            # gradients this block made, which are scaled, so no later step can apply them.
            self.active = False
            for stash in self.stashes:
                stash.abort_backward()
            return False  # the exception goes on
        if self.delay_unscale:
            self.active = False
            for stash in self.stashes:
                stash.params_have_scaled_gradients = True  # still unfinished: a later block or step ends it
            return False
        self.complete()
        return False

    def complete(self) -> None:
        """Unscales (into the master grads under O2) and checks the gradients this block and any
        delay_unscale blocks before it left scaled, and updates the loss scale."""
        self.active = False
        stashes = self.stashes
        if any(stash.has_sparse_gradient() for stash in stashes):
            # Refused before anything is unscaled; the block's scaled gradients are dropped as after
            # an exception in it, so no later step() can apply them.
            for stash in stashes:
                stash.abort_backward()
            raise RuntimeError("amp.scale_loss: a parameter has a sparse gradient (nn.Embedding(sparse=True) or "
                               "similar), which amp cannot unscale; use dense gradients (sparse=False), or "
                               "mixprec.GradScaler with a torch optimizer, which unscales sparse ones (this "
                               "block's gradients were dropped)")
        for stash in stashes:
            stash.unfinished = None
        scaler, scale, unit = self.scaler, self.scale, self.unit
        found: Optional[dict] = {} if scaler.dynamic else None
        inv = None if unit else scaler.state.inv_scale()
        for stash in stashes:
            stash.post_backward(None if unit else scale, inv, found)
            stash.params_have_scaled_gradients = False
        if found is None:
            return
        combined = combine_found(found.values(), scale.device) if found else torch.zeros((), device=scale.device)
        agree_found_inf_(combined, _amp_state.process_group)  # every rank skips, and scales, alike
        for stash in stashes:
            stash.add_found(combined)
        if self.delay_overflow_check:
            _amp_state.deferred_updates.append((scaler, combined))
        else:
            scaler.update(combined, _amp_state.verbosity)


def skipped_steps(loss_id: Optional[int] = None) -> int:
    """How many scale updates saw an overflow: for one loss, or summed over all (syncs)."""
    if loss_id is None:
        if not _amp_state.initialized:
            raise RuntimeError("mixprec.amp is not initialized: call amp.initialize(...) first")
        return sum(s.state.get_skipped() for s in _amp_state.loss_scalers)
    return _scaler(loss_id, "amp.skipped_steps").state.get_skipped()


def loss_scale(loss_id: int = 0) -> float:
    """The current scale of loss ``loss_id`` (syncs)."""
    return _scaler(loss_id, "amp.loss_scale").state.get_scale()


def scale_history(loss_id: int = 0, with_overflow: bool = False) -> list:
    """The scale each of the last ``scale_history`` (an initialize keyword) updates of loss
    ``loss_id`` used, oldest first; with ``with_overflow`` as (scale, overflowed) pairs. Kept on
    the device, materialized here (one sync)."""
    return _scaler(loss_id, "amp.scale_history").state.scale_history(with_overflow)
