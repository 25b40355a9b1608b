"""Skips any optimizer's step on the device: snapshot what step() may change, run it, and put the
snapshot back where found_inf is set, so the host never has to read found_inf.

Used by mixprec.GradScaler and mixprec.amp for optimizers that cannot skip inside their own
kernels (those without ``_step_supports_amp_scaling``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch

from ._device_copy import to_device
from ._dtensor import local

# Same-width integer views: copies and the select below are then exact for every bit pattern
# (NaN payloads, -0.0, inf), which float arithmetic (lerp, x*0) is not: inf*0 is NaN.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view(t: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2) is snapshotted and selected through its local shard.
    return local(t).detach().view(_INT_OF_WIDTH[t.element_size()])


def _dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.element_size() in _INT_OF_WIDTH


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. tuples of tensors: treat as changed, the host path sorts it out
        return False


class _GradOf:
    """``p.grad`` seen as a one-key container, so a parameter's gradient is snapshotted and put
    back by the same code as its state: some optimizers write into ``.grad`` during ``step()``
    (torch's foreach SGD with Nesterov momentum adds the momentum buffer to it in place), and a
    skipped step must leave the gradient as the scaler's unscale left it, as torch's skip does."""

    __slots__ = ("param",)

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param

    def __contains__(self, key: str) -> bool:
        return self.param.grad is not None

    def __getitem__(self, key: str) -> torch.Tensor | None:
        return self.param.grad

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.param.grad = value


class StepGuard:
    """Runs ``optimizer.step()`` so that it changes nothing where ``found_inf`` is non-zero,
    without a host synchronization.

    Before the step, every parameter, its gradient and every tensor in ``optimizer.state`` and in
    the param groups is copied into reusable buffers (one multi-tensor copy per device and element width);
    after it, each tensor becomes ``found ? snapshot : new`` through three multi-tensor integer
    ops (``new*keep + snapshot*take``), which is exact for every bit pattern.

    Cost: one extra copy of the parameters, their gradients and the optimizer state in memory
    (for Adam, four times the parameter memory), and per step about 2x that state read and written for the
    snapshot plus about 5x for the select, i.e. roughly the traffic of two or three extra
    optimizer steps. Optimizers with ``_step_supports_amp_scaling`` (mixprec's fused ones,
    torch's ``fused=True``) skip inside their kernel instead and pay none of this.

    What forces one host synchronization on a step (documented fallbacks, not the steady state):
    the step creates state (an optimizer's first step, e.g. Adam's moments or SGD's momentum
    buffer), changes host values in ``optimizer.state`` or the param groups, replaces a state
    tensor by one of another shape or dtype, or changes a tensor that lives on the CPU while
    found_inf lives on a GPU (torch's non-capturable Adam keeps ``step`` on the CPU; see
    :meth:`make_capturable`; torch's Adagrad has no capturable mode and reads its CPU step
    counter on the host, so it syncs every step). Then found_inf is read, and a skipped step is
    undone exactly, removing the state it created.
    """

    def __init__(self) -> None:
        self._layout: list[tuple] | None = None
        self._buffers: list[torch.Tensor] = []
        #: Whether the last step needed the host-checked fallback (tests and diagnostics).
        self.last_used_host = False

    # -- public ---------------------------------------------------------------------------------
    @staticmethod
    def make_capturable(optimizer: torch.optim.Optimizer) -> None:
        """Turns on ``capturable`` in param groups of GPU params that have the option (torch's
        Adam, AdamW, NAdam, RAdam, Adamax, ASGD, Rprop), moving their ``step`` counters to the
        params' device, so those steps read nothing from the host. Results differ from the
        non-capturable path by float rounding of the bias corrections only."""
        for group in optimizer.param_groups:
            if group.get("capturable", True) or group.get("fused") or group.get("differentiable"):
                continue
            params = [p for p in group["params"] if p.device.type not in ("cpu", "meta")]
            if not params or len(params) != len(group["params"]):
                continue
            group["capturable"] = True
            for p in params:
                state = optimizer.state.get(p)
                step = state.get("step") if state else None
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    state["step"] = step.to(p.device)

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
             step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls ``step_fn(*args, **kwargs)`` (the optimizer's step) and undoes its effect on the
        device when ``found_inf`` (a device scalar) is non-zero. Returns step_fn's result."""
        tensors, host, keys = _collect(optimizer)
        with torch.no_grad():
            snaps = self._snapshot([t for _, _, t in tensors])
        retval = step_fn(*args, **kwargs)
        with torch.no_grad():
            self._undo_if_found(optimizer, found_inf, tensors, snaps, host, keys)
        return retval

    # -- internals --------------------------------------------------------------------------------
    def _snapshot(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        tensors = [local(t) for t in tensors]
        layout = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]
        if layout != self._layout:  # buffers are scratch: only their layout must match
            self._buffers = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                             for t in tensors]
            self._layout = layout
        groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for t, b in zip(tensors, self._buffers):
            dst, src = groups[(t.device, t.element_size())]
            dst.append(_int_view(b))
            src.append(_int_view(t))
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)
        return self._buffers

    def _undo_if_found(self, optimizer, found_inf, tensors, snaps, host, keys) -> None:
        need_host = False
        live: list[tuple[int, torch.Tensor]] = []  # (snapshot index, tensor to restore into)
        for i, (container, key, old) in enumerate(tensors):
            new = container[key] if _has(container, key) else None
            if new is None:
                need_host = True
                continue
            if new is not old and (not isinstance(new, torch.Tensor) or new.shape != old.shape
                                   or new.dtype != old.dtype or new.device != old.device or not _dense(new)):
                need_host = True
                continue
            live.append((i, new))
        for container, key, value in host:
            if not _has(container, key) or not _same_value(container[key], value):
                need_host = True
        for p, before in keys.items():  # state created (first step) or removed by step()
            state = optimizer.state.get(p)
            if set(state or ()) != set(before or ()):
                need_host = True
        for group in optimizer.param_groups:  # params that gained state in this step
            for p in group["params"]:
                if p not in keys and optimizer.state.get(p):
                    need_host = True

        found_inf = found_inf.reshape(())
        found_dev = found_inf.device
        by_group: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for i, t in live:
            if t.device != found_dev and t.device.type == "cpu":
                # A host-resident tensor cannot be selected by a device flag without reading it.
                if not torch.equal(_int_view(t), _int_view(snaps[i])):
                    need_host = True
                continue
            by_group[(t.device, t.element_size())][0].append(_int_view(t))
            by_group[(t.device, t.element_size())][1].append(_int_view(snaps[i]))

        self.last_used_host = need_host
        if need_host:
            if bool(found_inf.item() != 0):  # the documented fallback: one sync on this step
                _restore_exactly(optimizer, tensors, snaps, host, keys)
            return
        flags: dict[torch.device, torch.Tensor] = {}
        for (device, width), (dst, src) in by_group.items():
            flag = flags.get(device)
            if flag is None:
                flag = flags[device] = to_device(found_inf, device) != 0
            take = flag.to(_INT_OF_WIDTH[width])
            keep = (~flag).to(_INT_OF_WIDTH[width])
            torch._foreach_mul_(dst, keep)
            torch._foreach_mul_(src, take)
            torch._foreach_add_(dst, src)


