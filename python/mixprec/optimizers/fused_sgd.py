"""FusedSGD: Apex's FusedSGD (momentum, dampening, Nesterov, weight decay) on mixprec's fused op."""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from .. import _ops
from ._base import FusedOptimizer, GroupOption
from ._rules import FINITE, FLAG, LR, MOMENT, NON_NEGATIVE, GroupRule, Rule

#: state_dtype="param": each momentum buffer in the dtype of the weight the step updates.
PARAM_DTYPE = "param"
# Identity for the dtype (a dtype only, never something equal to it); "param" by value.
_MOMENTUM_DTYPE = Rule(lambda x: x is torch.float32 or (isinstance(x, str) and x == PARAM_DTYPE),
                       'torch.float32 or "param" (momentum in the dtype of the weight the step updates)')


def momentum_dtype(p: torch.Tensor, group: dict) -> torch.dtype:
    """The dtype of p's momentum buffer in `group`: float32, or under state_dtype="param" the
    dtype of the weight the step updates (the param's own, float32 where it has a master)."""
    if group["state_dtype"] is torch.float32 or (group["master_weights"] and p.dtype != torch.float32):
        return torch.float32
    return p.dtype


class FusedSGD(FusedOptimizer):
    """SGD in one fused pass per param group, with Apex's constructor and defaults and
    torch.optim.SGD's numerics (a new momentum buffer starts as the gradient itself).

    ``wd_after_momentum`` (Apex) adds the weight decay to the momentum-filtered direction instead
    of to the gradient. ``master_weights=True`` (a mixprec keyword) keeps fp32 masters of fp16/bf16
    params, updated together with the model copy. ``state_dtype`` (a group option, see
    ``GroupOption``): ``torch.float32`` (the default) keeps every momentum buffer in float32;
    ``"param"`` keeps it in the dtype of the weight the step updates, as Apex's FusedSGD and
    torch.optim.SGD do: an fp16/bf16 param without a master gets an fp16/bf16 buffer (rounded
    once per step; half the memory, and the trajectory of those references), one with a master a
    float32 buffer. ``apex.optimizers.FusedSGD`` under mixprec's alias defaults to ``"param"``.
    ``materialize_master_grads`` is accepted for Apex compatibility and changes nothing: the kernel
    reads the model's gradients and unscales them in registers, so no fp32 master gradients are
    ever made. ``maximize`` is torch.optim.SGD's. Checkpoints of torch.optim.SGD load too.
    """

    _hyper_rules = {"lr": LR, "momentum": NON_NEGATIVE, "dampening": FINITE, "weight_decay": NON_NEGATIVE,
                    "nesterov": FLAG, "wd_after_momentum": FLAG, "maximize": FLAG, "state_dtype": _MOMENTUM_DTYPE}
    # torch.optim.SGD's rule for Nesterov.
    _group_rules = (GroupRule(("nesterov", "momentum", "dampening"), lambda n, m, d: not n or (m > 0 and d == 0),
                              "nesterov=True to come with momentum > 0 and dampening == 0"),)
    _state_rules = {"momentum_buffer": MOMENT}
    # Buffers load in their group's dtype (momentum_dtype); torch's fp16/bf16 ones are kept as
    # they come until converted there.
    _state_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    _group_attributes = ("master_weights", "state_dtype")
    state_dtype = GroupOption()

    # torch.optim.SGD's checkpoints lack Apex's options (filled in by load_state_dict).
    _keys_foreign_checkpoints_lack = ("wd_after_momentum", "materialize_master_grads")

    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False, *,
                 master_weights=False, maximize=False, state_dtype=torch.float32, rounding="nearest", seed=0):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, wd_after_momentum=wd_after_momentum, maximize=maximize,
                        state_dtype=state_dtype)
        super().__init__(params, defaults, master_weights=master_weights, rounding=rounding, seed=seed, set_grad_none=set_grad_none)
        self.materialize_master_grads = bool(materialize_master_grads)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("nesterov", "wd_after_momentum", "maximize"):
                group.setdefault(key, False)
            group.setdefault("state_dtype", self.defaults.setdefault("state_dtype", torch.float32))

    def _init_state(self, p, group, state):
        # Momentum buffers are made in _step_group, which must know which of them are new.
        pass

    def _step_group(self, group, params, *, step_tensor, lr, lr_tensor, grad_scale, found_inf, validate_only=False):
        momentum, dampening = group["momentum"], group["dampening"]
        fresh, buffers = [], {}
        if momentum != 0:
            for p in params:
                state = self.state[p]
                buffer = state.get("momentum_buffer")
                dtype = momentum_dtype(p, group)
                if buffer is None:
                    buffer = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    if not validate_only:  # a check leaves the state as it was: the step must see the buffer as new
                        state["momentum_buffer"] = buffer
                    fresh.append(p)
                elif buffer.dtype != dtype and buffer.dtype in (torch.float32, p.dtype):
                    # state_dtype or master_weights changed since it was made (a buffer of any other
                    # dtype was not made by this optimizer: the op refuses it, naming it)
                    buffer = buffer.to(dtype)
                    if not validate_only:
                        state["momentum_buffer"] = buffer
                buffers[p] = buffer

        def run(ps, **step_args):
            _ops.sgd_(
                ps, [p.grad for p in ps], [buffers[p] for p in ps] if momentum != 0 else (),
                lr=lr, momentum=momentum, dampening=dampening, weight_decay=group["weight_decay"],
                nesterov=group["nesterov"], wd_after_momentum=group["wd_after_momentum"],
                maximize=group["maximize"], **self._weight_args(ps, group), lr_tensor=lr_tensor,
                grad_scale=grad_scale, found_inf=found_inf, validate_only=validate_only, **step_args,
            )

        # torch.optim.SGD starts a new buffer at the gradient; the op does so on the group's first
        # step. With dampening 0 a zero buffer gives the gradient anyway (momentum * 0 + g), but
        # otherwise buffers new to a group that has stepped before (a param's first gradient, a
        # checkpoint without buffers) need a first step of their own: a host step of 1, skipped
        # with found_inf like the rest, so no host sync either way. (One corner stays: a param
        # whose very first update is skipped by found_inf in a group past its first step starts
        # from a zero buffer, as Apex's kernel always does.)
        if fresh and dampening != 0:
            fresh_ids = {id(p) for p in fresh}
            run(fresh, step=1)
            rest = [p for p in params if id(p) not in fresh_ids]
            if rest:
                run(rest, step_tensor=step_tensor)
            elif not validate_only:
                # The op counts steps on the device; without a call that takes step_tensor, do the same.
                step_tensor.add_(1.0 if found_inf is None else found_inf.eq(0).to(step_tensor.dtype))
        else:
            run(params, step_tensor=step_tensor)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # Checkpoints of torch.optim.SGD lack mixprec's group options and the step count. The
            # count only tells the op whether a buffer is new: buffers present means at least one
            # step was taken, so such a group resumes past its first step.
            for key, value in self.defaults.items():
                if key != "lr":
                    group.setdefault(key, value)
            if group.get("step") is None and any(
                    self.state.get(p, {}).get("momentum_buffer") is not None for p in group["params"]):
                device = group["params"][0].device
                group["step"] = torch.ones(1, dtype=torch.float32, device=device)

    def _validated_param_state(self, pid, p, saved_state, group):
        # torch.optim.SGD saves momentum_buffer=None without momentum: load it as "no buffer yet".
        if isinstance(saved_state, dict) and saved_state.get("momentum_buffer", 0) is None:
            saved_state = {k: v for k, v in saved_state.items() if k != "momentum_buffer"}
        out = super()._validated_param_state(pid, p, saved_state, group)
        # The loaded group's state_dtype says what the buffer is (torch's checkpoints hold it in the
        # param's dtype, mixprec's before state_dtype in float32).
        buffer = out.get("momentum_buffer")
        if buffer is not None and buffer.dtype != momentum_dtype(p, group):
            out["momentum_buffer"] = buffer.to(momentum_dtype(p, group))
        return out
