"""Argument and checkpoint validation for mixprec.GradScaler: every check runs before anything
changes, and each error names the call, the argument and what is expected."""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter
from typing import Any, Optional

import torch

from . import _ops
from . import distributed as _dist
from ._loss_scale import (F32_MAX, INT32_MAX, ScaleState, _check_number, check_scale, combine_found,
                          flag_unusable_scale_, validate_extra_state)

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class GradScalerAssertionError(ValueError, AssertionError):
    """A bad argument where torch.amp.GradScaler raises AssertionError (growth and backoff factors,
    update's new_scale): a ValueError like mixprec's other argument errors, and still caught by code
    written against torch's scaler."""


def check_growth_factor(name: str, value: Any, error: type = GradScalerAssertionError) -> float:
    return _check_number(name, value, lo=1.0, lo_open=True, hi=F32_MAX, error=error)


def check_backoff_factor(name: str, value: Any, error: type = GradScalerAssertionError) -> float:
    # 0 would zero the scale on the first overflow; >= 1 would never back off.
    return _check_number(name, value, lo=0.0, lo_open=True, hi=1.0, hi_open=True, error=error)


def check_growth_interval(name: str, value: Any) -> int:
    # torch accepts 0 (its tracker then never reaches the interval: no growth); negative is nonsense.
    return _check_number(name, value, integer=True, lo=0, hi=INT32_MAX)


def check_bounds(where: str, scale: float, min_scale: Optional[float], max_scale: Optional[float],
                 scale_name: str) -> None:
    """min_scale <= scale <= max_scale (each bound optional)."""
    if min_scale is not None and max_scale is not None and max_scale < min_scale:
        raise ValueError(f"{where}: max_scale must be >= min_scale, got max_scale={max_scale!r} < "
                         f"min_scale={min_scale!r}")
    if min_scale is not None and scale < min_scale:
        raise ValueError(f"{where}: {scale_name} must be >= min_scale={min_scale!r}, got {scale!r}")
    if max_scale is not None and scale > max_scale:
        raise ValueError(f"{where}: {scale_name} must be <= max_scale={max_scale!r}, got {scale!r}")


def check_constructor(init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
                      hysteresis: Any, min_scale: Any, max_scale: Any, history_size: Any) -> dict[str, Any]:
    """GradScaler's arguments, converted to Python numbers (numpy scalars and 0-dim tensors in)."""
    w = "GradScaler"
    out = {
        "init_scale": check_scale(f"{w}: init_scale", init_scale),
        "growth_factor": check_growth_factor(f"{w}: growth_factor", growth_factor),
        "backoff_factor": check_backoff_factor(f"{w}: backoff_factor", backoff_factor),
        "growth_interval": check_growth_interval(f"{w}: growth_interval", growth_interval),
        "hysteresis": _check_number(f"{w}: hysteresis", hysteresis, integer=True, lo=1, hi=INT32_MAX),
        "min_scale": None if min_scale is None else _check_number(f"{w}: min_scale", min_scale, lo=0, hi=F32_MAX),
        "max_scale": None if max_scale is None else check_scale(f"{w}: max_scale", max_scale),
        "history_size": _check_number(f"{w}: history_size", history_size, integer=True, lo=0, hi=INT32_MAX),
    }
    check_bounds(w, out["init_scale"], out["min_scale"], out["max_scale"], "init_scale")
    return out


def check_new_scale(new_scale: Any, device_type: str, state: ScaleState) -> Any:
    """update's new_scale: a Python/numpy number (torch takes floats only; ints are accepted too) or,
    as torch requires, a 0-dim tensor on the scaler's device type with requires_grad=False. Its value
    is checked like init_scale (a tensor's value is read: one sync on a GPU)."""
    where = "GradScaler.update: new_scale"
    if isinstance(new_scale, torch.Tensor):
        expected = (f"a float, an int or a 0-dim tensor on {device_type} with requires_grad=False (torch.amp's "
                    f"rule: a float or a 1-element tensor that fills the scale)")
        if new_scale.device.type != device_type or new_scale.dim() != 0 or new_scale.requires_grad:
            raise GradScalerAssertionError(
                f"{where} must be {expected}; got a tensor of shape {list(new_scale.shape)} on {new_scale.device}"
                f"{' with requires_grad=True' if new_scale.requires_grad else ''}")
        value = check_scale(where, new_scale.detach(), error=GradScalerAssertionError)
    else:
        value = check_scale(where, new_scale, error=GradScalerAssertionError)
    check_bounds("GradScaler.update", value, state.min_scale, state.max_scale, "new_scale")
    return new_scale if isinstance(new_scale, torch.Tensor) else value


def check_state_dict(state_dict: Any, state: ScaleState) -> dict[str, Any]:
    """Every value of a checkpoint of this class or of torch.amp.GradScaler, converted; raises before
    anything is written. mixprec's own keys are optional (torch's checkpoints lack them)."""
    where = "GradScaler.load_state_dict: state_dict"
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(state_dict).__name__}")
    missing = [k for k in TORCH_KEYS if k not in state_dict]
    if missing:
        raise KeyError(f"{where} has no {', '.join(map(repr, missing))} (torch.amp.GradScaler's keys: "
                       f"{', '.join(TORCH_KEYS)})")
    out = {
        "scale": check_scale(f"{where}['scale']", state_dict["scale"]),
        "growth_factor": check_growth_factor(f"{where}['growth_factor']", state_dict["growth_factor"], ValueError),
        "backoff_factor": check_backoff_factor(f"{where}['backoff_factor']", state_dict["backoff_factor"], ValueError),
        "growth_interval": check_growth_interval(f"{where}['growth_interval']", state_dict["growth_interval"]),
        "_growth_tracker": _check_number(f"{where}['_growth_tracker']", state_dict["_growth_tracker"], integer=True,
                                         lo=0, hi=INT32_MAX),
    }
    extra = validate_extra_state(state_dict, where)
    out["hysteresis"] = extra.get("hysteresis", state.hysteresis)
    out["min_scale"] = extra.get("min_scale", state.min_scale)
    out["max_scale"] = extra.get("max_scale", state.max_scale)
    # A torch checkpoint carries no hysteresis tracker: a fresh one (hysteresis overflows tolerated).
    out["_hysteresis_tracker"] = extra.get("_hysteresis_tracker", out["hysteresis"])
    out["_skipped_steps"] = extra.get("_skipped_steps")
    if out["_hysteresis_tracker"] > out["hysteresis"]:
        raise ValueError(f"{where}['_hysteresis_tracker'] must be <= hysteresis={out['hysteresis']}, "
                         f"got {out['_hysteresis_tracker']}")
    check_bounds(where, out["scale"], out["min_scale"], out["max_scale"], "scale")
    return out