def _has(container, key) -> bool:
    if isinstance(container, list):
        return key < len(container)
    return key in container


def _collect(optimizer: torch.optim.Optimizer):
    """(container, key, tensor) for every tensor step() may change, (container, key, value) for
    host values in the state and groups, and each param's state keys (None: no state)."""
    tensors: list[tuple[Any, Any, torch.Tensor]] = []
    host: list[tuple[Any, Any, Any]] = []
    keys: dict[torch.Tensor, Any] = {}
    seen: set[int] = set()

    def add(container, key, value):
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                return
            seen.add(id(value))
            if _dense(value):
                tensors.append((container, key, value))
            else:
                host.append((container, key, value))  # sparse etc.: compared by identity only
        else:
            host.append((container, key, value))

    for group in optimizer.param_groups:
        for k, v in group.items():
            if k != "params":
                add(group, k, v)
        params = group["params"]
        for i, p in enumerate(params):
            add(params, i, p)
            if p.grad is not None:
                add(_GradOf(p), "grad", p.grad)
            state = optimizer.state.get(p)
            keys[p] = tuple(state) if state else None
            if state:
                for k, v in state.items():
                    add(state, k, v)
    return tensors, host, keys


def _restore_exactly(optimizer, tensors, snaps, host, keys) -> None:
    """The host-checked undo: every tensor and host value back, state created by step() removed."""
    for (container, key, old), snap in zip(tensors, snaps):
        _int_view(old).copy_(_int_view(snap))
        container[key] = old
    for container, key, value in host:
        container[key] = value
    for p, before in keys.items():
        state = optimizer.state.get(p)
        if state is None:
            continue
        if before is None:
            del optimizer.state[p]
        else:
            for k in [k for k in state if k not in before]:
                del state[k]
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in keys and p in optimizer.state:
                del optimizer.state[p]
