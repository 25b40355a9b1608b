"""What a valid hyper-parameter or state value of a fused optimizer is, as data: each optimizer
class lists a rule per key and FusedOptimizer checks them all in one place, before any write."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.optim.optimizer import required


def _real(x: Any) -> bool:
    # bool is an int to Python, but `eps=True` is a mistake, not 1.0.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return _real(x) and math.isfinite(x)


@dataclass(frozen=True)
class Rule:
    """A check on one value, and the words the error uses for what it expected."""
    ok: Callable[[Any], bool]
    expected: str


def _lr_ok(x: Any) -> bool:
    if x is required:  # torch.optim's own add_param_group reports a missing lr
        return True
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or not x.is_floating_point() or x.device.type == "meta":
            return False
        # torch.optim refuses a NaN or negative tensor lr; on the CPU the value costs nothing to
        # read. On a GPU reading it would sync every step: the op reads it there as it is.
        if x.device.type != "cpu":
            return True
        value = x.item()
        return _finite(value) and value >= 0
    return _finite(x) and x >= 0


LR = Rule(_lr_ok, "a finite number >= 0, or a one-element floating-point tensor (not on the meta device) holding one")
NON_NEGATIVE = Rule(lambda x: _finite(x) and x >= 0, "a finite number >= 0")
FINITE = Rule(_finite, "a finite number")
# 0 and inf both turn LAMB's clipping off; NaN is never meant.
CLIP_NORM = Rule(lambda x: _real(x) and x >= 0, "a number >= 0 (0 or inf: no clipping)")
BETAS = Rule(lambda x: isinstance(x, (tuple, list)) and len(x) == 2 and all(_real(b) and 0.0 <= b < 1.0 for b in x),
             "a pair (beta1, beta2) of numbers in [0, 1)")


def pair(betas: Any) -> Any:
    """betas as a tuple when it is a sequence; anything else is left for BETAS to refuse."""
    return tuple(betas) if isinstance(betas, (list, tuple)) else betas


# FusedAdam's moments: float32, bfloat16 to halve their memory, or torch.int8 for 8-bit
# block-quantized ones (a quarter; see fused_adam.py). Identity, not ==: a dtype only.
STATE_DTYPE = Rule(lambda x: x is torch.float32 or x is torch.bfloat16 or x is torch.int8,
                   "torch.float32, torch.bfloat16 or torch.int8 (8-bit block-quantized moments)")

# int 0/1 too: Apex's own examples pass bias_correction=1.
FLAG = Rule(lambda x: isinstance(x, (bool, int)) and x in (0, 1), "True or False")
NOVOGRAD_NORM = Rule(lambda x: _real(x) and (x in (0, 2) or x == math.inf),
                     "2 (L2) or 0 (Apex's spelling of the infinity norm; inf also works)")


@dataclass(frozen=True)
class GroupRule:
    """A rule across several options of one group (e.g. SGD's nesterov needs momentum)."""
    keys: tuple[str, ...]
    ok: Callable[..., bool]
    expected: str


def check_group(owner: str, rules: dict, group_rules: tuple, group: dict, where: str) -> None:
    """Raises ValueError naming `owner`, `where`, the option and what it expects, for the first
    option of `group` that breaks its rule. Options the group lacks are not checked (a foreign
    checkpoint's groups get them filled in after loading)."""
    for key, rule in rules.items():
        if key in group and not rule.ok(group[key]):
            raise ValueError(f"{owner}: {where}: invalid {key} {group[key]!r}; expected {rule.expected}")
    for rule in group_rules:
        if all(k in group for k in rule.keys) and not rule.ok(*(group[k] for k in rule.keys)):
            got = ", ".join(f"{k}={group[k]!r}" for k in rule.keys)
            raise ValueError(f"{owner}: {where}: invalid combination {got}; expected {rule.expected}")


# -- state values, checked when a checkpoint is loaded (never per step) ------------------------

@dataclass(frozen=True)
class StateRule:
    """What one per-parameter state tensor must hold."""
    non_negative: bool = False  # a sum of squares (Adam's v, Adagrad's sum)


MOMENT = StateRule()
SQUARES = StateRule(non_negative=True)


def check_state_values(value: torch.Tensor, rule: StateRule, where: str) -> None:
    """Every element finite (and >= 0 for sums of squares): a NaN or negative moment would train
    to NaN silently, where the checkpoint, not the step, is what is broken."""
    v = value.detach()
    if v.numel() == 0:
        return
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{where} holds inf or NaN; expected finite values")
    if rule.non_negative and bool((v < 0).any()):
        raise ValueError(f"{where} holds negative values; expected values >= 0 (a sum of squares)")


def step_count(value: Any, where: str) -> torch.Tensor:
    """A saved step count (number or one-element tensor) as a float32 [1] CPU tensor, refused
    unless finite and >= 0."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{where} is a {value.dtype} tensor of {value.numel()} elements; expected one real step count")
        out = value.detach().to("cpu", torch.float32).reshape(1).clone()
    elif _real(value):
        out = torch.tensor([float(value)])
    else:
        raise ValueError(f"{where} is {type(value).__name__}; expected a step count (number or one-element tensor)")
    if not (math.isfinite(out.item()) and out.item() >= 0):
        raise ValueError(f"{where} is {out.item()}; expected a finite step count >= 0")
    return out
