"""What FusedOptimizer.step keeps between steps, and the cheap per-step passes that replace its
per-parameter Python loops (issue 22): a step over 292 tensors must cost the host well under the
device's time, or a synchronized step leaves the GPU idle while Python walks lists.

Nothing here skips a check that guards correctness. Hyper-parameters are re-checked only when a
value is no longer the very object last checked (an LR scheduler's new float re-checks lr alone);
mutable values (tensors, lists) are re-checked every step, which is cheap. Per-tensor facts (which
params have grads, sparse grads, devices, state) are gathered fresh each step by C-level passes
(``map`` over attribute getters: tens of nanoseconds per tensor instead of a Python loop body), so
a replaced ``.data``, a new grad after ``zero_grad(set_to_none=True)``, a param moved to another
device or a replaced state dict is seen on the step it happens. Any irregularity sends the group
down the original, fully checked path, which raises the same errors as ever; the op itself checks
every tensor's dtype, device, shape, layout and aliasing on every call.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Any, Optional

import torch

from .._device_copy import to_device
from ._rules import check_group

GRAD = attrgetter("grad")
_LAYOUT = attrgetter("layout")
_DEVICE = attrgetter("device")
_MISSING = object()
# Values that cannot change without becoming another object: an unchanged identity means an
# unchanged value. (torch.dtype and torch.device objects are immutable too.)
_IMMUTABLE = (float, int, bool, str, type(None), torch.dtype, torch.device)


def _immutable(v: Any) -> bool:
    if isinstance(v, _IMMUTABLE):
        return True
    return type(v) is tuple and all(isinstance(x, _IMMUTABLE) for x in v)


class HyperCache:
    """The hyper-parameter values of each param group as last validated, by group position. An
    entry is for the group object it was made from (``load_state_dict`` and ``add_param_group``
    bring new dicts, so their first step checks everything)."""

    def __init__(self) -> None:
        self._seen: list[Optional[tuple[dict, tuple, tuple]]] = []

    def check(self, owner: str, rules: dict, group_rules: tuple, group: dict, index: int) -> None:
        """check_group(owner, rules, group_rules, group, f"param group {index}"), restricted to the
        options whose value is not the immutable object validated last time."""
        keys = tuple(rules)
        values = tuple(group.get(k, _MISSING) for k in keys)
        while len(self._seen) <= index:
            self._seen.append(None)
        seen = self._seen[index]
        if seen is None or seen[0] is not group or seen[1] != keys:
            check_group(owner, rules, group_rules, group, f"param group {index}")
        else:
            old = seen[2]
            changed = {k for k, v, o in zip(keys, values, old) if v is not o or not _immutable(v)}
            if not changed:
                return
            check_group(owner, {k: rules[k] for k in keys if k in changed},
                        tuple(r for r in group_rules if changed.intersection(r.keys)), group,
                        f"param group {index}")
        self._seen[index] = (group, keys, values)

    def forget_from(self, index: int) -> None:
        del self._seen[index:]


def device_scalar(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """A GradScaler's scale or found_inf, on `device` (no host sync, but for a CPU `device` beside a
    GPU scaler: _device_copy says why)."""
    if t is None:
        return None
    t = to_device(t, device, torch.float32)
    return t.reshape(1) if t.dim() != 1 else t


def step_scalars(optimizer: Any, group: dict, device: torch.device, grad_scale: Optional[torch.Tensor],
                 found_inf: Optional[torch.Tensor]) -> dict:
    """The step scalars of one group's op call (its _step_group's keywords), on `device`."""
    lr, lr_tensor = group["lr"], None
    if isinstance(lr, torch.Tensor):
        lr, lr_tensor = 0.0, lr.to(device=device, dtype=torch.float32).reshape(1)
    return dict(step_tensor=optimizer._group_step_tensor(group, device), lr=float(lr), lr_tensor=lr_tensor,
                grad_scale=device_scalar(grad_scale, device), found_inf=device_scalar(found_inf, device))


def regular_params(params: list) -> Optional[tuple[list, list, torch.device]]:
    """(params, grads, device) when every param of a group has a dense gradient and all share one
    device: the common case, found by three C-level passes. None otherwise (a param without grad,
    a sparse grad, mixed devices, an empty group): the caller takes the fully checked path."""
    grads = list(map(GRAD, params))
    try:
        layouts = list(map(_LAYOUT, grads))
    except AttributeError:  # a None grad
        return None
    if not params or layouts.count(torch.strided) != len(layouts):
        return None
    devices = set(map(_DEVICE, params))
    if len(devices) != 1:
        return None
    return list(params), grads, devices.pop()


def checked_params(owner: str, group: dict, index: int) -> tuple[list, Optional[torch.device]]:
    """The group's params with gradients and their device, checked one by one (the path of any
    group that regular_params does not vouch for); raises for mixed devices and sparse grads."""
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return params, None
    device = params[0].device
    for p in params:
        if p.device != device:
            raise ValueError(f"{owner}: param group {index} mixes devices ({device} and {p.device}); put each "
                             "device's params in its own group")
        if p.grad.is_sparse:
            raise RuntimeError(f"{owner} does not support sparse gradients")
    return params, device


class StepLists:
    """The per-parameter state dicts of the lists being stepped, found with one lookup per param,
    so the subclasses' ``_states``/``_masters`` read them without hashing each tensor again.
    Valid during one step() only (cleared after it): nothing stale survives to the next."""

    def __init__(self) -> None:
        self._by_list: dict[int, tuple[list, list]] = {}

    def add(self, params: list, state_dicts: list) -> None:
        self._by_list[id(params)] = (params, state_dicts)

    def state_dicts(self, params: list) -> Optional[list]:
        entry = self._by_list.get(id(params))
        return entry[1] if entry is not None and entry[0] is params else None

    def clear(self) -> None:
        self._by_list.clear()


def gather(state_dicts: list, key: str) -> list:
    """state[key] of each state dict (KeyError for a missing key, as the direct lookup raises)."""
    return list(map(itemgetter(key), state_dicts))