def check_optimizer(where: str, optimizer: Any) -> None:
    # Duck-typed as torch's scaler does; only what it reads is required.
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer (param_groups and step()), "
                        f"got {type(optimizer).__name__}")
    if getattr(optimizer, "_amp_stash", None) is not None:
        from .amp._process import _amp_scales_losses  # amp imports this module's package: import late

        if _amp_scales_losses():
            # Its gradients come from amp.scale_loss (O2's masters get theirs only there): a GradScaler
            # on top would scale the loss twice, or find no gradients to check.
            raise RuntimeError(f"{where}: {type(optimizer).__name__} went through amp.initialize, whose loss "
                               "scaling is on: scale its loss with amp.scale_loss and call optimizer.step(); "
                               "use amp.scale_loss or a GradScaler, not both (nothing was changed)")


def fp16_unscale_error(optimizer: torch.optim.Optimizer, group: int, index: int) -> ValueError:
    """torch's refusal of float16 gradients in unscale_, saying why and what to do instead."""
    name = type(optimizer).__name__
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        how = (f"{name} divides the gradients by the scale in float32 inside its kernel: call scaler.step(optimizer) "
               f"without unscale_ (with master_weights=True the fp32 masters get the exact update); to clip, "
               f"scale the still-scaled gradients by min(1, max_norm * scale / norm) instead, as "
               f"GradScaler.unscale_'s docstring shows")
    else:
        how = ("keep float32 gradients (float32 parameters), or use a mixprec fused optimizer with "
               "master_weights=True, which unscales float16 gradients in float32 inside its kernel")
    return ValueError(f"GradScaler.unscale_: Attempting to unscale FP16 gradients. {name} param group {group} "
                      f"param {index} has a float16 gradient; dividing it by the scale in place would flush its "
                      f"small values to zero. Instead, {how}.")


_GRAD, _LAYOUT, _DTYPE = attrgetter("grad"), attrgetter("layout"), attrgetter("dtype")
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def regular_grads(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> Optional[list[torch.Tensor]]:
    """Every gradient of ``optimizer`` when each param has one, dense, a plain tensor (no DTensor
    shard to take) and, unless ``allow_fp16``, not float16: the common case, found by C-level passes
    over the lists (a Python loop over 292 grads costs more than the check kernel's launch). None
    otherwise: GradScaler's per-param path then skips missing grads, coalesces sparse ones and
    refuses float16 with the param's index, as ever."""
    grads: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        grads += map(_GRAD, group["params"])
    try:
        layouts = list(map(_LAYOUT, grads))
    except AttributeError:  # a param without a grad
        return None
    if layouts.count(torch.strided) != len(grads) or not _PLAIN_TYPES.issuperset(map(type, grads)):
        return None
    if not allow_fp16 and torch.float16 in set(map(_DTYPE, grads)):
        return None
    return grads


def flag_unusable_scale(per_device: dict[torch.device, torch.Tensor], scale: torch.Tensor,
                        inv_scale: Optional[torch.Tensor] = None) -> None:
    """``flag_unusable_scale_`` in a few launches where found_inf lives on the scale's one device
    (nine small kernels there, each a few microseconds of host time on every step): the float32
    reciprocal is finite and > 0 exactly when its logarithm is finite, which the check op flags."""
    if len(per_device) == 1:
        (device, found), = per_device.items()
        if device == scale.device:
            inv = scale.double().reciprocal().float() if inv_scale is None else inv_scale
            _ops.non_finite_check_and_unscale_([inv.log().reshape(1)], found)
            return
    flag_unusable_scale_(per_device, scale)


def step_checks_inf(optimizer: Any, args: tuple, kwargs: dict, process_group: Any) -> bool:
    """Whether ``optimizer.step()`` can make a GradScaler's inf check itself (in the same C++
    call as its update: optimizers/_held.py): a mixprec FusedOptimizer's own step, unpatched and
    without hooks, called with no arguments, no preset grad_scale, and no found_inf to agree on
    across ranks (that needs a collective between the check and the update)."""
    check = getattr(optimizer, "_held_check_in_step", None)
    return (check is not None and not args and not kwargs and getattr(optimizer, "grad_scale", None) is None
            and _dist.reduction_group(process_group) is None and check())


def found_for_step(per_device: dict, scale: torch.Tensor) -> torch.Tensor:
    """The found_inf handed to a fused optimizer: this iteration's checks combined."""
    if not per_device:  # no gradient at all (an idle or frozen sub-model): torch steps with found_inf 0
        return torch.zeros((), dtype=torch.float32, device=scale.device)
    found = combine_found(per_device.values(), scale.device)
    if any(found is f for f in per_device.values()):
        found = found.clone()  # the optimizer's own, as torch's sum is: update() reads ours
    return found
