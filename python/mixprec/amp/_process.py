"""How amp.initialize processes an optimizer in place: masters set up (Apex's swap into the
param groups, or a mixprec fused optimizer's own), and step / zero_grad / add_param_group (and a
fused optimizer's load_state_dict) patched as bound methods, so the object stays the user's
(isinstance holds)."""

from __future__ import annotations

import warnings
from types import MethodType
from typing import Any

import torch

from .._step_guard import StepGuard
from ..optimizers import FusedOptimizer
from ..optimizers import _lean
from ._grad_marks import clear_grads, stray_message
from ._optimizer import FUSED_MASTERS, PLAIN, SWAP, AmpStash
from ._properties import LOW_DTYPES
from ._scaler import _amp_state


def _patched_step(self, *args: Any, **kwargs: Any):
    stash: AmpStash = self._amp_stash
    self._opt_called = True  # what torch's LR schedulers' step wrapper records (see below)
    closure = args[0] if args else kwargs.get("closure")
    if closure is not None:
        raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
    if stash.poisoned:
        raise RuntimeError(stash.poisoned_message(f"{type(self).__name__}.step()"))
    moved = stash.moved_param()
    if moved is not None:
        raise RuntimeError(f"{type(self).__name__}.step(): {moved} (nothing was stepped)")
    # SWAP's masters get gradients only from scale_loss; FUSED_MASTERS steps a plain backward's
    # gradients as they are, but not ones mixed into a block's scaled ones.
    if stash.unfinished is None and (stash.kind == SWAP or stash.pending or stash.materialized):
        stray = stash.stray_gradient()
        if stray is not None:
            # The masters get gradients only from scale_loss's unscale: stepping would silently
            # ignore this backward (Apex's step did), or apply a GradScaler's scaled values.
            raise RuntimeError(f"{type(self).__name__}.step(): {stray_message(stray)}, so this step would ignore "
                               "it or mix it with scaled values (nothing was stepped). Call optimizer.zero_grad() and "
                               "backpropagate through amp.scale_loss")
    if stash.fused and ("grad_scale" in self.__dict__ or "found_inf" in self.__dict__) and _amp_scales_losses():
        # A GradScaler (torch's or mixprec's) handed this step its scale: the loss went through
        # both scalers, and one of the two scales would stay in the gradients.
        raise RuntimeError(f"{type(self).__name__}.step(): this optimizer went through amp.initialize, whose loss "
                           "scaling is on, and a GradScaler is stepping it too; use amp.scale_loss or a GradScaler, "
                           "not both (nothing was stepped)")
    block = stash.unfinished
    if block is not None:
        _warn_unfinished(block)
        block.complete()  # unscale, check and update the scale first: the step sees what it would after the block
    if _amp_state.deferred_updates:
        _amp_state.flush_deferred_updates()
    grad_scale = stash.prepare_step()
    found = stash.found
    if stash.fused and (found is not None or grad_scale is not None):
        self.grad_scale, self.found_inf = grad_scale, found
        try:
            retval = stash.orig_step(*args, **kwargs)
        finally:
            del self.grad_scale
            del self.found_inf
    elif found is not None and found.device.type == "cpu":
        # Host memory: reading found_inf waits for nothing, while the device-side undo would
        # snapshot and select every param and state tensor. A skipped step runs no step().
        retval = stash.orig_step(*args, **kwargs) if not found.item() else None
    elif found is not None:
        StepGuard.make_capturable(self)
        retval = stash.guard.step(self, found, stash.orig_step, *args, **kwargs)
    else:
        retval = stash.orig_step(*args, **kwargs)
    stash.after_step()
    return retval


# torch's LR schedulers wrap optimizer.step to learn that it ran, and warn that "optimizer.step()
# has been overridden" when they find a step without their mark: a scheduler made before
# amp.initialize warned on every run. amp's step records the call itself and carries the mark.
_patched_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

_warned: set = set()


