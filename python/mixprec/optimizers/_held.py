"""Held steps (issue 22): each param group's op call kept in C++ (``torch.classes.mixprec.HeldStep``)
after a fully checked step, and replayed on the next steps with the step scalars alone.

Passing a group's tensor lists through the dispatcher costs ~0.1 us per tensor of host time
(~150 us for 6 lists x 292 tensors, GPT-2-medium under O2); a held step passes none: C++ reads every
param's current ``.grad`` itself and the op runs every check it always runs (dtypes, devices,
shapes, layouts, aliasing) on the held tensors. What C++ cannot see is checked here before each
replay, by C-level passes over ids (the held lists keep every object alive, so an id cannot be
reused): the optimizer's state mapping (each param's state dict), each state dict's keys and
tensors, each group's params and option values (``lr`` and ``step`` are passed anew each step).
Any difference, a param without a dense grad, moved to another device or of another dtype, sends
the step down the fully checked path, which records new held steps when it ends.
"""

from __future__ import annotations

import inspect
from itertools import chain
from operator import attrgetter, is_
from typing import Any, Callable, Iterable, Optional

import torch

from .. import _ops
from ._step_cache import _immutable, step_scalars

# Group keys passed anew at every step instead of held: their values may change every step.
_PER_STEP_KEYS = ("lr", "step")
_GRAD = attrgetter("grad")
# The op arguments every replay sets (HeldStep.step): the step scalars, and the grads.
_STEP_ARGS = ("grads", "step_tensor", "lr", "lr_tensor", "grad_scale", "found_inf")


def _group_items(group: dict) -> list:
    return [(k, id(v)) for k, v in group.items() if k not in _PER_STEP_KEYS]


def _same_objects(now: Iterable, then: list) -> bool:
    """Whether `now` yields exactly the objects of `then` (same length, each the same object):
    one C-level pass, ~25 ns an element."""
    return all(map(is_, now, then))


class HeldGroup:
    """One group's held op call and what it assumes of the group."""

    def __init__(self, group: dict, plan: Any, params: list, state_dicts: list, per_step: tuple):
        self.group = group
        self.plan = plan
        self.device = params[0].device
        self.params = params
        self.values = [v for k, v in group.items() if k not in _PER_STEP_KEYS]  # kept alive: ids compared
        self.items = _group_items(group)
        self.state_dicts = state_dicts
        self.state_keys = list(chain.from_iterable(state_dicts))
        self.state_values = list(chain.from_iterable(map(dict.values, state_dicts)))
        self.per_step = per_step

    def unchanged(self, group: dict) -> bool:
        params = group["params"]
        # The keys by equality (the same key strings: fast); with equal keys lists the value
        # passes have equal lengths, so identity element by element is the whole comparison.
        return (group is self.group and _group_items(group) == self.items and len(params) == len(self.params)
                and _same_objects(params, self.params)
                and list(chain.from_iterable(self.state_dicts)) == self.state_keys
                and _same_objects(chain.from_iterable(map(dict.values, self.state_dicts)), self.state_values))


