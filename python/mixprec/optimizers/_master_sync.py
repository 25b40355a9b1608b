"""Keeps masters in step with ``master_weights`` when it changes between steps: a group stepped
without its masters drops them (its params now hold the weights), and a master group's params
lacking one get it made from the param, as at their first step (the C++ front's ensure_state)."""

from __future__ import annotations

from itertools import repeat
from operator import contains

import torch

from ._lean import REMAINDER, init_master

MASTER_KEYS = ("master_param", REMAINDER)


def make_master(state: dict, p: torch.Tensor, group: dict) -> bool:
    """Gives `p` the master its group keeps (a remainder or an fp32 copy; none for fp32 params or
    a group without masters); True when one was made."""
    if init_master(state, p, group):
        return True
    if group["master_weights"] and p.dtype != torch.float32:
        # In the parameter's layout (channels_last stays channels_last): the op walks an entry's
        # tensors in one storage order.
        state["master_param"] = p.detach().clone(memory_format=torch.preserve_format).float()
        return True
    return False


def make_missing(group: dict, params: list, state_dicts: list) -> list[dict]:
    """Masters for the params of a master group that have state but none: master_weights switched
    on after steps without masters, or a param cast to fp16/bf16 after its state was made (else the
    op would be handed the low-precision param as its own master). Returns the state dicts given
    one, for the caller to undo if the step is refused."""
    key = REMAINDER if group["master_weights"] == "remainder" else "master_param"
    if all(map(contains, state_dicts, repeat(key))):  # the common case: one C-level pass
        return []
    made = []
    for p, state in zip(params, state_dicts):
        if state and not any(k in state for k in MASTER_KEYS) and make_master(state, p, group):
            made.append(state)
    return made


def undo_made(made: list[dict]) -> None:
    for state in made:
        for key in MASTER_KEYS:
            state.pop(key, None)


def drop_stale(groups: list[tuple[dict, list, list]]) -> None:
    """After a step: the masters of params that a group with master_weights off has just stepped are
    stale (the step updated the params alone); kept, they would bring the old weights back once
    master_weights is on again. `groups`: (group, stepped params, their state dicts)."""
    for group, _, state_dicts in groups:
        if group["master_weights"] or not any(any(map(contains, state_dicts, repeat(k))) for k in MASTER_KEYS):
            continue
        for state in state_dicts:
            for key in MASTER_KEYS:
                state.pop(key, None)
