"""Lean weights for the fused optimizers: bf16 params with 16-bit remainder masters
(``master_weights="remainder"``) and bf16 stochastic rounding (``rounding="stochastic"``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._ops import _ops
from ._rules import GroupRule, Rule

# master_weights: True keeps an fp32 master per fp16/bf16 param; "remainder" keeps only the low
# 16 bits of a bf16 param's fp32 master (the param holds the high half, rounded): 2 bytes, not 4.
MASTER_WEIGHTS = Rule(lambda x: (isinstance(x, (bool, int)) and x in (0, 1)) or (isinstance(x, str) and x == "remainder"),
                      "True, False or 'remainder'")
ROUNDING = Rule(lambda x: isinstance(x, str) and x in ("nearest", "stochastic"), "'nearest' or 'stochastic'")
SEED = Rule(lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63, "an int in [0, 2**63)")
RULES = {"master_weights": MASTER_WEIGHTS, "rounding": ROUNDING, "seed": SEED}
GROUP_RULES = (GroupRule(("master_weights", "rounding"), lambda mw, r: not (mw and r == "stochastic"),
                         "rounding='stochastic' only with master_weights=False: it rounds params kept without "
                         "masters (a master keeps the exact value)"),)
# Group options newer than some checkpoints: a group saved without them keeps this optimizer's.
LATER_OPTIONS = ("rounding", "seed")
REMAINDER = "master_remainder"
# The option as errors name it; the rule behind it (bfloat16 params only) is the library's
# master_remainder_check op, which the C++ front's master_remainder calls too (ops/front_rules.h).
REMAINDER_OPTION = "master_weights='remainder'"


def check_params(owner: str, group: dict, params: Any, where: str) -> None:
    """The dtypes the group's weight options need: bfloat16 params under master_weights='remainder';
    no float16 ones under rounding='stochastic' (it rounds to bfloat16; float32 stays exact)."""
    remainder = group.get("master_weights") == "remainder"
    stochastic = group.get("rounding") == "stochastic"
    if not (remainder or stochastic) or not isinstance(params, (list, tuple)):
        return  # the common case, on every step: no loop over the params
    if remainder:
        _ops.master_remainder_check(_dtypes_of(params), owner, REMAINDER_OPTION, f"{where} param {{}}", False)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            continue
        if stochastic and p.dtype == torch.float16:
            raise ValueError(f"{owner}: rounding='stochastic' rounds to bfloat16; {where} param {i} is float16")


_BF16 = torch.empty(0, dtype=torch.bfloat16, device="meta")


def _dtypes_of(params: Any) -> list[torch.Tensor]:
    """`params` as the rule op reads them, by dtype only: plain tensors as they are, a tensor
    subclass (a DTensor, whose dispatch knows no mixprec op) as an empty meta tensor of its dtype,
    and anything else (refused later, by torch) as a bfloat16 one, which keeps the indices."""
    return [p if type(p) in (torch.Tensor, torch.nn.Parameter)
            else torch.empty(0, dtype=p.dtype, device="meta") if isinstance(p, torch.Tensor) else _BF16
            for p in params]


def op_args(optimizer: Any, params: list[torch.Tensor], group: dict, state_dicts: Optional[list] = None) -> dict:
    """The op's weight arguments for `group`: one master per param (fp32, or an int16 remainder;
    an fp32 param is its own) or none, and the rounding. `state_dicts`: the params' state dicts
    when the caller already looked them up (the step cache), else each is looked up here."""
    if state_dicts is None:
        state_dicts = [optimizer.state[p] for p in params]
    masters, mode, pending = [], group["master_weights"], False
    if mode and mode != "remainder" and not any(REMAINDER in s for s in state_dicts):
        masters = [s.get("master_param", p) for s, p in zip(state_dicts, params)]  # the common case
    elif mode:
        for p, state in zip(params, state_dicts):
            if REMAINDER in state:
                masters.append(state[REMAINDER])
                pending |= mode != "remainder"
            else:
                master = state.get("master_param", p)
                masters.append(master)
                pending |= mode == "remainder" and master is not p
    if pending:  # a master in the other form (a checkpoint's, a switched option): settle() after the step
        optimizer._lean_pending = True
    return dict(master_params=masters, stochastic_rounding=group["rounding"] == "stochastic", seed=group["seed"])


def init_master(state: dict, p: torch.Tensor, group: dict) -> bool:
    """Makes a remainder master (zeros: the master is exactly the bf16 param) when the group keeps
    them; False when the group's masters are fp32 ones (or none)."""
    if group["master_weights"] != "remainder" or p.dtype != torch.bfloat16:
        return False
    state[REMAINDER] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
    return True


# The two forms of a master, for masters that change form outside a step (a loaded checkpoint, a
# switched option): the ops the C++ front calls too (ops/front_rules.h), bit for bit the kernels'
# split_master and rebuild_master.
def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 remainder) of an fp32 master: the weight is the nearest bf16, ties
    toward zero; the remainder the master's low 16 bits."""
    return _ops.master_split(master.detach())


def rebuild(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that (bf16 weight, int16 remainder) hold."""
    return _ops.master_rebuild(weight.detach(), remainder.detach())


@torch.no_grad()
def settle(optimizer: Any, stepped: list[tuple[dict, list[torch.Tensor]]]) -> None:
    """After a step, gives each master the form its group keeps: the op steps fp32 masters and
    remainders alike, so a checkpoint of either form (or a switched master_weights) resumes
    exactly, and here changes form once the params surely hold their weights. Only after
    op_args saw a master of the other form: an ordinary step pays nothing here."""
    if not getattr(optimizer, "_lean_pending", False):
        return
    optimizer._lean_pending = False
    for group, params in stepped:
        _settle_group(optimizer, group, params)


def _settle_group(optimizer: Any, group: dict, params: list[torch.Tensor]) -> None:
    mode = group["master_weights"]
    for p in params:
        state = optimizer.state[p]
        if mode == "remainder" and "master_param" in state and p.dtype == torch.bfloat16:
            weight, state[REMAINDER] = split(state.pop("master_param"))
            p.copy_(weight)
        elif mode and mode != "remainder" and REMAINDER in state:
            # The step wrote the weight as a remainder step does (ties toward zero); an fp32-master
            # step writes the master rounded to nearest even, and so must this one's result.
            state["master_param"] = master = rebuild(p, state.pop(REMAINDER))
            p.copy_(master)


def loaded_remainder(value: Any, p: torch.Tensor, where: str) -> torch.Tensor:
    """A checkpoint's remainder, checked and copied into the parameter's device and layout."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int16:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where} is {got}; expected an int16 tensor (the low halves of fp32 masters)")
    if value.shape != p.shape:
        raise ValueError(f"{where} has shape {tuple(value.shape)}; expected the parameter's {tuple(p.shape)}")
    _ops.master_remainder_check(_dtypes_of([p]), "", REMAINDER_OPTION, where, True)  # as C++'s load
    return torch.empty_like(p, dtype=torch.int16, device=p.device).copy_(value.detach())
