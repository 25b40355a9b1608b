"""Mixed-precision diagnostics: which parameters' gradients overflowed, a NaN loss told from a
transient overflow, the first module whose forward output is non-finite, and a clear error when
the loss scale sits at its floor step after step instead of training on silently.

    from mixprec import amp, diagnostics
    model, opt = amp.initialize(model, opt, opt_level="O2")
    with diagnostics.Monitor(model, patience=20) as monitor:    # watches amp's loss scale 0
        for x, y in loader:
            loss = monitor.watch_loss(loss_fn(model(x), y))
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()                           # may raise LossScaleStuckError
            opt.step(); opt.zero_grad()
    print(monitor.events)                                   # OverflowEvent(step, kind, params, ...)

These are debugging aids: the Monitor reads found_inf on the host at every scale update (one
sync per step) and the ForwardDebugger checks every module's output; leave them off in
production runs, where the scale lives on the device and nothing waits on the host.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch

from . import _ops
from ._loss_scale import _OP_DTYPES, ScaleState, _flat_view, update_observers
from .fp8.report import format_fp8_report, fp8_report, track_saturation  # noqa: F401  (FP8 layers, docs/fp8.md)

logger = logging.getLogger("mixprec.diagnostics")

# Kinds of an overflowing step.
OVERFLOW = "overflow"  # finite loss, non-finite scaled gradients: the scale was too high; it backs off
NAN_LOSS = "nan_loss"  # the loss itself is inf/NaN: no scale fixes this; the forward overflowed or diverged

NamedParams = Union[torch.nn.Module, Iterable[tuple[str, torch.Tensor]], Iterable[torch.Tensor]]


class LossScaleStuckError(RuntimeError):
    """The loss scale fell to its floor and every recent step still overflowed."""


class NonFiniteForwardError(RuntimeError):
    """A module's forward produced inf/NaN (raised by ForwardDebugger with raise_error=True)."""


def _named(params: NamedParams) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        return list(params.named_parameters())
    out = []
    for i, item in enumerate(params):
        out.append(item if isinstance(item, tuple) else (f"param[{i}]", item))
    return out


def nonfinite_grads(params: NamedParams) -> list[str]:
    """Names of the parameters whose ``.grad`` holds inf or NaN (a module's ``named_parameters``
    names; ``param[i]`` for a plain list). One read-only pass of mixprec's check op per device,
    whose per-tensor report flags each tensor, then one host read."""
    named = [(n, p.grad) for n, p in _named(params) if p.grad is not None]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    bad: set[int] = set()
    for i, (_, g) in enumerate(named):
        v = _flat_view(g) if g.dtype in _OP_DTYPES else None
        if v is None:  # dtypes and layouts the op does not take: torch's own check
            if g.is_floating_point() and not bool(torch.isfinite(g).all()):
                bad.add(i)
        else:
            by_device[g.device].append((i, v))
    for device, items in by_device.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        per_tensor = torch.zeros(len(items), dtype=torch.float32, device=device)
        _ops.non_finite_check_and_unscale_([v for _, v in items], found, per_tensor_found=per_tensor)
        for (i, _), flag in zip(items, per_tensor.tolist()):
            if flag:
                bad.add(i)
    return [named[i][0] for i in sorted(bad)]


def classify_step(loss: Union[torch.Tensor, float, None], overflowed: bool) -> Optional[str]:
    """None for a clean step; ``NAN_LOSS`` when the loss itself is non-finite (the scale cannot
    help: the forward overflowed or training diverged); ``OVERFLOW`` for a transient overflow (a
    finite loss whose scaled gradients overflowed: the step is skipped and the scale backs off)."""
    value = None if loss is None else float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
    if value is not None and not math.isfinite(value):
        return NAN_LOSS
    return OVERFLOW if overflowed else None


def _scale_state(scaler: Any, loss_id: int) -> ScaleState:
    if scaler is None:
        from .amp._scaler import _amp_state
        if not _amp_state.initialized or not _amp_state.loss_scalers:
            raise RuntimeError("mixprec.diagnostics.Monitor: amp is not initialized (call amp.initialize first) "
                               "and no scaler was given")
        if not 0 <= loss_id < len(_amp_state.loss_scalers):
            raise ValueError(f"mixprec.diagnostics.Monitor: loss_id {loss_id} out of range "
                             f"[0, {len(_amp_state.loss_scalers)})")
        return _amp_state.loss_scalers[loss_id].state
    state = getattr(scaler, "_state", None) or getattr(scaler, "state", None)
    if not isinstance(state, ScaleState):
        raise TypeError(f"mixprec.diagnostics.Monitor: scaler must be a mixprec.GradScaler (enabled) or None for "
                        f"amp's loss scaler, got {type(scaler).__name__}")
    return state


@dataclass
class OverflowEvent:
    """One overflowing scale update: the update's index, ``OVERFLOW`` or ``NAN_LOSS``, the scale
    after the update, the loss (None when not watched), and the params with non-finite grads."""
    step: int
    kind: str
    scale: float
    loss: Optional[float]
    params: list[str] = field(default_factory=list)


