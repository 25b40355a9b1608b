"""FusedAdagrad: Apex's FusedAdagrad (L2 or decoupled weight decay) on mixprec's fused op."""

from __future__ import annotations

import torch

from .. import _ops
from ._base import FusedOptimizer
from ._rules import FLAG, LR, NON_NEGATIVE, SQUARES


class FusedAdagrad(FusedOptimizer):
    """Adagrad in one fused pass per param group, with Apex's constructor and defaults and
    torch.optim.Adagrad's numerics.

    ``adagrad_w_mode=True`` (Apex) decays weights decoupled, ``w -= lr * (g / (sqrt(sum) + eps) +
    weight_decay * w)``; False adds the L2 term to the gradient as torch.optim.Adagrad does.
    torch.optim.Adagrad's ``lr_decay``, ``initial_accumulator_value`` and ``maximize`` are
    keyword-only extras, as is ``master_weights`` (fp32 masters of fp16/bf16 params, updated
    together with the model copy). The squared-gradient sums are always float32, and start at
    the group's ``initial_accumulator_value`` (torch.optim.Adagrad takes only its constructor's).
    Checkpoints of torch.optim.Adagrad load too (their per-parameter step counts become the group's).
    """

    _hyper_rules = {"lr": LR, "eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "lr_decay": NON_NEGATIVE,
                    "initial_accumulator_value": NON_NEGATIVE, "adagrad_w_mode": FLAG, "maximize": FLAG}
    _state_rules = {"sum": SQUARES}
    _required_state = ("sum",)
    # torch.optim.Adagrad's per-parameter count, accepted from its checkpoints (see load_state_dict).
    _scalar_state_keys = ("step",)

    # torch.optim.Adagrad's checkpoints lack Apex's adagrad_w_mode (filled in by load_state_dict).
    _keys_foreign_checkpoints_lack = ("adagrad_w_mode",)

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False, *,
                 lr_decay=0.0, initial_accumulator_value=0.0, maximize=False, master_weights=False, rounding="nearest", seed=0):
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode, lr_decay=lr_decay,
                        initial_accumulator_value=initial_accumulator_value, maximize=maximize)
        super().__init__(params, defaults, master_weights=master_weights, rounding=rounding, seed=seed, set_grad_none=set_grad_none)

    def _init_state(self, p, group, state):
        state["sum"] = torch.full_like(p, group["initial_accumulator_value"], dtype=torch.float32,
                                       memory_format=torch.preserve_format)

    def _step_group(self, group, params, *, step_tensor, lr, lr_tensor, grad_scale, found_inf, validate_only=False):
        _ops.adagrad_(
            params, [p.grad for p in params], self._states(params, "sum"), lr=lr, eps=group["eps"],
            weight_decay=group["weight_decay"], lr_decay=group["lr_decay"], adagrad_w_mode=group["adagrad_w_mode"],
            maximize=group["maximize"], **self._weight_args(params, group), step_tensor=step_tensor,
            lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf, validate_only=validate_only,
        )

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # torch.optim.Adagrad's checkpoints lack mixprec's group options, and count steps per
            # parameter: the group's count is their largest (they agree unless grads were missing).
            for key, value in self.defaults.items():
                if key != "lr":
                    group.setdefault(key, value)
            steps = [self.state[p].pop("step") for p in group["params"] if "step" in self.state.get(p, {})]
            if steps and group.get("step") is None:
                count = max(float(s) for s in steps)
                group["step"] = torch.full((1,), count, dtype=torch.float32, device=group["params"][0].device)
