"""The torch.amp baseline modes of `mixprec compare` (torch-fp16, torch-bf16): the task trained the
way torch's own recipe says, so that the O-levels are measured against what a user runs today."""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable

import torch

from .. import diagnostics
from ..optimizers import FusedAdagrad, FusedAdam, FusedSGD
from .modes import Mode


class NoTorchEquivalent(Exception):
    """The task's optimizer has no torch.optim counterpart to run the baseline with."""


# mixprec optimizer -> (the torch.optim class for a param group, the hyper-parameters torch takes
# under the same name and meaning, the settings torch has no switch for: the value torch behaves as).
_EQUIVALENTS: dict[type, tuple[Callable[[dict], type], tuple[str, ...], dict[str, Any]]] = {
    FusedAdam: (lambda g: torch.optim.AdamW if g["adam_w_mode"] else torch.optim.Adam,
                ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"), {"bias_correction": True}),
    FusedSGD: (lambda g: torch.optim.SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
               {"wd_after_momentum": False}),
    FusedAdagrad: (lambda g: torch.optim.Adagrad,
                   ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value", "maximize"),
                   {"adagrad_w_mode": False}),
}


def _from_mixprec(optimizer: torch.optim.Optimizer) -> tuple[type, list[dict]]:
    name = type(optimizer).__name__
    entry = _EQUIVALENTS.get(type(optimizer))
    if entry is None:
        raise NoTorchEquivalent(f"torch.optim has no counterpart of the task's {name}, so there is no torch.amp "
                                "recipe to compare against (give the task a torch.optim optimizer, or mixprec's "
                                "FusedAdam, FusedSGD or FusedAdagrad)")
    choose, same, fixed = entry
    classes, groups = set(), []
    for g in optimizer.param_groups:
        for key, torch_value in fixed.items():
            if g.get(key, torch_value) != torch_value:
                raise NoTorchEquivalent(f"the task's {name} has {key}={g[key]!r}, which torch.optim cannot express")
        classes.add(choose(g))
        groups.append({"params": g["params"], **{k: g[k] for k in same if k in g}})
    if len(classes) != 1:
        raise NoTorchEquivalent(f"the task's {name} mixes param groups that map to different torch optimizers "
                                f"({', '.join(sorted(c.__name__ for c in classes))})")
    return classes.pop(), groups


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """``torch.optim.AdamW(fused=True)``, ``mixprec.optimizers.FusedAdam``: the public name of an
    optimizer's class (not its private module) and whether torch's fused step is on."""
    cls = type(optimizer)
    for public in ("torch.optim", "mixprec.optimizers"):
        if cls.__module__.startswith(public + ".") and getattr(sys.modules[public], cls.__name__, None) is cls:
            return f"{public}.{cls.__name__}" + ("(fused=True)" if optimizer.defaults.get("fused") else "")
    return f"{cls.__module__}.{cls.__qualname__}"


def torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a torch.amp user would pair with the task's, over the same parameters and
    hyper-parameters: torch's equivalent of a mixprec fused optimizer, or the
    task's own torch.optim class rebuilt with ``fused=True`` where torch has a fused kernel for the
    parameters (the fastest torch step, so the baseline is not handicapped). A user's own
    Optimizer subclass is used as it is."""
    cls = type(optimizer)
    if cls.__module__.startswith("mixprec."):
        cls, groups = _from_mixprec(optimizer)
    elif cls.__module__.startswith("torch.optim"):
        groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in optimizer.param_groups]
    else:
        return optimizer
    if "fused" in inspect.signature(cls.__init__).parameters:
        try:
            return cls(groups, fused=True)
        except (RuntimeError, ValueError, TypeError):  # no fused kernel for these params' device or dtype
            pass
    return cls(groups)


class TorchAmpPrecision:
    """One torch.amp mode's training step: forward and loss under ``torch.autocast`` in the mode's
    dtype; in fp16 a ``torch.amp.GradScaler`` (bf16 needs none, as torch documents), with its
    skipped steps counted from the scale's back-offs and a run of them at the floor stopping the
    mode as mixprec's Monitor does."""

    def __init__(self, mode: Mode, task: Any, device: torch.device, patience: int, max_events: int) -> None:
        self.device, self.dtype, self.patience, self.max_events = device, mode.dtype, patience, max_events
        self.model = task.model
        self.optimizer = task.optimizer = torch_optimizer(task.optimizer)
        self.optimizer_name = optimizer_name(self.optimizer)
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode.dtype == torch.float16)
        self.scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        self.skipped = self.consecutive = self.updates = 0
        self.events: list[diagnostics.OverflowEvent] = []
        self._loss = None

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.dtype)

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._loss = loss.detach()
        return loss

    def backward_step(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if not self.scaler.is_enabled():
            return
        before, self.scale = self.scale, self.scaler.get_scale()  # one host read per step, as amp's Monitor
        self.updates += 1
        if self.scale >= before:
            self.consecutive = 0
            return
        self.skipped += 1
        self.consecutive += 1
        if len(self.events) < self.max_events:
            kind = diagnostics.classify_step(self._loss, True)
            loss = None if self._loss is None else float(self._loss.float())
            self.events.append(diagnostics.OverflowEvent(self.updates - 1, kind, self.scale, loss,
                                                         diagnostics.nonfinite_grads(self.model)))

    def check(self) -> None:
        """Raises LossScaleStuckError once ``patience`` updates in a row overflowed with the scale at
        or below 1 (torch's scaler has no floor; 1 is where mixprec's Monitor stops without one).
        Called after the step is counted, so a stopped mode's figures add up."""
        if self.consecutive >= self.patience and self.scale <= 1.0:
            raise diagnostics.LossScaleStuckError(
                f"loss scale stuck at its floor: torch.amp.GradScaler backed off on the last {self.consecutive} "
                f"steps in a row, to a scale of {self.scale:g}: gradients overflow even unscaled")

    def loss_scale(self) -> float:
        return self.scale

    def close(self) -> None:
        pass