class Monitor:
    """Watches one dynamic loss scale: amp's loss ``loss_id`` (``scaler=None``, after
    amp.initialize) or a ``mixprec.GradScaler``. On each overflowing update it records an
    :class:`OverflowEvent` naming the parameters whose gradients were non-finite and telling a
    NaN loss from a transient overflow; once ``patience`` updates in a row have overflowed with
    the scale at or below ``floor`` (the scaler's ``min_scale``/``min_loss_scale``, or 1.0 when it
    has none) it raises :class:`LossScaleStuckError` from the update, instead of letting
    training skip every step silently. Static scales (O3, bf16 without loss scaling) have no
    updates to watch; check their loss with :func:`classify_step`.

    Costs one host read of found_inf per update (and a check pass over the grads on overflow).
    """

    def __init__(self, model: NamedParams, scaler: Any = None, *, loss_id: int = 0, patience: int = 20,
                 floor: Optional[float] = None, max_events: int = 1000) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"mixprec.diagnostics.Monitor: patience must be a positive int, got {patience!r}")
        self.state = _scale_state(scaler, loss_id)
        self.params = _named(model)
        self.patience = patience
        self.floor = float(floor) if floor is not None else (self.state.min_scale or 1.0)
        self.max_events = max_events
        self.events: list[OverflowEvent] = []
        self.updates = 0
        self.overflows = 0
        self.consecutive = 0
        self._loss: Optional[torch.Tensor] = None
        update_observers.setdefault(self.state, []).append(self._on_update)

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Remembers this step's loss (to classify an overflow) and returns it unchanged."""
        self._loss = loss.detach()
        return loss

    def _on_update(self, state: ScaleState, found: torch.Tensor) -> None:
        self.updates += 1
        loss, self._loss = self._loss, None
        kind = classify_step(loss, bool(found.item()))
        if kind is None:
            self.consecutive = 0
            return
        self.overflows += 1
        self.consecutive += 1
        event = OverflowEvent(self.updates - 1, kind, state.get_scale(),
                              None if loss is None else float(loss.float()), nonfinite_grads(self.params))
        if len(self.events) < self.max_events:
            self.events.append(event)
        if self.consecutive >= self.patience and event.scale <= self.floor:
            recent = self.events[-self.patience:]
            nan_losses = sum(e.kind == NAN_LOSS for e in recent)
            cause = (f"the loss itself was NaN/inf in {nan_losses} of them: the forward overflows or training "
                     "diverged" if nan_losses else "the loss was finite: gradients overflow even unscaled")
            raise LossScaleStuckError(
                f"mixprec: loss scale stuck at its floor: the last {self.consecutive} updates all found non-finite "
                f"gradients and the scale is {event.scale:g} (floor {self.floor:g}); {cause}; non-finite gradients "
                f"in: {_short(event.params)}. Try another opt level or bf16, or mixprec.diagnostics.ForwardDebugger "
                "to name the first module with a non-finite output.")

    def close(self) -> None:
        lst = update_observers.get(self.state)
        if lst and self._on_update in lst:
            lst.remove(self._on_update)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(names: list[str], n: int = 5) -> str:
    if not names:
        return "(none: the non-finite values were only in the loss or outside the model's parameters)"
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# -- the forward debug mode -----------------------------------------------------------------------------
def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


@dataclass
class NonFiniteOutput:
    """Where a forward first produced inf/NaN: module name and type, counts, and whether the
    module's own inputs were finite (if so, this module created the non-finite values)."""
    module: str
    module_type: str
    dtype: str
    num_inf: int
    num_nan: int
    numel: int
    inputs_finite: bool

    def __str__(self) -> str:
        origin = "from finite inputs" if self.inputs_finite else "its inputs were already non-finite"
        return (f"module '{self.module}' ({self.module_type}) output {self.dtype}: {self.num_inf} inf and "
                f"{self.num_nan} NaN of {self.numel} values, {origin}")


def _count_nonfinite(tensors: Iterable[torch.Tensor]) -> tuple[int, int, int, str]:
    inf = nan = numel = 0
    dtype = ""
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t = t.detach()
            inf += int(torch.isinf(t).sum())
            nan += int(torch.isnan(t).sum())
            numel += t.numel()
            dtype = dtype or str(t.dtype).replace("torch.", "")
    return inf, nan, numel, dtype


class ForwardDebugger:
    """Debug mode: forward hooks on every module of ``model``; the first module (in the order
    forwards finish, so the innermost one) whose output holds inf/NaN is kept in ``first`` and,
    with ``raise_error=True``, raises :class:`NonFiniteForwardError` naming it. Checks every
    output on the host (slow): use it to find a layer that overflows, then turn it off.
    ``reset()`` forgets the finding; ``close()`` (or leaving the ``with``) removes the hooks."""

    def __init__(self, model: torch.nn.Module, raise_error: bool = False) -> None:
        self.raise_error = raise_error
        self.first: Optional[NonFiniteOutput] = None
        self._handles = [m.register_forward_hook(self._hook(name or "(root)"))
                         for name, m in model.named_modules()]

    def _hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if self.first is not None:
                return
            num_inf, num_nan, numel, dtype = _count_nonfinite(_tensors(output))
            if num_inf == 0 and num_nan == 0:
                return
            in_inf, in_nan, _, _ = _count_nonfinite(_tensors(inputs))
            self.first = NonFiniteOutput(name, type(module).__name__, dtype, num_inf, num_nan, numel,
                                         in_inf == 0 and in_nan == 0)
            if self.raise_error:
                raise NonFiniteForwardError(f"mixprec: first non-finite forward output: {self.first}")
        return hook

    def reset(self) -> None:
        self.first = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "ForwardDebugger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
