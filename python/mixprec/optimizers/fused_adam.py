"""FusedAdam: Apex's FusedAdam (Adam and AdamW) on mixprec's fused multi-tensor op."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, contains, is_

import torch

from .. import _ops
from . import _quant8
from ._base import FusedOptimizer, GroupOption
from ._rules import BETAS, FLAG, LR, MOMENT, NON_NEGATIVE, SQUARES, STATE_DTYPE, GroupRule, pair
from ._step_cache import gather

# state_dtype=torch.int8: 8-bit block-quantized moments (exp_avg as int8 codes, sqrt(exp_avg_sq)
# as uint8 codes, a float32 scale per 256 elements; docs/optimizers.md). torch.int8 names the mode
# by its codes' dtype, as torch.bfloat16 names its mode, and the C++ front's c10::ScalarType
# option spells it too (c10::kChar).
NO_8BIT_AMSGRAD = GroupRule(("amsgrad", "state_dtype"), lambda amsgrad, dtype: not (amsgrad and dtype is torch.int8),
                            "amsgrad=False with state_dtype=torch.int8 (8-bit moments keep no amsgrad maximum)")


# The moments' dtypes a state_dtype makes (exp_avg's: int8 codes for torch.int8). Moments of any
# other dtype were not made by this optimizer: nothing converts them and the op refuses them by name.
_MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_DTYPE = attrgetter("dtype")


def convert_moments(state: dict, p: torch.Tensor, dtype: torch.dtype) -> None:
    """A param's moments into `dtype` in place (quantized for torch.int8, dequantized from it,
    rounded or widened between float32 and bfloat16): what loading into a group, setting its
    state_dtype or a step after it changed in param_groups does to its moments."""
    if "exp_avg" not in state:
        return
    if dtype is torch.int8:
        if not _quant8.is_quantized(state):
            state.update(_quant8.quantize(state["exp_avg"], state["exp_avg_sq"], p))
    elif _quant8.is_quantized(state):
        m, v = _quant8.dequantize(state)
        for key in _quant8.SCALE_KEYS:
            del state[key]
        state["exp_avg"], state["exp_avg_sq"] = m.to(dtype), v.to(dtype)
    else:
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            t = state.get(key)
            if isinstance(t, torch.Tensor) and t.dtype != dtype and t.dtype in _MOMENT_DTYPES:
                state[key] = t.to(dtype)


class _AdamStateDtype(GroupOption):
    """``optimizer.state_dtype = ...``: as GroupOption, and moments already made take the new
    dtype at once (quantized into or out of the 8-bit form, or cast between float32 and bfloat16):
    left as they were, the group would say one dtype while its moments had another, and a
    checkpoint's resume (which loads them in the group's dtype) would train differently."""

    def __set__(self, opt, value):
        for i, group in enumerate(opt.param_groups):  # rules across options (amsgrad) see each group's
            opt._check_group(dict(group, state_dtype=value), f"setting state_dtype: param group {i}")
        super().__set__(opt, value)
        for group in opt.param_groups:
            for p in group["params"]:
                if p in opt.state:
                    convert_moments(opt.state[p], p, value)


class FusedAdam(FusedOptimizer):
    """Adam/AdamW in one fused pass per param group, with Apex's constructor and defaults.

    ``adam_w_mode=True`` (the default, as in Apex) decays weights decoupled (AdamW); False adds
    the L2 term to the gradient (Adam). ``master_weights=True`` keeps fp32 masters of fp16/bf16
    params, updated together with the model copy. ``state_dtype=torch.bfloat16`` stores the
    moments in bfloat16 (a mixprec extension; halves their memory); ``state_dtype=torch.int8``
    stores them 8-bit block-quantized (2 bytes per param plus a float32 scale per 256 elements per
    moment, a quarter of fp32's; no amsgrad; code map and error bound in docs/optimizers.md),
    dequantized, updated and requantized inside the one fused pass. Both are group options: the
    constructor's value is the default and a param group may name its own (``optimizer.state_dtype``
    reads and sets it for every group, see ``GroupOption``); a group's moments are made in its
    ``state_dtype`` and loaded into it (as the C++ front does); a checkpoint from before it was a
    group option gives each group the dtype its moments were saved in. Loading restores each
    group's saved ``state_dtype`` like its other options; to change it afterwards, set
    ``optimizer.state_dtype``, which quantizes or dequantizes 8-bit moments at once. ``amsgrad`` is supported
    (Apex raised). ``capturable`` is accepted for Apex compatibility: every step already runs
    without host synchronization.

    Checkpoints: ``state_dict()`` keeps the step count per group (``param_groups[i]["step"]``, a
    device tensor), not per parameter as torch.optim.Adam does, so torch.optim.Adam cannot load
    it (its step raises KeyError 'step'); the moments themselves are torch's (same keys,
    ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``). To move to torch, put a copy of each
    group's ``step`` (one per param: torch adds to it in place) in ``state[i]["step"]`` and load into torch.optim.AdamW
    (``adam_w_mode=True``) or torch.optim.Adam (False). FusedAdam loads its own checkpoints.
    """

    _hyper_rules = {"lr": LR, "betas": BETAS, "eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
                    "amsgrad": FLAG, "adam_w_mode": FLAG, "bias_correction": FLAG, "maximize": FLAG,
                    "state_dtype": STATE_DTYPE}
    _group_rules = (NO_8BIT_AMSGRAD,)
    _state_rules = {"exp_avg": MOMENT, "exp_avg_sq": SQUARES, "max_exp_avg_sq": SQUARES}
    _required_state = ("exp_avg", "exp_avg_sq")
    _state_dtypes = (torch.float32, torch.bfloat16)
    _convert_foreign_state = False  # the moments' dtype is a choice (state_dtype): never changed silently
    _group_attributes = ("master_weights", "state_dtype")
    state_dtype = _AdamStateDtype()

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False,
                 *, maximize=False, state_dtype=torch.float32, rounding="nearest", seed=0):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=pair(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, adam_w_mode=adam_w_mode, maximize=maximize, state_dtype=state_dtype)
        super().__init__(params, defaults, master_weights=master_weights, rounding=rounding, seed=seed, set_grad_none=set_grad_none,
                         capturable=capturable)

    def _init_state(self, p, group, state):
        if group["state_dtype"] is torch.int8:
            state.update(_quant8.zeros(p))
            return
        # In the parameter's layout (preserve_format): the op walks an entry's tensors in one order.
        zeros = lambda: torch.zeros_like(p, dtype=group["state_dtype"], memory_format=torch.preserve_format)
        state["exp_avg"] = zeros()
        state["exp_avg_sq"] = zeros()
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = zeros()

    def _step_group(self, group, params, *, step_tensor, lr, lr_tensor, grad_scale, found_inf, validate_only=False):
        beta1, beta2 = group["betas"]
        scales = {}
        if group["state_dtype"] is torch.int8:
            scales = dict(exp_avg_scales=self._states(params, "exp_avg_scale"),
                          exp_avg_sq_scales=self._states(params, "exp_avg_sq_scale"))
        _ops.adam_(
            params, [p.grad for p in params], self._states(params, "exp_avg"), self._states(params, "exp_avg_sq"),
            lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            adam_w_mode=group["adam_w_mode"], bias_correction=group["bias_correction"], maximize=group["maximize"],
            max_exp_avg_sqs=self._states(params, "max_exp_avg_sq") if group["amsgrad"] else (),
            **self._weight_args(params, group), step_tensor=step_tensor, lr_tensor=lr_tensor,
            grad_scale=grad_scale, found_inf=found_inf, validate_only=validate_only, **scales,
        )

    def _follow_options(self, group, params, state_dicts):
        # state_dtype or amsgrad set in param_groups after the moments were made: the moments take
        # the group's dtype and an amsgrad group gets its maximum (the moments so far), as when
        # the option is set through optimizer.state_dtype. Without this an int8 switch failed with
        # KeyError 'exp_avg_scale' and a float32 <-> bfloat16 one kept the old dtype silently.
        want, amsgrad = group["state_dtype"], group["amsgrad"]
        try:
            avgs = gather(state_dicts, "exp_avg")
        except KeyError:  # a state this optimizer did not make: the step's lookup names the key
            return []
        if all(map(is_, map(_DTYPE, avgs), repeat(want))) and (
                not amsgrad or all(map(contains, state_dicts, repeat("max_exp_avg_sq")))):
            return []  # the common case: one C-level pass
        changed = []
        for p, state in zip(params, state_dicts):
            before = dict(state)
            m = state["exp_avg"]
            if isinstance(m, torch.Tensor) and m.dtype is not want and m.dtype in _MOMENT_DTYPES:
                convert_moments(state, p, want)
            if amsgrad and "max_exp_avg_sq" not in state and isinstance(state.get("exp_avg_sq"), torch.Tensor):
                state["max_exp_avg_sq"] = state["exp_avg_sq"].clone()  # max(v so far) starts at v
            if len(state) != len(before) or any(state.get(k) is not v for k, v in before.items()):
                changed.append((state, before))
        return changed

    def load_state_dict(self, state_dict):
        # Checkpoints from before state_dtype was a group option: a group's is the dtype its saved
        # moments have, so that loading converts nothing (a foreign dtype is left to be refused).
        if (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
                and isinstance(state_dict.get("param_groups"), (list, tuple))):
            groups = []
            for g in state_dict["param_groups"]:
                if isinstance(g, dict) and "state_dtype" not in g and isinstance(g.get("params"), (list, tuple)):
                    saved = [state_dict["state"].get(pid) for pid in g["params"]]
                    dtypes = [s["exp_avg"].dtype for s in saved
                              if isinstance(s, dict) and isinstance(s.get("exp_avg"), torch.Tensor)]
                    if dtypes and STATE_DTYPE.ok(dtypes[0]):
                        g = dict(g, state_dtype=dtypes[0])
                groups.append(g)
            state_dict = dict(state_dict, param_groups=groups)
        super().load_state_dict(state_dict)

    def _validated_param_state(self, pid, p, saved_state, group):
        # Saved 8-bit moments are checked, then go through float32 like any other moments: the
        # base class validates those, and they come out in the group's state_dtype (requantizing
        # a dequantized 8-bit state gives back its codes).
        if isinstance(saved_state, dict) and _quant8.is_quantized(saved_state):
            where = f"{type(self).__name__}.load_state_dict: state[{pid}]"
            _quant8.check_saved(saved_state, p, where)
            m, v = _quant8.dequantize(saved_state)
            saved_state = {k: x for k, x in saved_state.items() if k not in _quant8.SCALE_KEYS}
            saved_state.update(exp_avg=m, exp_avg_sq=v)
        out = super()._validated_param_state(pid, p, saved_state, group)
        # The group's state_dtype says what its moments are (the op wants one dtype per param).
        dtype = group["state_dtype"]
        if dtype is torch.int8:
            if "max_exp_avg_sq" in out:
                raise ValueError(f"{type(self).__name__}.load_state_dict: state[{pid}] has 'max_exp_avg_sq' but its "
                                 "group has state_dtype=torch.int8; 8-bit moments keep no amsgrad maximum")
            convert_moments(out, p, dtype)
            return out
        for key in self._state_rules:
            if key in out and out[key].dtype != dtype:
                out[key] = out[key].to(dtype)
        return out
