"""The base of mixprec's fused optimizers: torch.optim behaviour plus device step counts, fp32
master weights, in-kernel loss scaling for GradScalers, and complete checkpoints (validated on load:
_loading.py)."""

from __future__ import annotations

from types import MethodType
from typing import Any, Iterable, Optional

import torch

from . import _held, _lean, _master_sync
from ._loading import CheckpointLoading
from ._rules import LR, check_group
from ._step_cache import HyperCache, StepLists, checked_params, gather, regular_params, step_scalars
from ._step_cache import device_scalar as _device_scalar  # noqa: F401  (FusedLAMB imports it from here)

_APEX_LEGACY_STEP_ARGS = ("grads", "output_params", "scale", "grad_norms", "grad_scaler")


class GroupOption:
    """An optimizer attribute that is really a per-group option (``master_weights``, FusedAdam's
    ``state_dtype``), so code written when it was per optimizer keeps working. Reading gives the
    groups' value when they all agree, else the constructor's (``defaults``, what groups added
    later get); each group's own is ``param_groups[i][name]``. Writing validates the value, then
    sets it in the defaults and in every group (the C++ front's ``set_master_weights``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = name

    def __get__(self, opt: Any, owner: Optional[type] = None) -> Any:
        if opt is None:
            return self
        values = [g[self.key] for g in opt.param_groups]
        if values and all(v == values[0] for v in values):
            return values[0]
        return opt.defaults[self.key]

    def __set__(self, opt: Any, value: Any) -> None:
        # Refused, naming the group, where the value breaks a rule with the group's other options
        # (master_weights=True beside rounding='stochastic') or its params' dtypes ('remainder'
        # on float16 params): accepted, every later step would refuse it. Nothing changes then.
        name, key = type(opt).__name__, self.key
        opt._check_group({key: value}, f"setting {key}")
        rules = tuple(r for r in opt._all_group_rules() if key in r.keys)
        for i, group in enumerate(opt.param_groups):
            changed = dict(group, **{key: value})
            check_group(name, {}, rules, changed, f"setting {key}: param group {i}")
            _lean.check_params(name, changed, group["params"], f"setting {key}: param group {i}")
        opt.defaults[key] = value
        for group in opt.param_groups:
            group[self.key] = value


class FusedOptimizer(CheckpointLoading, torch.optim.Optimizer):
    """torch.optim.Optimizer whose step is one mixprec op per param group.

    What subclasses share:
    - ``group["step"]`` is a one-element float32 tensor on the group's device, incremented by the
      op itself unless the step is skipped, so nothing waits on the host;
    - ``master_weights`` is a group option (the constructor's value is the default, a group may
      name its own, as the C++ front's options do): in a group with ``master_weights=True`` every
      fp16/bf16 parameter has an fp32 master in ``state[p]["master_param"]``; the op updates it
      and writes the rounded copy to the model. ``optimizer.master_weights`` reads and sets it
      for all groups (see GroupOption). Switched off, a group's masters are dropped at its next
      step (the params alone are updated, so the masters go stale); switched on, or for a param
      cast to fp16/bf16 after its state was made, masters are made from the params (_master_sync);
    - ``_step_supports_amp_scaling``: torch.amp.GradScaler and mixprec.GradScaler hand the loss
      scale and found_inf to ``step()`` (as ``self.grad_scale``/``self.found_inf``); the kernel
      unscales and skips on the device, and leaves each ``p.grad`` unscaled (untouched by a
      skipped step), as torch's fused optimizers do;
    - ``state_dict()`` holds everything (moments, master weights, step counts) and loads with
      ``torch.load(weights_only=True)``; ``load_state_dict`` validates before changing anything and
      keeps state dtypes (torch's loader would cast fp32 state to the parameter's fp16);
    - DTensor parameters (FSDP2's ``fully_shard``) get DTensor state and masters sharded like
      them, and the op steps each rank's local shards; steps that need norms of whole tensors
      (LAMB, NovoGrad) have the ops reduce the shards' norms across ranks.

    Subclasses declare their rules as data (see ``_rules.py``): ``_hyper_rules`` (option -> Rule)
    and ``_group_rules`` for the options, ``_state_rules`` (per-parameter state tensors shaped
    like the parameter, besides ``master_param``, -> StateRule), ``_required_state`` (keys every
    non-empty state has) and ``_state_dtypes`` (state dtypes kept on load; other float dtypes
    become float32 unless ``_convert_foreign_state`` is False); and implement ``_init_state(p, group)`` and ``_step_group(...)``.
    Copies (``copy.deepcopy``, pickle, ``torch.save(optimizer)``) keep every public attribute.
    """

    _step_supports_amp_scaling = True
    _hyper_rules: dict = {"lr": LR}
    # Group options every family has, checked with the family's _hyper_rules (see __init_subclass__).
    # (master_weights: True, False or "remainder"; rounding and seed: see _lean.py.)
    _base_rules: dict = dict(_lean.RULES)
    master_weights = GroupOption()
    _group_rules: tuple = ()
    _state_rules: dict = {}
    _required_state: tuple[str, ...] = ()
    _state_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    # Whether state of other float dtypes (torch's and Apex's, in the param's dtype) loads as
    # float32; False refuses it.
    _convert_foreign_state = True
    _scalar_state_keys: tuple[str, ...] = ()
    # Group options that checkpoints of the classes a subclass can load (torch.optim's, Apex's)
    # do not have; the subclass fills them in after loading. Any other missing option is an error.
    _keys_foreign_checkpoints_lack: tuple[str, ...] = ()
    # Group options that were optimizer attributes before they became per group: checkpoints and
    # pickles made then lack them in their groups, which take this optimizer's value instead.
    _group_attributes: tuple[str, ...] = ("master_weights",)
    _rules: dict = {**_hyper_rules, **_base_rules}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._rules = {**cls._hyper_rules, **cls._base_rules}  # merged once, not on every step

    def __init__(self, params: Iterable[Any], defaults: dict, *, master_weights: bool = False,
                 set_grad_none: bool = True, capturable: bool = False, rounding: str = "nearest", seed: int = 0):
        defaults = dict(defaults, master_weights=master_weights, rounding=rounding, seed=seed)
        self._check_group(defaults, "defaults")
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)
        # Kept for Apex compatibility: mixprec's steps never sync with the host, so every step is
        # graph-capturable once lr and step live on the device.
        self.capturable = bool(capturable)
        self._reset_caches()

    # -- torch.optim surface ----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        # Checked before torch appends it, so a bad group is never added.
        where = f"param group {len(self.param_groups)}"
        full = dict(self.defaults, **{k: v for k, v in param_group.items() if k != "params"})
        self._check_group(full, where)
        params = param_group.get("params")
        _lean.check_params(type(self).__name__, full, params, where)
        if isinstance(params, (list, tuple)):
            # torch only warns here; a parameter stepped twice per step() is silently wrong.
            seen: dict[int, int] = {}
            for i, p in enumerate(params):
                if id(p) in seen:
                    raise ValueError(f"{type(self).__name__}.add_param_group: {where}: params[{i}] is params"
                                     f"[{seen[id(p)]}] again; expected each parameter once")
                seen[id(p)] = i
        super().add_param_group(param_group)

    def _all_group_rules(self) -> tuple:
        """The family's cross-option rules and the weight options' (master_weights, rounding)."""
        return self._group_rules + _lean.GROUP_RULES

    def _check_group(self, group: dict, where: str) -> None:
        """Raises ValueError for the first option of `group` that breaks the class's rules."""
        check_group(type(self).__name__, self._rules, self._all_group_rules(), group, where)

    # -- copies: torch.optim.Optimizer pickles only defaults, state and param_groups ------------
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # Every public attribute (master_weights, set_grad_none, state_dtype, ...): without them a
        # copy cannot step. Private ones are caches, rebuilt by _reset_caches.
        # Methods bound to this instance (amp.initialize patches step/zero_grad) stay behind, as
        # torch's copies leave them: a copy is a plain optimizer.
        state.update({k: v for k, v in self.__dict__.items()
                      if not k.startswith("_") and k not in state and not isinstance(v, MethodType)})
        return state

    def __setstate__(self, state: dict) -> None:
        # Pickles from before an option became per group hold it as an attribute.
        state = dict(state)
        legacy = {k: state.pop(k) for k in self._group_attributes if k in state}
        super().__setstate__(state)
        for key, value in legacy.items():
            self.defaults.setdefault(key, value)
            for group in self.param_groups:
                group.setdefault(key, value)
        self._reset_caches()

    def _reset_caches(self) -> None:
        """(Re)creates per-instance caches (subclasses): at construction and in a copy."""

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None, **legacy):
        bad = [k for k in legacy if k in _APEX_LEGACY_STEP_ARGS]
        if legacy:
            raise TypeError(
                f"{type(self).__name__}.step() got unexpected arguments {sorted(legacy)}"
                + (". Apex's old step(grads=..., scale=...) API is gone: initialize the optimizer like "
                   "torch.optim's and call step() with no arguments" if bad else "")
            )
        pending = self.__dict__.pop("_found_inf_pending", None)  # see _held.try_step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        hyper, lists = self._step_caches()
        try:
            stepped, found_inf = _held.try_step(self, hyper, grad_scale, found_inf, pending)
            if stepped:
                return loss
            self._begin_step(None, grad_scale)
            plan = []
            for index, group in enumerate(self.param_groups):  # every group is checked before any steps
                hyper.check(type(self).__name__, self._rules, self._all_group_rules(), group, index)
                regular = regular_params(group["params"])
                if regular is not None:
                    params, _, device = regular
                else:
                    params, device = checked_params(type(self).__name__, group, index)
                    if not params:
                        continue
                _lean.check_params(type(self).__name__, group, params, f"param group {index}")
                plan.append((group, params, device))
            hyper.forget_from(len(self.param_groups))
            return self._run_plan(plan, grad_scale, found_inf, lists, loss)
        finally:
            lists.clear()
            self._end_step()

    def _step_caches(self) -> tuple[HyperCache, StepLists]:
        # Made on first use: copies (pickle, deepcopy) drop private attributes and start afresh.
        caches = self.__dict__.get("_step_cache")
        if caches is None:
            caches = self.__dict__["_step_cache"] = (HyperCache(), StepLists())
        return caches

    def _run_plan(self, plan: list, grad_scale, found_inf, lists: StepLists, loss):
        # What the ops check (layouts, aliasing, dtypes, state shapes) is checked for every group
        # before the first writes: each op checks its own lists before it writes, so with several
        # groups the later ones are validated first (the ops' check twins write nothing). A refusal
        # also takes back the state this step created, so a refused step changes nothing.
        fresh: list[torch.Tensor] = []
        made: list[dict] = []  # masters made for params that had state but none (see _master_sync)
        followed: list[tuple[dict, dict]] = []  # (state, as it was) changed by _follow_options
        groups_before = [dict(group) for group, _, _ in plan]
        calls, stepped = [], []
        recorder = _held.Recorder()
        try:
            for group, params, device in plan:
                # One lookup per param (each hashes the tensor in Python); the subclasses' _states and
                # _masters then read these dicts (StepLists).
                state_dicts = list(map(self.state.__getitem__, params))
                if not all(state_dicts):
                    for p, state in zip(params, state_dicts):
                        if not state:
                            fresh.append(p)
                            self._init_param_state(p, group)
                if group["master_weights"]:
                    made += _master_sync.make_missing(group, params, state_dicts)
                followed += self._follow_options(group, params, state_dicts)
                lists.add(params, state_dicts)
                stepped.append((group, params, state_dicts))
                calls.append((group, params, step_scalars(self, group, device, grad_scale, found_inf)))
            for group, params, scalars in calls[1:]:
                self._step_group(group, params, validate_only=True, **scalars)
            group, params, scalars = calls[0] if calls else (None, None, None)
            if calls:
                with recorder:
                    recorder.start_group()
                    self._step_group(group, params, **scalars)  # its op checks before it writes
        except BaseException:
            for state, saved in reversed(followed):  # before undo_made: `saved` may hold a master made here
                state.clear()
                state.update(saved)
            _master_sync.undo_made(made)
            for p in fresh:
                self.state.pop(p, None)
            for group, saved in zip((g for g, _, _ in plan), groups_before):
                group.clear()  # keys made for this step (a step tensor, NovoGrad's norms) go again
                group.update(saved)
            raise
        with recorder:
            for group, params, scalars in calls[1:]:
                recorder.start_group()
                self._step_group(group, params, **scalars)
        _master_sync.drop_stale(stepped)
        _lean.settle(self, [(group, params) for group, params, _ in calls])
        held = _held.build(self, calls, recorder)
        if held is not None:
            self.__dict__["_held"] = held
        return loss

    # -- helpers for subclasses --------------------------------------------------------------
    def _init_param_state(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        _master_sync.make_master(state, p, group)
        self._init_state(p, group, state)

    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        raise NotImplementedError

    def _follow_options(self, group: dict, params: list, state_dicts: list) -> list[tuple[dict, dict]]:
        """Before a fully checked step: gives existing state the form the group's options now ask
        for (options changed in param_groups between steps); returns (state, a shallow copy of it
        from before) for each state changed, which a refused step puts back."""
        return []

    # The op's optional tensors a family makes anew each step (FusedLAMB's global gradient norm):
    # a held step takes them from _held_extras(group, device), in this order.
    _held_per_step: tuple[str, ...] = ()

    def _held_extras(self, group: dict, device: torch.device) -> tuple:
        return ()

    def _begin_step(self, held: Optional[_held.HeldSteps], grad_scale: Optional[torch.Tensor]) -> bool:
        """Before a step's first check (FusedLAMB: its global gradient norm), on the held path
        (`held`: False when the held steps cannot take this step) and on the fully checked one
        (`held` None: the return value is not read)."""
        return True

    def _end_step(self) -> None:
        """After every step, held or not, made or refused (FusedLAMB drops its norm)."""

    def _held_check_in_step(self) -> bool:  # for mixprec.GradScaler (see _held.checks_in_step)
        return _held.checks_in_step(self)

    def _step_group(self, group: dict, params: list[torch.Tensor], *, validate_only: bool = False, **scalars) -> None:
        """One op call over the group's params with gradients; ``validate_only``: the op's check
        twin, which raises what the step would and changes nothing (state included)."""
        raise NotImplementedError

    def _masters(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """One master per param (fp32, or an int16 remainder; fp32 params are their own), or [] when `group` keeps none."""
        return self._weight_args(params, group)["master_params"]

    def _weight_args(self, params: list[torch.Tensor], group: dict) -> dict:
        """The op's master_params, stochastic_rounding and seed for `group` (see _lean.op_args)."""
        return _lean.op_args(self, params, group, self._step_caches()[1].state_dicts(params))

    def _states(self, params: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        state_dicts = self._step_caches()[1].state_dicts(params)
        if state_dicts is not None:
            return gather(state_dicts, key)
        return [self.state[p][key] for p in params]

    @staticmethod
    def _group_step_tensor(group: dict, device: torch.device) -> torch.Tensor:
        step = group.get("step")
        if not isinstance(step, torch.Tensor) or step.device != device or step.dtype != torch.float32:
            value = step if step is not None else 0
            step = torch.as_tensor(value, dtype=torch.float32).reshape(1).to(device)
            group["step"] = step
        return step

    def master_params(self):
        """Every parameter's fp32 master (the parameter itself when it is fp32 or masters are off)."""
        for group in self.param_groups:
            for p in group["params"]:
                yield self.state[p].get("master_param", p) if p in self.state else p
