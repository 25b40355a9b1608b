"""Loss scaling for amp.init's handles (Apex's old API): a scaled backward that unscales the
optimizer's gradients in place and checks them for inf/NaN, and the step that then does nothing
where any backward since the last step overflowed, decided on the device (no host sync on a GPU)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

from .._loss_scale import check_and_unscale_, combine_found
from .._step_guard import StepGuard
from ._scaler import LossScaler

_MISSING = object()
#: One StepGuard per optimizer: its snapshot buffers are reused from step to step.
_GUARDS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, StepGuard]" = weakref.WeakKeyDictionary()
#: Optimizers whose next step() is guarded: [found, their own "step" attribute before].
_ARMED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
_CLOSURE_ERROR = "Currently, Amp does not support closure use with optimizers."


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _unscale(params: list[torch.Tensor], scaler: LossScaler) -> torch.Tensor:
    """Unscales every gradient of ``params`` in place; a device scalar, 1 where any is inf/NaN."""
    inv = scaler.state.inv_scale()
    found: dict = {}
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        check_and_unscale_(grads, found, lambda device: inv if device == inv.device else inv.to(device))
    if not found:
        return torch.zeros((), dtype=torch.float32, device=inv.device)
    return (combine_found(found.values(), inv.device) != 0).to(torch.float32)


@contextlib.contextmanager
def scaled_backward(loss: torch.Tensor, params: list[torch.Tensor], scaler: LossScaler, set_aside: bool,
                    done: Callable[[torch.Tensor, bool], None]) -> Iterator[torch.Tensor]:
    """Yields ``loss.float() * scale``; on exit unscales the gradients that this block's backward
    produced, updates ``scaler`` and hands ``done(found, True)`` the overflow flag. With
    ``set_aside``, gradients already unscaled by an earlier block since the last step are held
    out meanwhile and added back after, so that they are not unscaled twice. An exception in the
    block leaves its gradients scaled: ``done(1, False)``, so that the next step applies nothing."""
    scale = scaler.scale_tensor(loss.device)
    scaled = loss.float() * scale
    held = [(p, p.grad) for p in params if p.grad is not None] if set_aside else []
    for p, _ in held:
        p.grad = None
    try:
        yield scaled
    except BaseException:
        _put_back(held)
        done(torch.ones((), dtype=torch.float32, device=scale.device), False)
        raise
    found = _unscale(params, scaler)
    _put_back(held)
    scaler.update(found, 1)
    done(found, True)


def _put_back(held: list) -> None:
    for p, g in held:
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def guarded_step(optimizer: torch.optim.Optimizer, found, step: Callable, args: tuple, kwargs: dict) -> Any:
    """``step(*args, **kwargs)``, changing nothing (parameters, state, hyper-parameters) where
    ``found`` (a device scalar, or None for no check) is non-zero."""
    if found is None:
        return step(*args, **kwargs)
    if found.device.type == "cpu":
        return None if found.item() else step(*args, **kwargs)  # host memory: reading waits for nothing
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = found  # the kernel skips itself; the grads are already unscaled
        try:
            return step(*args, **kwargs)
        finally:
            del optimizer.found_inf
    guard = _GUARDS.get(optimizer)
    if guard is None:
        guard = _GUARDS[optimizer] = StepGuard()
    StepGuard.make_capturable(optimizer)
    return guard.step(optimizer, found, step, *args, **kwargs)


def check_no_closure(args: tuple, kwargs: dict, error=RuntimeError) -> None:
    if (args and args[0] is not None) or kwargs.get("closure") is not None:
        raise error(_CLOSURE_ERROR)


def arm(optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
    """Makes ``optimizer``'s next step() a guarded one (as Apex patched step after an overflow,
    except that here the overflow is not known on the host). The patch is an instance attribute
    that removes itself when the step runs; further blocks before it add their flags."""
    record = _ARMED.get(optimizer)
    if record is not None:
        record[0] = torch.maximum(record[0], found.to(record[0].device))
        return
    step = optimizer.step

    def armed_step(*args, **kwargs):
        check_no_closure(args, kwargs)
        found = disarm(optimizer)
        try:
            return guarded_step(optimizer, found, step, args, kwargs)
        except BaseException:
            # A refused step (a fused optimizer's bad option, say) changes nothing: the retry must
            # still skip an overflow. Disarmed, it applied the overflowing gradients (on a GPU,
            # where the flag is not read on the host and the step is called to skip itself).
            arm(optimizer, found)
            raise

    _ARMED[optimizer] = [found, vars(optimizer).get("step", _MISSING)]
    optimizer.step = armed_step


def is_armed(optimizer: torch.optim.Optimizer) -> bool:
    return optimizer in _ARMED


def disarm(optimizer: torch.optim.Optimizer):
    """Removes the guarded step; returns the flag it held (None when not armed)."""
    record = _ARMED.pop(optimizer, None)
    if record is None:
        return None
    found, saved = record
    if saved is _MISSING:
        vars(optimizer).pop("step", None)
    else:
        optimizer.step = saved
    return found


class OptimWrapper:
    """Apex's ``handle.wrap_optimizer(optimizer, num_loss)``: one loss scaler per loss,
    ``with opt.scale_loss(loss) as scaled:`` for each loss of an iteration, then ``opt.step()``,
    which is skipped (on the device) if any of them overflowed. Everything else is the wrapped
    optimizer's (attributes, zero_grad, state_dict ...)."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle, num_loss: int = 1) -> None:
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"wrap_optimizer: num_loss must be a positive int, got {num_loss!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"wrap_optimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if hasattr(optimizer, "_amp_stash"):
            raise RuntimeError("wrap_optimizer: this optimizer was returned by amp.initialize, which scales its "
                               "losses itself; use amp.scale_loss(loss, optimizer) with it")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._found = None  # the device flag of every block since the last step
        loss_scale = getattr(amp_handle, "_loss_scale_arg", "dynamic")
        self._loss_scaler = [LossScaler(loss_scale, i) for i in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        handle = self._amp_handle
        if not handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(f"OptimWrapper.scale_loss: loss {self._loss_idx + 1} since the last step(), but the "
                               f"wrapper was made with num_loss={self._num_loss}; call step() after each "
                               f"{self._num_loss} losses, or pass a larger num_loss to wrap_optimizer")

        def done(found: torch.Tensor, finished: bool) -> None:
            self._found = found if self._found is None else torch.maximum(self._found, found)
            if finished:
                self._loss_idx += 1

        try:
            with scaled_backward(loss, params_of(self._optimizer), self._loss_scaler[self._loss_idx],
                                 self._found is not None, done) as scaled:
                yield scaled
        finally:
            handle._clear_cache()

    def step(self, closure=None):
        if self._found is None and not self._amp_handle.is_active():  # nothing was scaled: a plain step
            return self._optimizer.step(closure=closure) if closure is not None else self._optimizer.step()
        if closure is not None:
            raise NotImplementedError("The `closure` argument is unsupported by the amp optimizer wrapper.")
        self._amp_handle._clear_cache()
        out = guarded_step(self._optimizer, self._found, self._optimizer.step, (), {})
        # After the step: a refused one keeps the overflow flag of its losses for the retry.
        self._found, self._loss_idx = None, 0
        return out

    def __getattr__(self, attr: str) -> Any:
        if attr == "_optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(attr)
        return getattr(self._optimizer, attr)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> dict:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        return self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        return self._optimizer.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        return self._optimizer.add_param_group(param_group)
