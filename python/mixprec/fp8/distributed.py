"""Ranks agree on FP8 scales: the amaxes the FP8 Linears measure are all-reduced with MAX over a
process group before they become scales, on the device (stream-ordered collectives, no .item())."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

#: Rows of the state by direction: the forward's casts (input, weight) and the backward's (grad).
FORWARD, BACKWARD = (0, 1), (2,)


def group_of(recipe) -> Optional[object]:
    """The process group whose ranks must agree on ``recipe``'s scales, or None: the recipe's own
    group, else the default group when torch.distributed runs more than one rank."""
    if recipe.process_group is not None:
        return recipe.process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def all_reduce_max_(amax: torch.Tensor, group) -> None:
    """``amax`` (float32, on the device) becomes the max over the group's ranks. NaN turns into inf
    first: a collective's MAX may drop a NaN (it compares), while inf survives it, and an inf amax
    both keeps the previous scale and makes the GEMM's output NaN on every rank (docs/fp8.md)."""
    amax.masked_fill_(amax.isnan(), math.inf)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


class _DelayedReducer:
    """Delayed scaling's batched reduction for one process group. Each cast records its amax as
    pending (the next update turns it into a scale); all pending amaxes of a direction are
    all-reduced in one collective, flattened into one buffer, when the first of them is about to
    be used: so one collective per forward and one per backward, whatever the number of layers.
    The rows are in the order their casts ran, the same on every rank running the same model."""

    def __init__(self, group) -> None:
        self.group = group
        self.pending: dict[tuple[int, ...], list] = {FORWARD: [], BACKWARD: []}
        self.marked: dict[tuple[int, ...], set] = {FORWARD: set(), BACKWARD: set()}

    def before_update(self, state, role: int) -> None:
        """Reduces this direction's pending amaxes if ``state``'s row is among them."""
        direction = BACKWARD if role in BACKWARD else FORWARD
        if (id(state), role) not in self.marked[direction]:
            return
        rows = [s.amax[r:r + 1] for s, r in self.pending[direction]]
        self.pending[direction], self.marked[direction] = [], set()
        buffer = torch.cat(rows)
        all_reduce_max_(buffer, self.group)
        torch._foreach_copy_(rows, list(buffer.split(1)))

    def after_cast(self, state, role: int) -> None:
        direction = BACKWARD if role in BACKWARD else FORWARD
        key = (id(state), role)
        if key not in self.marked[direction]:
            self.marked[direction].add(key)
            self.pending[direction].append((state, role))


_REDUCERS: dict[int, _DelayedReducer] = {}


def delayed_reducer(group) -> _DelayedReducer:
    """The one reducer of ``group`` (every FP8 layer reducing over it shares its collectives)."""
    reducer = _REDUCERS.get(id(group))
    if reducer is None or reducer.group is not group:
        reducer = _REDUCERS[id(group)] = _DelayedReducer(group)
    return reducer
