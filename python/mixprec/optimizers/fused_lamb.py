"""FusedLAMB: Apex's FusedLAMB (LAMB with global-norm clipping and NVLAMB) on mixprec's fused op."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from .. import _ops
from .._device_copy import to_device
from ._base import FusedOptimizer, _device_scalar
from ._rules import BETAS, CLIP_NORM, FLAG, LR, MOMENT, NON_NEGATIVE, SQUARES, pair


def _clips(group: dict) -> bool:
    """Whether a group clips: max_grad_norm 0 or inf turns clipping off."""
    return 0.0 < group["max_grad_norm"] < math.inf


class FusedLAMB(FusedOptimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") with Apex's
    constructor, defaults and semantics, in two fused passes per param group.

    Each step first computes the global L2 norm of every gradient of every group together (fp16,
    bf16 and fp32 alike, on the device, divided by the loss scale when a GradScaler hands one
    over) and clips gradients to ``max_grad_norm`` against it; then per group the Adam moments,
    the update ``u = m_hat / (sqrt(v_hat) + eps) (+ weight_decay * w if adam_w_mode)`` and
    ``w -= lr * trust_ratio * u`` with ``trust_ratio = ||w|| / ||u||`` per tensor (1 when either
    norm is 0), applied to groups with weight decay, or to all with ``use_nvlamb``.
    ``grad_averaging=False`` drops beta1's ``(1 - beta1)`` factor on the gradient.

    Differences from Apex: bf16 params are supported, and ``master_weights=True`` (keyword only)
    keeps fp32 masters of fp16/bf16 params; moments are always fp32; ``max_grad_norm``,
    ``adam_w_mode`` and ``use_nvlamb`` are per-group settings (Apex reads them from the
    constructor only); ``max_grad_norm=0`` turns clipping off where Apex would zero the update.
    No step synchronizes with the host (but one with CPU groups beside GPU ones, for their norm).
    Under FSDP2 (sharded DTensor parameters) every norm is that of the whole tensor: the shards'
    norms are reduced across ranks between the passes.
    """

    _hyper_rules = {"lr": LR, "betas": BETAS, "eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
                    "max_grad_norm": CLIP_NORM, "bias_correction": FLAG, "grad_averaging": FLAG,
                    "adam_w_mode": FLAG, "use_nvlamb": FLAG}
    _state_rules = {"exp_avg": MOMENT, "exp_avg_sq": SQUARES}
    _required_state = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False, *, master_weights=False, rounding="nearest", seed=0):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=pair(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
                        adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb)
        super().__init__(params, defaults, master_weights=master_weights, rounding=rounding, seed=seed, set_grad_none=set_grad_none)

    def _reset_caches(self):
        self._grad_norms: dict[torch.device, torch.Tensor] = {}

    def _begin_step(self, held, grad_scale):
        # The norm every clipping group's op call takes, before any of them (the op writes the
        # unscaled grads back). Held: from the held params' grads in C++ (HeldNorm), no Python
        # pass over the params.
        if not any(map(_clips, self.param_groups)):
            self._grad_norms = {}
            return True
        norms = self._global_grad_norms(grad_scale) if held is None else held.global_grad_norms(grad_scale)
        if norms is None:
            return False
        self._grad_norms = norms
        return True

    def _end_step(self):
        self._grad_norms = {}

    _held_per_step = ("global_grad_norm",)  # made anew every step (_begin_step): a held step takes it from here

    def _held_extras(self, group, device):
        return (self._grad_norms.get(device) if _clips(group) else None,)

    def _global_grad_norms(self, grad_scale) -> dict[torch.device, torch.Tensor]:
        """The unscaled L2 norm of all gradients of all groups, one copy per device in use, all
        computed and divided on the device (no host sync, but for the copy into a CPU group beside GPU
        ones). HeldNorm (csrc/ops/held_step.h) repeats these calls for held steps: a change here is
        one there."""
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLAMB does not support sparse gradients")
                by_device[p.grad.device].append(p.grad)
        if not by_device:
            return {}
        norms = [_ops.multi_tensor_norm(grads)[0] for grads in by_device.values()]
        first = next(iter(by_device))
        if len(norms) == 1:
            total = norms[0].reshape(1)
        else:  # several devices: combine the squares on the first one
            total = torch.stack([to_device(n, first) for n in norms]).square().sum()
            total = total.sqrt().reshape(1)
        grad_scale = _device_scalar(grad_scale, first)
        if grad_scale is not None:
            total = total / grad_scale
        return {d: total if d == first else to_device(total, d) for d in by_device}

    def _init_state(self, p, group, state):
        # In the parameter's layout (preserve_format): the op walks an entry's tensors in one order.
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _step_group(self, group, params, *, step_tensor, lr, lr_tensor, grad_scale, found_inf, validate_only=False):
        beta1, beta2 = group["betas"]
        global_grad_norm = self._grad_norms.get(params[0].device) if _clips(group) else None
        if _clips(group) and global_grad_norm is None:
            raise RuntimeError("FusedLAMB: the global gradient norm is computed in step(); call step(), "
                               "not _step_group()")
        _ops.lamb_(
            params, [p.grad for p in params], self._states(params, "exp_avg"), self._states(params, "exp_avg_sq"),
            lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], grad_averaging=group["grad_averaging"],
            adam_w_mode=group["adam_w_mode"], max_grad_norm=group["max_grad_norm"], use_nvlamb=group["use_nvlamb"],
            **self._weight_args(params, group), step_tensor=step_tensor, lr_tensor=lr_tensor,
            grad_scale=grad_scale, found_inf=found_inf, validate_only=validate_only, global_grad_norm=global_grad_norm,
        )