class HeldSteps:
    """The held steps of every param group of one optimizer, valid while `current` says so."""

    def __init__(self, optimizer: Any, groups: list[HeldGroup]):
        self.state = optimizer.state
        self.state_keys = list(optimizer.state)
        self.state_values = list(optimizer.state.values())
        self.groups = groups
        self.used = False
        self.norm: Optional[tuple[list, Any]] = None  # (devices, HeldNorm): made at first use

    def global_grad_norms(self, grad_scale: Optional[torch.Tensor]) -> Optional[dict]:
        """The unscaled L2 norm of every held group's grads together, on each device in use (FusedLAMB's
        clipping norm: the same bits as FusedLAMB._global_grad_norms, see HeldNorm); None when some
        param has no dense grad on its own device (the fully checked path's case)."""
        if self.norm is None:
            by_device: dict = {}
            for g in self.groups:  # grads by device, in group order: the checked path's reduction order
                by_device.setdefault(g.device, []).extend(g.params)
            self.norm = (list(by_device), torch.classes.mixprec.HeldNorm(
                list(chain.from_iterable(by_device.values())), list(map(len, by_device.values()))))
        devices, plan = self.norm
        norms = plan.norms(grad_scale)
        return dict(zip(devices, norms)) if norms else None

    @staticmethod
    def current(optimizer: Any) -> Optional[HeldSteps]:
        """The optimizer's held steps if nothing they hold has changed since they were made."""
        held = optimizer.__dict__.get("_held")
        if held is None:
            return None
        state = optimizer.state
        if (state is not held.state or len(optimizer.param_groups) != len(held.groups)
                or len(state) != len(held.state_keys) or not _same_objects(state, held.state_keys)
                or not _same_objects(state.values(), held.state_values)):
            return None
        for g, group in zip(held.groups, optimizer.param_groups):
            if not g.unchanged(group):
                return None
        return held

    def check_inf(self, found: torch.Tensor, scale: Optional[torch.Tensor]) -> bool:
        """A GradScaler's inf check of every group's grads (and of the scale) into `found`;
        False when some group's grads are not what its held step takes (see HeldStep.check_inf)."""
        for g in self.groups:
            if g.device != found.device or not g.plan.check_inf(found, scale):
                return False
            scale = None  # flagged once
        return True

    def run(self, optimizer: Any, grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
            check_inf: bool = False) -> bool:
        """Every group's step, each group checked (by its op's check twin) before any writes, as
        FusedOptimizer.step does; `check_inf`: a GradScaler's inf check of every group's grads into
        found_inf first (grad_scale is the scale). False, with nothing written but found_inf, when
        a group's grads are not what its held step takes: the caller then takes the fully checked
        path (and its own inf check, into a new found_inf)."""
        if check_inf and any(g.device != found_inf.device for g in self.groups):
            return False  # the scaler's own check replicates found_inf per device
        if not optimizer._begin_step(self, grad_scale):
            return False
        if check_inf and len(self.groups) > 1:
            if not self.check_inf(found_inf, grad_scale):
                return False
            check_inf = False
        calls = []
        saved_steps = [group.get("step") for group in optimizer.param_groups]
        try:
            for g, group in zip(self.groups, optimizer.param_groups):
                s = step_scalars(optimizer, group, g.device, grad_scale, found_inf)
                extras = list(optimizer._held_extras(group, g.device)) if g.per_step else []
                calls.append((g.plan, (s["step_tensor"], s["lr"], s["lr_tensor"], s["grad_scale"], s["found_inf"],
                                       extras)))
            for plan, args in calls[1:]:
                if not plan.step(*args, True, False):
                    return False
            if not calls[0][0].step(*calls[0][1], False, check_inf):
                return False
        except BaseException:
            # A refused step changes nothing: a step tensor made for it goes again.
            for group, step in zip(optimizer.param_groups, saved_steps):
                if step is None:
                    group.pop("step", None)
                else:
                    group["step"] = step
            raise
        for plan, args in calls[1:]:
            plan.step(*args, False, False)  # checked above, and nothing ran since
        return True


def try_step(optimizer: Any, hyper: Any, grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
             pending: Optional[Callable]) -> tuple[bool, Optional[torch.Tensor]]:
    """FusedOptimizer.step's held path: (True, _) when its held steps made the step; else (False,
    the found_inf for the fully checked path), the held steps dropped (that path makes new ones).
    `pending`: left by mixprec.GradScaler when it leaves its inf check to the step
    (checks_in_step): the check then goes with the held call, into found_inf with grad_scale as
    the scale; else `pending()`, the scaler's own check, gives the found_inf to use, still before
    anything of the step can be refused."""
    held = HeldSteps.current(optimizer)
    if held is not None:
        for index, group in enumerate(optimizer.param_groups):
            hyper.check(type(optimizer).__name__, optimizer._rules, optimizer._all_group_rules(), group, index)
        if held.run(optimizer, grad_scale, found_inf, check_inf=pending is not None):
            held.used = True
            optimizer.__dict__.pop("_held_backoff", None)
            return True, found_inf
    if pending is not None:
        found_inf = pending()
    stale = optimizer.__dict__.pop("_held", None)
    if stale is not None and not stale.used:
        # Made and never used (something changes every step): making them costs about as much
        # as a fully checked step, so wait 1, 3, 7 ... (at most 63) steps before the next try.
        misses = optimizer.__dict__.get("_held_backoff", (0, 0))[0] + 1
        optimizer.__dict__["_held_backoff"] = (misses, (1 << min(misses, 6)) - 1)
    return False, found_inf