def _warn_unfinished(block) -> None:
    kind = "open" if block.active else "delayed"
    if kind in _warned:
        return
    _warned.add(kind)
    if kind == "open":
        msg = ("optimizer.step() was called inside `with amp.scale_loss(...)`: mixprec unscaled and checked the "
               "gradients first, so this step is the one a step() after the block would make. The usual "
               "placement is after the with block.")
    else:
        msg = ("optimizer.step() followed scale_loss(..., delay_unscale=True) blocks that no block with "
               "delay_unscale=False closed: mixprec unscaled and checked the accumulated gradients first. Pass "
               "delay_unscale=False on the last micro-batch before step().")
    warnings.warn(msg, UserWarning, stacklevel=3)


def _amp_scales_losses() -> bool:
    return any(s.dynamic or s.state.init_scale != 1.0 for s in _amp_state.loss_scalers)


def _patched_zero_grad(self, *args: Any, **kwargs: Any):
    stash: AmpStash = self._amp_stash
    retval = stash.orig_zero_grad(*args, **kwargs)
    set_to_none = kwargs.get("set_to_none", args[0] if args else None)
    set_to_none = True if set_to_none is None else bool(set_to_none)
    if set_to_none:
        clear_grads(stash.low_params)
    else:
        for p in stash.low_params:
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
    if stash.kind == SWAP:
        clear_grads(stash.low_masters)
    elif stash.kind == FUSED_MASTERS:
        clear_grads([m for _, m in stash.low_pairs()])
    if stash.stashed:
        stash.stashed.clear()
    stash.poisoned = None
    stash.params_have_scaled_gradients = False
    stash.unfinished = None
    stash.pending = stash.materialized = False
    stash.grad_scale = stash.wb_scale = None
    stash.contributions = 0
    if stash.kind != SWAP or not set_to_none:  # (SWAP's watched gradients were set to None above)
        stash.note_grads()  # (a fused optimizer's zero_grad may zero them in place: Apex's set_grad_none)
    return retval


def _make_master(p: torch.Tensor, originals: dict) -> torch.Tensor:
    original = originals.get(p)
    master = original if original is not None else p.detach().clone().float()
    return master.detach().requires_grad_(True)


def _patched_add_param_group(self, param_group: dict):
    stash: AmpStash = self._amp_stash
    call = f"{type(self).__name__}.add_param_group"
    if not isinstance(param_group, dict):
        raise TypeError("param group must be a dict")
    if "params" not in param_group:
        raise KeyError(f"{call}: param_group has no 'params'; expected a dict with the parameters under 'params'")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                        "of tensors in sets will change between runs. Please use a list instead.")
    else:
        params = list(params)
    if stash.kind == FUSED_MASTERS and not param_group.get("master_weights", True):
        # O2 keeps fp32 masters for every group (amp set master_weights on all of them); a group
        # stepping its fp16 params directly would leave amp.master_params and checkpoints stale.
        raise ValueError(f"{call}: param group {len(self.param_groups)}: "
                         f"invalid master_weights {param_group['master_weights']!r}; expected True under "
                         "amp's O2, which keeps fp32 masters for every param group")
    if stash.kind != SWAP:
        param_group["params"] = params
        retval = stash.orig_add_param_group(param_group)
        if stash.kind == FUSED_MASTERS:
            _init_fused_masters(self, self.param_groups[-1], {})
        return retval
    # SWAP: the groups hold masters, so torch's own duplicate check cannot see a model param given
    # again; each would get a second master and the two would overwrite each other's updates.
    taken = {id(p) for p in stash.low_params}
    taken.update(id(p) for group in self.param_groups for p in group["params"])
    low, masters = [], []
    for i, p in enumerate(params):
        if id(p) in taken:
            raise ValueError(f"{call}: params[{i}] is already optimized by this optimizer (amp's O2 keeps its fp32 "
                             "master in the param groups); some parameters appear in more than one parameter group")
        taken.add(id(p))
        if isinstance(p, torch.Tensor) and p.requires_grad and p.dtype in LOW_DTYPES:
            low.append((i, p))
    swapped = list(params)
    for i, p in low:
        swapped[i] = _make_master(p, {})
        masters.append(swapped[i])
    param_group["params"] = swapped
    try:
        retval = stash.orig_add_param_group(param_group)
    except BaseException:
        param_group["params"] = params  # refused: the caller's group and amp's stash are as they were
        raise
    stash.low_params.extend(p for _, p in low)
    stash.low_masters.extend(masters)
    stash.master_ids.update(id(m) for m in masters)
    return retval


