"""FusedMixedPrecisionLamb: Apex's LAMB for fp16/bf16 models with fp32 masters, device-side lr and
step, and step(grad_scaler=...), as a thin front on FusedLAMB's fused op."""

from __future__ import annotations

import torch

from .._loss_scale import combine_found
from ._rules import step_count
from .fused_lamb import FusedLAMB

_NAME = "FusedMixedPrecisionLamb"
_REDUCED = (None, torch.float16, torch.bfloat16, torch.float32)


class FusedMixedPrecisionLamb(FusedLAMB):
    """Apex's ``FusedMixedPrecisionLamb``: FusedLAMB's math (global-norm clipping at
    ``max_grad_norm``, trust ratio, NVLAMB) with Apex's constructor and step signature.

    - ``reduced_precision_dtype`` (torch.float16 or torch.bfloat16) turns on fp32 master weights:
      parameters of that dtype are updated through an fp32 copy in ``state[p]["master_param"]``,
      made at their first step, and the model gets the rounded master. Moments are always fp32.
    - ``group["lr"]`` is a float32 tensor on the group's device: ``fill_`` it, or assign a new
      tensor (or a number), between steps; the op reads it on the device.
    - ``group["step"]`` is a one-element tensor on the group's device that the op increments
      unless the step is skipped; it starts at the constructor's ``step``.
    - ``step(closure=None, grad_scaler=None)``: with a GradScaler (torch.amp's or mixprec's; its
      ``step(optimizer)`` passes itself here) the kernel divides the gradients by the scale,
      clips against the unscaled global norm, and skips the whole step, step count included,
      when the scaler finds inf/NaN gradients.

    Differences from Apex 25.04: ``group["step"]`` is float32, not int32 (exact to 2**24 steps;
    mixprec's ops count on the device in float32); masters and moments are in ``state_dict()``
    (Apex rebuilds masters from the model after a load); with ``reduced_precision_dtype`` set,
    fp16 and bf16 parameters both get masters and fp32 ones are stepped in place (Apex handles
    only parameters of that dtype); without it, fp16/bf16 parameters keep fp32 moments (Apex's
    are in the parameter's dtype). After a step with a scaler, ``.grad`` holds the unscaled
    gradient (Apex leaves it scaled), as mixprec's and torch's fused optimizers do; a scaler's
    ``unscale_(optimizer)`` before the step is honoured (Apex would unscale twice). FusedLAMB's
    differences apply too (``max_grad_norm=0`` turns clipping off; options are per group).
    """

    # Apex's checkpoints lack the first two (attributes of its optimizer, not group options);
    # FusedLAMB's lack "step" until their first step. load_state_dict fills them in.
    _keys_foreign_checkpoints_lack = ("adam_w_mode", "use_nvlamb", "step")

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False, reduced_precision_dtype=None):
        if amsgrad:
            raise RuntimeError(f"{_NAME} does not support the AMSGrad variant.")
        if not any(reduced_precision_dtype is d for d in _REDUCED):
            raise ValueError(f"{_NAME}: invalid reduced_precision_dtype {reduced_precision_dtype!r}; expected None, "
                             "torch.float16 or torch.bfloat16 (torch.float32: no masters)")
        start = int(step_count(step, f"{_NAME}: step").item())
        self.reduced_precision_dtype = reduced_precision_dtype
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                         max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb,
                         master_weights=reduced_precision_dtype in (torch.float16, torch.bfloat16))
        # Known only now (FusedLAMB builds the defaults): the constructor's groups get their start
        # here, groups added later get it from the defaults in add_param_group.
        self.defaults["step"] = start
        for group in self.param_groups:
            group.setdefault("step", start)
            self._place_scalars(group)

    def add_param_group(self, param_group: dict) -> None:
        if "step" in param_group:  # checked before anything is added
            step_count(param_group["step"], f"{_NAME}.add_param_group: param group {len(self.param_groups)} 'step'")
        super().add_param_group(param_group)
        if "step" in self.defaults:  # else the constructor places them once it knows the start
            self._place_scalars(self.param_groups[-1])

    def _place_scalars(self, group: dict) -> None:
        """The group's lr and step as float32 tensors on its device, never shared with another
        group or with the defaults (Apex's add_param_group clones them for the same reason); an
        lr tensor the caller put in the group dict is kept when it already fits, as Apex keeps it."""
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        lr = group["lr"]
        fits = isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.device == device
        if not fits or lr is self.defaults["lr"]:
            group["lr"] = torch.as_tensor(lr).detach().to(device=device, dtype=torch.float32, copy=True)
        group["step"] = step_count(group["step"], f"{_NAME}: 'step'").to(device)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is None or not grad_scaler.is_enabled():
            super().step()
            return loss
        # The scaler's record of this optimizer, restored if the step is refused: a refused call
        # leaves the scaler as it was (its update() must not read a check of a step never taken).
        records = grad_scaler._per_optimizer_states
        had = id(self) in records
        saved = dict(records[id(self)]) if had else None
        try:
            record = records[id(self)]
            if getattr(record["stage"], "name", None) == "UNSCALED":
                # unscale_(optimizer) already divided the grads and recorded found_inf.
                per_device, scale = record["found_inf_per_device"], None
            else:
                per_device, scale = grad_scaler._check_inf_per_device(self), grad_scaler._get_scale_async()
            if per_device:
                found = combine_found(per_device.values(), next(iter(per_device)))
            else:  # no gradients at all: nothing steps
                found = torch.zeros((), dtype=torch.float32)
            self.grad_scale, self.found_inf = scale, found
            try:
                super().step()
            finally:
                del self.grad_scale, self.found_inf
        except BaseException:
            if had:
                records[id(self)].clear()
                records[id(self)].update(saved)
            else:
                records.pop(id(self), None)
            raise
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # validates everything first
        for group in self.param_groups:
            for key in self._keys_foreign_checkpoints_lack:
                group.setdefault(key, self.defaults[key])
            # Never the checkpoint's own lr tensor: a scheduler's fill_ must not write into it.
            group["lr"] = torch.as_tensor(group["lr"]).detach().to(dtype=torch.float32, copy=True)
            self._place_scalars(group)
