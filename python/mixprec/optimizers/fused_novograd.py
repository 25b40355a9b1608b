"""FusedNovoGrad: Apex's FusedNovoGrad (layer-wise adaptive moments) on mixprec's fused op."""

from __future__ import annotations

import math

import torch

from .. import _ops
from ._base import FusedOptimizer
from ._rules import BETAS, FLAG, LR, MOMENT, NON_NEGATIVE, NOVOGRAD_NORM, SQUARES, check_state_values, pair

# Cached device index tensors for groups where only some params have grads (see _step_group).
_MAX_CACHED_INDICES = 64


def _op_norm_type(norm_type) -> float:
    """Apex's norm_type (2, or 0 for the infinity norm; inf is accepted too) as the op's."""
    if norm_type == 2:
        return 2.0
    if norm_type == 0 or (isinstance(norm_type, (int, float)) and math.isinf(norm_type) and norm_type > 0):
        return math.inf
    raise ValueError(f"FusedNovoGrad: norm_type must be 2 (L2) or 0 (infinity norm; inf also works), got {norm_type!r}")


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad (Ginsburg et al. 2019) in one fused pass per param group, with Apex's constructor,
    defaults and numerics.

    Each parameter tensor has one second moment, kept as a norm (not squared) in
    ``group["exp_avg_sq"]``, a float32 vector with one entry per parameter of the group (Apex
    keeps one such vector per dtype). ``norm_type`` is 2 or 0 (Apex's spelling of the infinity
    norm). ``reg_inside_moment=True`` is the paper's form (normalized gradient and weight decay in
    the moment); the default puts them in the update only. ``init_zero=False`` seeds the moment
    with the first step's gradient norm. The exact rule is in csrc/kernels/novograd.h.

    mixprec additions: ``master_weights=True`` (keyword) keeps fp32 masters of fp16/bf16 params;
    bf16 params work; the first moment ``state[p]["exp_avg"]`` is float32 for every param dtype;
    the gradient norms, the moment update and the step count stay on the device (no host sync),
    and a GradScaler's found_inf skips the whole step there. Apex checkpoints load (their
    per-dtype moment vectors are merged). A parameter whose first gradient arrives after the
    group's first step starts its second moment at 0 (Apex cannot take such a parameter at all).
    Under FSDP2 the gradient norms are those of whole tensors, reduced across ranks, so the
    second moments are the same on every rank. ``amsgrad=True`` raises, as in Apex.
    """

    _hyper_rules = {"lr": LR, "betas": BETAS, "eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
                    "norm_type": NOVOGRAD_NORM, "bias_correction": FLAG, "grad_averaging": FLAG,
                    "init_zero": FLAG, "reg_inside_moment": FLAG}
    _state_rules = {"exp_avg": MOMENT}
    _required_state = ("exp_avg",)

    # Apex keeps reg_inside_moment on the optimizer, not in its groups.
    _keys_foreign_checkpoints_lack = ("reg_inside_moment",)

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False,
                 set_grad_none=True, *, master_weights=False, rounding="nearest", seed=0):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=pair(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, norm_type=norm_type,
                        init_zero=init_zero, reg_inside_moment=reg_inside_moment)
        super().__init__(params, defaults, master_weights=master_weights, rounding=rounding, seed=seed, set_grad_none=set_grad_none)

    def _reset_caches(self):
        self._index_cache: dict = {}

    def _init_state(self, p, group, state):
        # In the parameter's layout (preserve_format): the op walks an entry's tensors in one order.
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _group_norms(self, group, device) -> torch.Tensor:
        """The group's per-tensor second moments, created (zeros) on first use."""
        norms = group.get("exp_avg_sq")
        n = len(group["params"])
        if not isinstance(norms, torch.Tensor):
            norms = torch.zeros(n, dtype=torch.float32, device=device)
            group["exp_avg_sq"] = norms
        elif norms.device != device:
            norms = norms.to(device)
            group["exp_avg_sq"] = norms
        if norms.numel() != n:
            raise RuntimeError(f"FusedNovoGrad: group['exp_avg_sq'] has {norms.numel()} entries for {n} params")
        return norms

    def _index(self, positions: tuple, device) -> torch.Tensor:
        key = (positions, device)
        idx = self._index_cache.get(key)
        if idx is None:
            if len(self._index_cache) >= _MAX_CACHED_INDICES:
                self._index_cache.clear()
            idx = torch.tensor(positions, dtype=torch.int64)
            # A pinned source makes the copy asynchronous: no host sync even on a cache miss.
            idx = idx.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else idx.to(device)
            self._index_cache[key] = idx
        return idx

    def _step_group(self, group, params, *, step_tensor, lr, lr_tensor, grad_scale, found_inf, validate_only=False):
        beta1, beta2 = group["betas"]
        device = params[0].device
        norms = self._group_norms(group, device)
        if len(params) == len(group["params"]):
            idx, moments = None, norms
        else:
            # Some params have no grad this step: the op sees the moments of the others, gathered
            # and scattered back on the device (a skipped step writes back what it read).
            positions = tuple(i for i, p in enumerate(group["params"]) if p.grad is not None)
            idx = self._index(positions, device)
            moments = norms.index_select(0, idx)
        _ops.novograd_(
            params, [p.grad for p in params], self._states(params, "exp_avg"), moments,
            lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], grad_averaging=group["grad_averaging"],
            reg_inside_moment=group["reg_inside_moment"], norm_type=_op_norm_type(group["norm_type"]),
            init_zero=group["init_zero"], **self._weight_args(params, group), step_tensor=step_tensor,
            lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf, validate_only=validate_only,
        )
        if idx is not None and not validate_only:
            norms.index_copy_(0, idx, moments)

    # -- checkpoints ---------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state_dict of this class or of Apex's FusedNovoGrad, validating it all first."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        norms = None
        if isinstance(groups, (list, tuple)) and len(groups) == len(self.param_groups):
            norms = [self._loaded_norms(gi, saved, group) for gi, (saved, group) in enumerate(zip(groups, self.param_groups))]
        old_groups = self.param_groups
        # Validates the rest before changing anything; Apex's fp16 first moments become float32.
        super().load_state_dict(state_dict)
        for gi, (group, old) in enumerate(zip(self.param_groups, old_groups)):
            # Apex keeps reg_inside_moment on the optimizer, not in the group: keep ours.
            for key, value in old.items():
                if key not in ("params", "exp_avg_sq", "step"):
                    group.setdefault(key, value)
            group.pop("exp_avg_sq", None)
            if norms is not None and norms[gi] is not None:
                group["exp_avg_sq"] = norms[gi]

    @staticmethod
    def _loaded_norms(gi: int, saved, group: dict):
        """A checkpoint's second moments of group `gi` as one float32 vector on the group's device."""
        where = f"FusedNovoGrad.load_state_dict: param group {gi} 'exp_avg_sq'"
        if not isinstance(saved, dict) or saved.get("exp_avg_sq") is None:
            return None
        value = saved["exp_avg_sq"]
        params = group["params"]
        device = params[0].device if params else torch.device("cpu")
        if isinstance(value, (list, tuple)):
            # Apex: [norms of the fp16 params, norms of the fp32 params], each in group order.
            if len(value) != 2 or not all(isinstance(v, torch.Tensor) for v in value):
                raise ValueError(f"{where} is a list but not Apex's [fp16 norms, fp32 norms]")
            by_dtype = {torch.float16: [], torch.float32: []}
            for i, p in enumerate(params):
                if p.dtype not in by_dtype:
                    raise ValueError(f"{where}: Apex's layout has no place for the {p.dtype} param {i}")
                by_dtype[p.dtype].append(i)
            merged = torch.zeros(len(params), dtype=torch.float64)
            for v, dtype in zip(value, (torch.float16, torch.float32)):
                if v.numel() != len(by_dtype[dtype]):
                    raise ValueError(f"{where} holds {v.numel()} {dtype} norms but the group has "
                                     f"{len(by_dtype[dtype])} {dtype} params")
                if by_dtype[dtype]:
                    merged[torch.tensor(by_dtype[dtype])] = v.detach().cpu().double().flatten()
            value = merged
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ValueError(f"{where} must be a floating-point tensor")
        if value.dim() != 1 or value.numel() != len(params):
            raise ValueError(f"{where} has shape {tuple(value.shape)}; expected [{len(params)}] (one per param)")
        check_state_values(value, SQUARES, where)  # norms: finite and >= 0
        return value.detach().to(device=device, dtype=torch.float32).contiguous().clone()
