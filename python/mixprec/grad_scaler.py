"""mixprec.GradScaler: a drop-in for torch.amp.GradScaler on mixprec's loss-scaling ops, that never
waits on the host during a step, whatever the optimizer, with hysteresis, scale bounds, a
skipped-step counter and a scale history."""

from __future__ import annotations

import inspect
from collections import abc, defaultdict
from enum import Enum
from typing import Any, Iterable, Optional, Union, overload
from weakref import WeakKeyDictionary

import torch

from . import _grad_scaler_checks as checks
from . import _ops
from . import distributed as _dist
from ._device_copy import to_device
from ._dtensor import local_all
from ._grad_scaler_state import ScalerStateFront
from ._loss_scale import Replicator, ScaleState, check_and_unscale_, combine_found
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


class GradScaler(ScalerStateFront):
    """Gradient scaling with ``torch.amp.GradScaler``'s constructor, methods and state_dict keys.

    Use it exactly as torch's::

        scaler = mixprec.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    Code written against torch's internals works too: its private names (``_scale``,
    ``_growth_tracker``, ``_init_scale``, ``_per_optimizer_states`` ...) mean what they mean there,
    and the public methods go through torch's hooks (``_lazy_init_scale_growth_tracker``,
    ``_unscale_grads_``, ``_maybe_opt_step``, ``_check_inf_per_device``, ``_get_scale_async``), so a
    subclass overriding one changes what it changes on torch's class.

    Deliberate differences (tests/python/test_grad_scaler_conformance.py tables them): a scale
    must stay a positive, finite float32, so ``init_scale``, ``update(new_scale)`` and checkpoints
    that would make it 0, inf or NaN are refused (as are a ``backoff_factor`` outside (0, 1), a
    ``growth_factor`` <= 1 or inf, negative intervals), with errors naming the call and argument
    and nothing changed; ``update`` also takes an int; ``set_growth_interval`` below the current
    tracker grows on the next clean step (torch's scaler never grows again).

    What differs beyond that (all additions):

    - No host synchronization in ``step`` for any optimizer. Optimizers with
      ``_step_supports_amp_scaling`` (mixprec's fused optimizers, torch's ``fused=True``) get
      ``optimizer.grad_scale`` and ``optimizer.found_inf`` after a read-only check and unscale and
      skip inside their kernels, as with torch's scaler. Any other optimizer has its gradients
      unscaled in place and its step made a no-op on the device when found_inf is set: the
      parameters, their gradients and the optimizer state are snapshotted before ``step()`` and
      selected back after it (see :class:`mixprec._step_guard.StepGuard` for the cost: one extra
      copy of params, grads and state in memory, about two to three optimizer steps' worth of memory traffic; one sync on the
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
    - Gradients of any mix of float32/float16/bfloat16 are checked in one pass per device. float16
      gradients are refused by :meth:`unscale_` as torch refuses them (in place they lose their
      small values); fused optimizers unscale them in float32 in their kernel.
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
        if isinstance(enabled, str):  # "False" from a config or argparse is truthy: it would scale
            raise TypeError(f"GradScaler: invalid enabled {enabled!r}; expected a bool (a string is always true)")
        self._device = device
        self._enabled = enabled
        self._process_group = process_group
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            _dist.rank0_warn("mixprec.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        self._sync_skip = None if sync_skip is None else bool(sync_skip)
        if self._enabled:
            a = checks.check_constructor(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                                         min_scale, max_scale, history_size)
            self._state = ScaleState(a["init_scale"], a["growth_factor"], a["backoff_factor"], a["growth_interval"],
                                     a["hysteresis"], a["min_scale"], a["max_scale"], a["history_size"])
            self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
            self._guards: WeakKeyDictionary = WeakKeyDictionary()

    # -- scale ----------------------------------------------------------------------------------
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]) -> Union[torch.Tensor, Iterable[torch.Tensor]]:
        """Multiplies a tensor, or (nested) lists/tuples/iterables of tensors, by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * to_device(self._scale, outputs.device)
        stash: list[Replicator] = []

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                if not stash:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    stash.append(Replicator(self._scale))
                return val * stash[0].get(val.device)
            # A string is iterable and its items are strings: torch's scaler recurses until the stack ends.
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError(f"GradScaler.scale: outputs must be a Tensor or an iterable of Tensors, "
                             f"got {type(val).__name__}")

        return apply_scale(outputs)

    # -- unscale / check ------------------------------------------------------------------------
    @staticmethod
    def _grads_of(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> list[torch.Tensor]:
        grads = checks.regular_grads(optimizer, allow_fp16)
        if grads is not None:
            return grads
        grads = []
        for gi, group in enumerate(optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype is torch.float16:
                    # Before any grad is touched (the sparse coalesce below), so a refusal changes nothing.
                    raise checks.fp16_unscale_error(optimizer, gi, pi)
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
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch's hook: checks (and with ``inv_scale`` multiplies) the optimizer's grads; returns
        found_inf per device. ``inv_scale=None`` checks only (torch passes a tensor of ones)."""
        grads = self._grads_of(optimizer, allow_fp16)
        per_device = None
        if grads and grads[0].device == found_inf.device and (inv_scale is None or inv_scale.device == found_inf.device):
            # The common case in one op call, no per-grad Python: the op itself refuses (before it
            # writes anything) grads it cannot take, on another device, of another dtype or not
            # contiguous; those take the general path below, which sorts them out.
            try:
                with torch.no_grad():
                    _ops.non_finite_check_and_unscale_(grads, found_inf, inv_scale)
                per_device = {found_inf.device: found_inf}
            except (RuntimeError, TypeError, ValueError):
                per_device = None
        if per_device is None:
            found = Replicator(found_inf)
            per_device = {}
            for g in grads:
                if g.device not in per_device:
                    per_device[g.device] = found.get(g.device)
            inv = Replicator(inv_scale) if inv_scale is not None else None
            with torch.no_grad():
                check_and_unscale_(grads, per_device, inv.get if inv is not None else None)
        _dist.agree_found_inf_(per_device, self._process_group, found_inf.device)
        return per_device

    def _opt_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # Looked up without inserting: a refused call must leave _per_optimizer_states as it was.
        return self._per_optimizer_states.get(id(optimizer)) or _refresh_per_optimizer_state()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale, in place, and records whether any was
        inf/NaN (on the device). Optional: :meth:`step` does it otherwise. Never syncs.

        float16 gradients are refused with torch's ``ValueError("Attempting to unscale FP16
        gradients.")``, and nothing changes: dividing them by the scale in place flushes the small
        ones to zero (about 2% of a typical model's values at 2**16). A mixprec fused optimizer
        needs no unscale_: ``step`` hands it the scale and its kernel unscales in float32 (into
        the fp32 masters with ``master_weights=True``). To clip float16 gradients, clip the
        still-scaled ones against ``max_norm`` times the scale, which loses nothing::

            grads = [p.grad for p in params if p.grad is not None]
            norm, _ = mixprec.multi_tensor_norm(grads)        # float32 accumulation, no overflow
            coef = (max_norm * scaler._get_scale_async() / (norm + 1e-6)).clamp_(max=1.0)
            mixprec.scale_(grads, coef)                       # on the device, no sync
            scaler.step(optimizer)
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        checks.check_optimizer("GradScaler.unscale_", optimizer)
        optimizer_state = self._opt_state(optimizer)
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        inv_scale = self._scale.double().reciprocal().float()  # as torch: the reciprocal in float64
        per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        checks.flag_unusable_scale(per_device, self._scale, inv_scale)
        optimizer_state["found_inf_per_device"] = per_device
        optimizer_state["stage"] = OptState.UNSCALED
        self._per_optimizer_states[id(optimizer)] = optimizer_state

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The read-only check (no unscale) for optimizers that unscale in their kernel."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        per_device = self._unscale_grads_(optimizer, None, found_inf, True)
        checks.flag_unusable_scale(per_device, scale)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return per_device

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # -- step -----------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        """Unscales (unless :meth:`unscale_` was called) and steps ``optimizer``; a step whose
        gradients hold inf/NaN changes nothing. Returns ``optimizer.step``'s result (which, unlike
        torch's scaler, also runs for a skipped step on the device path; see ``sync_skip``).
        As torch's: an optimizer that unscales in its kernel (``_step_supports_amp_scaling``) and
        has no gradient this iteration is stepped as a no-op, while any other optimizer without
        gradients raises "No inf checks were recorded"; and update() needs some optimizer's check."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or any(callable(a) for a in args):
            # torch checks the keyword only; a positional closure would recompute scaled gradients
            # inside step(), after the check, and the optimizer would apply them.
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        checks.check_optimizer("GradScaler.step", optimizer)
        if self._opt_state(optimizer)["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, args, kwargs)

        if self._opt_state(optimizer)["stage"] is OptState.READY:
            self.unscale_(optimizer)
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Optional[float]:
        """torch's hook: steps ``optimizer`` unless this iteration's found_inf is set. Here on the
        device (no sync) unless ``sync_skip`` or host memory make reading found_inf free."""
        per_device = optimizer_state["found_inf_per_device"]
        found = combine_found(per_device.values(), self._scale.device)
        sync_skip = self._sync_skip
        if sync_skip is None:  # host memory: reading found_inf is free, snapshotting is not
            sync_skip = found.device.type == "cpu" and all(d.type == "cpu" for d in per_device)
        if sync_skip:
            return optimizer.step(*args, **kwargs) if not found.item() else None
        guard = self._guards.get(optimizer)
        if guard is None:
            guard = self._guards[optimizer] = StepGuard()
        StepGuard.make_capturable(optimizer)
        return guard.step(optimizer, found, optimizer.step, *args, **kwargs)

    def _fused_step(self, optimizer, args, kwargs):
        # The optimizer unscales and skips in its own kernel: hand it the scale and found_inf as
        # attributes (torch's contract), or itself through the deprecated grad_scaler keyword.
        kwargs_ = kwargs
        has_grad_scaler_kwarg = _takes_grad_scaler(optimizer.step)
        optimizer_state = self._opt_state(optimizer)
        existed = id(optimizer) in self._per_optimizer_states
        # Recorded before the step: an optimizer taking grad_scaler= records its own inf check
        # (_check_inf_per_device) here, which update() reads.
        self._per_optimizer_states[id(optimizer)] = optimizer_state
        if has_grad_scaler_kwarg:
            _dist.rank0_warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning, stacklevel=3,
            )
            kwargs_.update({"grad_scaler": self})
        elif self._check_in_step(optimizer, optimizer_state, args, kwargs):
            # A mixprec optimizer's own step() makes the inf check, from the grads its held steps
            # read in C++ (optimizers/_held.py), or else by calling back _checked_found: one call
            # for the check and the update, the check still before anything could be refused.
            scale = self._get_scale_async()
            found = torch.zeros((), dtype=torch.float32, device=scale.device)
            optimizer_state["found_inf_per_device"] = {found.device: found}
            optimizer._found_inf_pending = lambda: self._checked_found(optimizer, optimizer_state, scale)
            # Neither tensor needs the copies below: FusedOptimizer.step writes neither, and no
            # hook runs around it (_check_in_step).
            optimizer.grad_scale = scale
            optimizer.found_inf = found
        else:
            if optimizer_state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            scale = self._get_scale_async()
            found = checks.found_for_step(optimizer_state["found_inf_per_device"], scale)
            if optimizer_state["stage"] is OptState.UNSCALED:
                optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
            else:
                # A new tensor, as torch's product is: an in-place op of the optimizer on it must
                # not change the scale (a device-side copy, no sync).
                preset = getattr(optimizer, "grad_scale", None)
                optimizer.grad_scale = scale.clone() if preset is None else scale * preset
            optimizer.found_inf = found
        try:
            retval = optimizer.step(*args, **kwargs_)
        except BaseException:
            if not existed:  # the optimizer refused: no record of this try
                self._per_optimizer_states.pop(id(optimizer), None)
            raise
        finally:
            if not has_grad_scaler_kwarg:  # never left behind for a later plain step()
                del optimizer.grad_scale
                del optimizer.found_inf
                optimizer.__dict__.pop("_found_inf_pending", None)
        self._per_optimizer_states[id(optimizer)] = optimizer_state
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def _check_in_step(self, optimizer, optimizer_state: dict[str, Any], args, kwargs) -> bool:
        # A subclass overriding torch's check hooks gets them called, as ever.
        cls = type(self)
        own_hooks = (cls._unscale_grads_ is GradScaler._unscale_grads_
                     and cls._check_inf_per_device is GradScaler._check_inf_per_device)
        return own_hooks and optimizer_state["stage"] is OptState.READY and checks.step_checks_inf(
            optimizer, args, kwargs, self._process_group)

    def _checked_found(self, optimizer, optimizer_state: dict[str, Any], scale: torch.Tensor) -> torch.Tensor:
        """The scaler's own inf check, for a step that could not make it from held grads."""
        self._check_inf_per_device(optimizer)
        return checks.found_for_step(optimizer_state["found_inf_per_device"], scale)

    # -- update ---------------------------------------------------------------------------------
    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Updates the scale on the device from every optimizer's found_inf of this iteration
        (backoff on overflow, after ``hysteresis`` of them; growth after ``growth_interval``
        clean steps; within ``min_scale``/``max_scale``), or sets ``new_scale``. Never syncs,
        except to check a ``new_scale`` tensor's value on a GPU.

        ``new_scale``: a float (or, beyond torch, an int or numpy number), or as torch requires a
        0-dim tensor on this scaler's device type with ``requires_grad=False``; it must be a
        positive normal float32 within ``min_scale``/``max_scale``: a 0, inf or NaN scale would
        corrupt every later step, so it is refused and nothing changes."""
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("update")
        found_infs = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if new_scale is not None:
            value = checks.check_new_scale(new_scale, self._device, self._state)
            if isinstance(value, torch.Tensor):
                scale.copy_(value)
            else:
                scale.fill_(value)
            if found_infs:
                self._state.count_skip(combine_found(found_infs, scale.device))
        else:
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            self._state.update(combine_found(found_infs, scale.device))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

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