def _patched_load_state_dict(self, state_dict: dict):
    """O2 with a fused optimizer: a checkpoint saved without masters (at O0, O1 or O3, or by an
    optimizer that never went through amp) loads with master_weights=False in its groups, which
    would step the fp16 params directly; amp keeps its masters on, started from the model's
    values as Apex's were."""
    stash: AmpStash = self._amp_stash
    retval = stash.orig_load_state_dict(state_dict)
    if not all(group["master_weights"] for group in self.param_groups):
        self.master_weights = True
        for group in self.param_groups:
            _init_fused_masters(self, group, {})
    return retval


def _init_fused_masters(optimizer: FusedOptimizer, group: dict, originals: dict) -> None:
    # State that was there before (a checkpoint loaded before amp.initialize) gets new tensors, never
    # writes into its own: amp.initialize takes back a failed call by putting the old ones back.
    for p in group["params"]:
        if p.dtype == torch.float32:
            continue
        state = optimizer.state[p]
        fresh = not state
        if fresh:
            optimizer._init_param_state(p, group)
        if _lean.REMAINDER in state:
            if p in originals:  # the fp32 value from before the cast is the master: split it
                weight, remainder = _lean.split(originals[p])
                with torch.no_grad():
                    p.copy_(weight)  # the cast's new tensor, not the param's old one
                _write_state(state, _lean.REMAINDER, remainder, fresh)
            continue
        if "master_param" not in state:
            fresh = True
            state["master_param"] = p.detach().clone(memory_format=torch.preserve_format).float()
        if p in originals:
            _write_state(state, "master_param", originals[p], fresh)


def _write_state(state: dict, key: str, value: torch.Tensor, fresh: bool) -> None:
    target = state[key] if fresh else torch.empty_like(state[key])
    target.copy_(value)
    state[key] = target


def process_optimizer(optimizer: torch.optim.Optimizer, master_weights: bool | str,
                      originals: dict) -> torch.optim.Optimizer:
    """Sets up ``optimizer`` for amp in place (same object: isinstance holds) and returns it.
    ``originals`` maps cast params to their fp32 values from before the cast (the masters).
    ``master_weights="remainder"``: a fused optimizer keeps its masters as remainders."""
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    if master_weights and isinstance(optimizer, FusedOptimizer):
        kind = FUSED_MASTERS
    elif master_weights:
        kind = SWAP
    else:
        kind = PLAIN
    stash = AmpStash(optimizer, kind)
    if kind == SWAP:
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p.requires_grad and p.dtype in LOW_DTYPES:
                    master = _make_master(p, originals)
                    group["params"][i] = master
                    if p in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(p)
                    stash.low_params.append(p)
                    stash.low_masters.append(master)
                    stash.master_ids.add(id(master))
        if optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # recast existing state to fp32 (Apex)
    elif kind == FUSED_MASTERS:
        if master_weights == "remainder":  # every param bf16 (BatchNorm kept fp32 is refused here)
            for i, group in enumerate(optimizer.param_groups):
                _lean.check_params(type(optimizer).__name__, dict(group, master_weights="remainder"),
                                   group["params"], f"param group {i}")
        optimizer.master_weights = master_weights
        for group in optimizer.param_groups:
            _init_fused_masters(optimizer, group, originals)
    stash.note_grads()  # gradients from before initialize are dropped by the first block, as in Apex
    optimizer._amp_stash = stash
    stash.orig_step = optimizer.step
    stash.orig_zero_grad = optimizer.zero_grad
    stash.orig_add_param_group = optimizer.add_param_group
    if kind == FUSED_MASTERS:
        stash.orig_load_state_dict = optimizer.load_state_dict
        optimizer.load_state_dict = MethodType(_patched_load_state_dict, optimizer)
    # Bound methods (not closures), so that torch's LR schedulers can wrap step() as usual.
    optimizer.step = MethodType(_patched_step, optimizer)
    optimizer.zero_grad = MethodType(_patched_zero_grad, optimizer)
    optimizer.add_param_group = MethodType(_patched_add_param_group, optimizer)
    return optimizer
