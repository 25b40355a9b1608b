"""Ranks agree on FP8 scales: the amaxes the FP8 Linears measure are all-reduced with MAX over a
process group before they become scales, on the device (stream-ordered collectives, no .item()).
Current scaling reduces inside the op (csrc/ops/fp8_linear.cpp: one collective per call and
direction, the input's and the weight's amaxes together); delayed scaling batches every layer's
pending amaxes here, one collective per step."""

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
    """Delayed scaling's batched reduction for one process group: one collective per training step,
    whatever the number of layers. Each cast's amax is pending from the cast that records it until
    an update turns it into a scale, which is the next call's (the next forward for the input and
    the weight, the next backward for the output gradient). When a layer is about to consume a
    pending row, every pending row of every layer (both directions) is all-reduced in one flattened
    buffer. In a training loop that is the first FP8 layer of each forward: the previous step's
    forward and backward rows go together, and the backward then finds its rows reduced. The rows
    are in the order their casts ran, the same on every rank running the same model."""

    def __init__(self, group) -> None:
        self.group = group
        self.pending: list = []
        self.marked: set = set()

    def _reduce_if_pending(self, state, roles) -> None:
        if not any((id(state), r) in self.marked for r in roles):
            return
        rows = [s.amax[r:r + 1] for s, r in self.pending]
        self.pending, self.marked = [], set()
        buffer = torch.cat(rows)
        all_reduce_max_(buffer, self.group)
        torch._foreach_copy_(rows, list(buffer.split(1)))

    def _mark(self, state, roles) -> None:
        for role in roles:
            key = (id(state), role)
            if key not in self.marked:
                self.marked.add(key)
                self.pending.append((state, role))

    def before_forward(self, state) -> None:
        """Before the op casts ``state``'s input and weight rows."""
        self._reduce_if_pending(state, FORWARD)

    def after_forward(self, state, y: torch.Tensor) -> None:
        """After the op cast them; the output gradient's cast (in the op's backward, C++) gets the
        same treatment from a hook on ``y``, which runs just before that backward."""
        self._mark(state, FORWARD)
        if y.requires_grad:
            def before_backward(grad):
                self._reduce_if_pending(state, BACKWARD)
                self._mark(state, BACKWARD)  # the cast runs next, before any other update can
            y.register_hook(before_backward)


_REDUCERS: dict[int, _DelayedReducer] = {}


def delayed_reducer(group) -> _DelayedReducer:
    """The one reducer of ``group`` (every FP8 layer reducing over it shares its collectives)."""
    reducer = _REDUCERS.get(id(group))
    if reducer is None or reducer.group is not group:
        reducer = _REDUCERS[id(group)] = _DelayedReducer(group)
    return reducer
