"""mixprec.GradScaler: a drop-in for torch.amp.GradScaler on mixprec's loss-scaling ops, that never
waits on the host during a step, whatever the optimizer, with hysteresis, scale bounds, a
skipped-step counter and a scale history."""

from __future__ import annotations

import inspect
from collections import abc, defaultdict
from enum import Enum
from typing import Any, Iterable, Optional, Union
from weakref import WeakKeyDictionary

import torch

from . import distributed as _dist
from ._dtensor import local_all
from ._loss_scale import Replicator, ScaleState, _check_number, check_and_unscale_, combine_found, validate_extra_state
from ._step_guard import StepGuard

__all__ = ["GradScaler", "OptState"]


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


_TAKES_GRAD_SCALER: WeakKeyDictionary = WeakKeyDictionary()


def _takes_grad_scaler(step) -> bool:
    """Whether ``step`` has torch's deprecated ``grad_scaler`` keyword, cached per function:
    inspect.signature costs tens of microseconds, a large part of a small model's step."""
    func = getattr(step, "__func__", step)
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable (then not cached)
        pass
    takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:
        pass
    return takes


class GradScaler:
    """Gradient scaling with ``torch.amp.GradScaler``'s constructor, methods and state_dict keys.

    Use it exactly as torch's::

        scaler = mixprec.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    What differs (all additions):

    - No host synchronization in ``step`` for any optimizer. Optimizers with
      ``_step_supports_amp_scaling`` (mixprec's fused optimizers, torch's ``fused=True``) get
      ``optimizer.grad_scale`` and ``optimizer.found_inf`` after a read-only check and unscale and
      skip inside their kernels, as with torch's scaler. Any other optimizer has its gradients
      unscaled in place and its step made a no-op on the device when found_inf is set: the
      parameters and optimizer state are snapshotted before ``step()`` and selected back after it
      (see :class:`mixprec._step_guard.StepGuard` for the cost: one extra copy of params and state
      in memory, about two to three optimizer steps' worth of memory traffic; one sync on the
      first step, which creates the optimizer's state). Param groups of GPU params with a
      ``capturable`` option are switched to ``capturable=True`` so the step reads nothing from the
      host. ``sync_skip=True`` restores torch's behaviour instead: read found_inf on the host and
      skip ``step()`` (one sync per step, no extra memory, no capturable switch). The default,
      ``sync_skip=None``, does that only where found_inf lives in host memory (CPU training),
      since reading it there waits for nothing; ``sync_skip=False`` forces the device path.
    - ``hysteresis``: back off only on the ``hysteresis``-th overflow since the scale last changed
      (as Megatron's scaler); ``min_scale`` / ``max_scale`` bound the scale.
    - ``skipped_steps`` (property; syncs when read) counts updates that saw an overflow.
    - ``history_size=n`` keeps the scale and the overflow flag of the last n updates on the device;
      :meth:`scale_history` materializes them (one sync).
    - Gradients of any mix of float32/float16/bfloat16 are checked in one pass per device, and
      float16 gradients may be unscaled (torch refuses them outside fused optimizers).
    - Under torch.distributed, found_inf is agreed over ``process_group`` (None: the world;
      ``mixprec.distributed.LOCAL``: none) before any step, as ShardedGradScaler does, so ranks
      skip together (docs/distributed.md). FSDP2's DTensor gradients are handled shard by shard.
    - ``state_dict()`` adds ``hysteresis``, ``_hysteresis_tracker``, ``min_scale``, ``max_scale``
      and ``_skipped_steps`` to torch's keys; torch's scaler loads it (ignoring them), and this one
      loads torch's (keeping its own values for the missing keys). ``load_state_dict`` validates
      everything before changing anything.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: Optional[float] = None, max_scale: Optional[float] = None,
                 sync_skip: Optional[bool] = None, history_size: int = 0, process_group: Any = None) -> None:
        self._device = device
        self._enabled = enabled
        self._process_group = process_group
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            _dist.rank0_warn("mixprec.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        self._sync_skip = None if sync_skip is None else bool(sync_skip)
        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
            _check_number("growth_interval", growth_interval, integer=True, lo=1)
            self._state = ScaleState(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                                     min_scale, max_scale, history_size)
            self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
            self._guards: WeakKeyDictionary = WeakKeyDictionary()

    # torch's private attribute names, kept for code that reads them.
    @property
    def _scale(self) -> Optional[torch.Tensor]:
        return self._state.scale if self._enabled else None

    @property
    def _growth_tracker(self) -> Optional[torch.Tensor]:
        return self._state.growth_tracker if self._enabled else None

    @property
    def _growth_factor(self) -> float:
        return self._state.growth_factor

    @property
    def _backoff_factor(self) -> float:
        return self._state.backoff_factor

    @property
    def _growth_interval(self) -> int:
        return self._state.growth_interval

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._state.scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        return self._state.scale, self._state.growth_tracker

    # -- scale ----------------------------------------------------------------------------------
    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]):
        """Multiplies a tensor, or (nested) lists/tuples/iterables of tensors, by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._state.lazy_init(outputs.device)
            return outputs * self._state.scale.to(device=outputs.device, non_blocking=True)
        stash: list[Replicator] = []

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                if not stash:
                    self._state.lazy_init(val.device)
                    stash.append(Replicator(self._state.scale))
                return val * stash[0].get(val.device)
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # -- unscale / check ------------------------------------------------------------------------
    @staticmethod
    def _grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        grads = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    # Duplicate indices would be summed later; summed scaled fp16 values may
                    # overflow, so check the coalesced values (as torch does).
                    if param.grad.dtype is torch.float16:
                        param.grad = param.grad.coalesce()
                    grads.append(param.grad._values())
                else:
                    grads.append(param.grad)
        return local_all(grads)  # FSDP2's DTensor gradients: this rank's shards

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Optional[torch.Tensor],
                        found_inf: torch.Tensor, allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        found = Replicator(found_inf)
        per_device: dict[torch.device, torch.Tensor] = {}
        grads = self._grads_of(optimizer)
        for g in grads:
            if g.device not in per_device:
                per_device[g.device] = found.get(g.device)
        inv = Replicator(inv_scale) if inv_scale is not None else None
        with torch.no_grad():
            check_and_unscale_(grads, per_device, inv.get if inv is not None else None)
        _dist.agree_found_inf_(per_device, self._process_group, found_inf.device)
        return per_device

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale, in place, and records whether any was
        inf/NaN (on the device). Optional: :meth:`step` does it otherwise. Never syncs."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.zeros((), dtype=torch.float32, device=self._state.scale.device)
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._state.inv_scale(), found_inf)
        optimizer_state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The read-only check (no unscale) for optimizers that unscale in their kernel."""
        self._check_scale_growth_tracker("_check_inf_per_device")
        found_inf = torch.zeros((), dtype=torch.float32, device=self._state.scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, None, found_inf)
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # -- step -----------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        """Unscales (unless :meth:`unscale_` was called) and steps ``optimizer``; a step whose
        gradients hold inf/NaN changes nothing. Returns ``optimizer.step``'s result (which, unlike
        torch's scaler, also runs for a skipped step on the device path; see ``sync_skip``)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, optimizer_state, args, kwargs)

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        per_device = optimizer_state["found_inf_per_device"]
        found = combine_found(per_device.values(), self._state.scale.device)
        sync_skip = self._sync_skip
        if sync_skip is None:  # host memory: reading found_inf is free, snapshotting is not
            sync_skip = found.device.type == "cpu" and all(d.type == "cpu" for d in per_device)
        if sync_skip:
            retval = optimizer.step(*args, **kwargs) if not found.item() else None
        else:
            guard = self._guards.get(optimizer)
            if guard is None:
                guard = self._guards[optimizer] = StepGuard()
            StepGuard.make_capturable(optimizer)
            retval = guard.step(optimizer, found, optimizer.step, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def _fused_step(self, optimizer, optimizer_state, args, kwargs):
        # The optimizer unscales and skips in its own kernel: hand it the scale and found_inf as
        # attributes (torch's contract), or itself through the deprecated grad_scaler keyword.
        kwargs_ = kwargs
        has_grad_scaler_kwarg = _takes_grad_scaler(optimizer.step)
        if has_grad_scaler_kwarg:
            _dist.rank0_warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning, stacklevel=3,
            )
            kwargs_.update({"grad_scaler": self})
        else:
            if optimizer_state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            scale = self._state.scale
            found = combine_found(optimizer_state["found_inf_per_device"].values(), scale.device)
            if optimizer_state["stage"] is OptState.UNSCALED:
                optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
            else:
                preset = getattr(optimizer, "grad_scale", None)
                optimizer.grad_scale = scale if preset is None else scale * preset
            optimizer.found_inf = found
        retval = optimizer.step(*args, **kwargs_)
        optimizer_state["stage"] = OptState.STEPPED
        if not has_grad_scaler_kwarg:
            del optimizer.grad_scale
            del optimizer.found_inf
        return retval

    # -- update ---------------------------------------------------------------------------------
    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Updates the scale on the device from every optimizer's found_inf of this iteration
        (backoff on overflow, after ``hysteresis`` of them; growth after ``growth_interval``
        clean steps; within ``min_scale``/``max_scale``), or sets ``new_scale``. Never syncs."""
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("update")
        found_infs = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if new_scale is not None:
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                scale.copy_(new_scale.reshape(()))
            if found_infs:
                self._state.count_skip(combine_found(found_infs, scale.device))
        else:
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            self._state.update(combine_found(found_infs, scale.device))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- getters and setters ----------------------------------------------------------------------
    def _get_scale_async(self) -> Optional[torch.Tensor]:
        return self._state.scale if self._enabled else None

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs."""
        return self._state.get_scale() if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._state.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._state.growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._state.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._state.backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._state.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._state.growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        return self._state.get_growth_tracker() if self._enabled else 0

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
            "growth_factor": self._state.growth_factor,
            "backoff_factor": self._state.backoff_factor,
            "growth_interval": self._state.growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        out.update(self._state.extra_state())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of torch.amp.GradScaler, validating it all first."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        where = "GradScaler.load_state_dict: state_dict"
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
            if key not in state_dict:
                raise KeyError(f"{where} has no {key!r}")
        _check_number(f"{where}['scale']", state_dict["scale"], lo=0, lo_open=True)
        _check_number(f"{where}['growth_factor']", state_dict["growth_factor"], lo=1.0, lo_open=True)
        _check_number(f"{where}['backoff_factor']", state_dict["backoff_factor"], lo=0, lo_open=True,
                      hi=1.0, hi_open=True)
        _check_number(f"{where}['growth_interval']", state_dict["growth_interval"], integer=True, lo=1)
        _check_number(f"{where}['_growth_tracker']", state_dict["_growth_tracker"], integer=True, lo=0)
        extra = validate_extra_state(state_dict, where)
        min_scale = extra.get("min_scale", self._state.min_scale)
        max_scale = extra.get("max_scale", self._state.max_scale)
        if min_scale is not None and max_scale is not None and max_scale < min_scale:
            raise ValueError(f"{where}: max_scale {max_scale} < min_scale {min_scale}")

        s = self._state
        s.growth_factor = float(state_dict["growth_factor"])
        s.backoff_factor = float(state_dict["backoff_factor"])
        s.growth_interval = int(state_dict["growth_interval"])
        s.hysteresis = extra.get("hysteresis", s.hysteresis)
        s.min_scale, s.max_scale = min_scale, max_scale
        s.set_values(state_dict["scale"], state_dict["_growth_tracker"],
                     extra.get("_hysteresis_tracker", s.hysteresis), extra.get("_skipped_steps"))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                     "of an iteration, or at the end after scaler.update().")
            import copy

            frozen = copy.copy(self._state)
            frozen.freeze_for_pickle()
            state["_state"] = frozen
            state["_guards"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._enabled:
            self._guards = WeakKeyDictionary()
