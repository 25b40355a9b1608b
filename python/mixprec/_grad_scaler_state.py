"""The state half of mixprec.GradScaler: torch.amp.GradScaler's private names mapped onto the device
ScaleState, the getters and setters, and checkpoints (the iteration, scale to update, is grad_scaler.py)."""

from __future__ import annotations

from collections import abc
from typing import Any, Optional

import torch

from . import _grad_scaler_checks as checks
from ._loss_scale import ScaleState


class ScalerStateFront:
    """GradScaler's state as torch's code sees it. Enabled instances hold ``_state`` (a ScaleState)."""

    _enabled: bool
    _state: ScaleState

    # -- torch's private names ---------------------------------------------------------------------
    # Code written for torch.amp.GradScaler (subclasses, tools that inspect a scaler) reads and
    # writes these and overrides the methods below; they map onto the device state, and the public
    # methods go through them, so an override takes effect as it would on torch's class.
    def _state_field(name: str, doc: str):  # noqa: N805  (a property factory run at class creation)
        def get(self):
            return getattr(self._state, name)

        def set_(self, value):
            setattr(self._state, name, value)
        return property(get, set_, doc=doc)

    _init_scale = _state_field("init_scale", "The scale the device tensor starts from (a Python float).")
    _init_growth_tracker = _state_field("init_growth_tracker", "The growth tracker's starting value.")
    _growth_factor = _state_field("growth_factor", "As get_growth_factor().")
    _backoff_factor = _state_field("backoff_factor", "As get_backoff_factor().")
    _growth_interval = _state_field("growth_interval", "As get_growth_interval().")
    _growth_tracker = _state_field("growth_tracker", "The device growth tracker (int32), None before scale().")
    del _state_field

    @property
    def _scale(self) -> Optional[torch.Tensor]:
        """The device scale (float32), None before the first scale()."""
        return self._state.scale

    @_scale.setter
    def _scale(self, value: Optional[torch.Tensor]) -> None:
        self._state.scale = value
        if value is not None:  # mixprec's trackers beside a scale set the torch way
            self._state.init_extra(value.device)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._state.lazy_init(dev)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    # -- getters and setters ----------------------------------------------------------------------
    def _get_scale_async(self) -> Optional[torch.Tensor]:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs."""
        if not self._enabled:
            return 1.0
        scale = self._get_scale_async()
        return float(self._init_scale) if scale is None else float(scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor: a finite number > 1 (torch checks nothing here)."""
        self._growth_factor = checks.check_growth_factor("GradScaler.set_growth_factor: new_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor: a number in (0, 1) (torch checks nothing here)."""
        self._backoff_factor = checks.check_backoff_factor("GradScaler.set_backoff_factor: new_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval: an integer >= 0 (0: never grow, as in torch). Lowered below the
        current growth tracker, the scale grows on the next clean step, where torch's never grows
        again (its tracker must equal the interval): a deliberate difference."""
        self._growth_interval = checks.check_growth_interval("GradScaler.set_growth_interval: new_interval",
                                                             new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        tracker = self._growth_tracker
        return int(self._init_growth_tracker) if tracker is None else int(tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def skipped_steps(self) -> int:
        """How many updates saw inf/NaN gradients (0 when disabled). Syncs when read."""
        return self._state.get_skipped() if self._enabled else 0

    def scale_history(self, with_overflow: bool = False) -> list:
        """The scale used by each of the last ``history_size`` updates, oldest first; with
        ``with_overflow`` as ``(scale, overflowed)`` pairs. Empty unless ``history_size`` > 0."""
        return self._state.scale_history(with_overflow) if self._enabled else []

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) plus mixprec's; empty when disabled. Syncs (reads the scale)."""
        if not self._enabled:
            return {}
        out = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        out.update(self._state.extra_state())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of torch.amp.GradScaler (numbers, numpy scalars or
        0-dim tensors), validating all of it first: a refused checkpoint changes nothing."""
        if not self._enabled:
            return
        if isinstance(state_dict, abc.Mapping) and len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        v = checks.check_state_dict(state_dict, self._state)
        s = self._state
        s.growth_factor, s.backoff_factor, s.growth_interval = v["growth_factor"], v["backoff_factor"], v["growth_interval"]
        s.hysteresis, s.min_scale, s.max_scale = v["hysteresis"], v["min_scale"], v["max_scale"]
        s.set_values(v["scale"], v["_growth_tracker"], v["_hysteresis_tracker"], v["_skipped_steps"])