class Recorder:
    """Collects the op calls of one fully checked step, group by group (see _ops.recorder)."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def start_group(self) -> None:
        self.calls.append([])

    def __call__(self, family: str, values: dict) -> None:
        if self.calls:
            self.calls[-1].append((family, dict(values)))

    def __enter__(self) -> Recorder:
        _ops.recorder.record = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _ops.recorder.record = None


def build(optimizer: Any, stepped: list, recorder: Recorder) -> Optional[HeldSteps]:
    """Held steps for the step just made, when every group stepped all its params with one op call
    that a HeldStep can replay (see _holdable); None otherwise."""
    misses, wait = optimizer.__dict__.get("_held_backoff", (0, 0))
    if wait > 0:
        optimizer.__dict__["_held_backoff"] = (misses, wait - 1)
        return None
    if len(stepped) != len(optimizer.param_groups) or len(recorder.calls) != len(stepped):
        return None
    groups = []
    for (group, params, scalars), calls in zip(stepped, recorder.calls):
        if group is not optimizer.param_groups[len(groups)] or len(calls) != 1:
            return None
        held = _holdable(optimizer, group, params, scalars, *calls[0])
        if held is None:
            return None
        groups.append(held)
    return HeldSteps(optimizer, groups)


def _holdable(optimizer: Any, group: dict, params: list, scalars: dict, family: str, values: dict) -> Optional[HeldGroup]:
    """A HeldGroup for this group's op call if a replay would make the same call: every param of
    the group stepped, the step scalars passed through as given, the grads those of the params,
    every other tensor a param, a value of its state dict or of the group (what HeldGroup watches),
    and every option value immutable (compared by identity)."""
    all_params = group["params"]
    op_params = values["params"]
    if len(op_params) != len(all_params) or not _same_objects(op_params, all_params):
        return None  # some params without grads, or DTensors taken by their local shards
    if not _same_objects(values["grads"], list(map(_GRAD, op_params))):
        return None
    if (values.get("step_tensor") is not scalars["step_tensor"] or values.get("lr_tensor") is not scalars["lr_tensor"]
            or values.get("grad_scale") is not scalars["grad_scale"]
            or values.get("found_inf") is not scalars["found_inf"] or values.get("lr") != scalars["lr"]):
        return None
    rules = optimizer._rules
    if not all(_immutable(group[k]) for k in rules if k in group and k not in _PER_STEP_KEYS):
        return None
    state_dicts = list(map(optimizer.state.__getitem__, all_params))
    # Every tensor held must be one whose identity HeldGroup watches: a param, a state value, a
    # group value (the fully checked path would build the same lists from the same objects).
    owned = set(map(id, chain(all_params, chain.from_iterable(map(dict.values, state_dicts)))))
    group_values = {id(v) for v in group.values()}
    per_step = tuple(getattr(optimizer, "_held_per_step", ()))

    op = _ops._OPTIM_OPS[family + "_"].op
    tensors, lengths, optionals, floats, ints, bools, names = [], [], [], [], [], [], []
    for arg in op._schema.arguments:
        name = arg.name
        value = values[name] if name in values else arg.default_value
        kind = str(arg.type)
        if kind == "List[Tensor]":
            value = list(value)
            if name not in _STEP_ARGS and value and (len(value) != len(all_params)
                                                     or not owned.issuperset(map(id, value))):
                return None
            lengths.append(len(value))
            tensors.extend(value)
        elif kind == "Tensor":
            if id(value) not in group_values:
                return None
            tensors.append(value)
        elif kind == "Optional[Tensor]":
            if name in per_step:
                names.append(name)
            elif name not in _STEP_ARGS and value is not None:
                return None  # a tensor made for this step, which a replay would not remake
            optionals.append(value)
        elif kind == "float":
            floats.append(float(value))
        elif kind == "int":
            ints.append(int(value))
        elif kind == "bool":
            bools.append(int(bool(value)))
        else:
            return None
    plan = torch.classes.mixprec.HeldStep(family, tensors, lengths, optionals, floats, ints, bools, names)
    return HeldGroup(group, plan, list(all_params), state_dicts, tuple(names))


_STEP_FUNCTIONS: dict = {}


def checks_in_step(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` is FusedOptimizer.step itself (under torch's profiling wrapper)
    with no hooks around it, so a GradScaler may leave its inf check to the step
    (``_found_inf_pending``): nothing else runs between the check and the update."""
    from ._base import FusedOptimizer

    if "step" in optimizer.__dict__ or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    from torch.optim import optimizer as torch_optimizer

    if torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        return False
    step = type(optimizer).step
    ok = _STEP_FUNCTIONS.get(step)
    if ok is None:
        ok = _STEP_FUNCTIONS[step] = inspect.unwrap(step) is inspect.unwrap(FusedOptimizer.step)
    return ok
