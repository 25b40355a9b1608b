"""Apex's ``apex.parallel.LARC``: layer-wise adaptive rate clipping/scaling around any optimizer,
with the per-parameter norms from mixprec's multi_tensor_norm and no host sync per parameter."""

from __future__ import annotations

import math

import torch

from .. import _ops

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's L2 norm as one vector on the tensors' device: float32, or float64 when some
    tensor is float64 (Apex's torch.norm keeps a float64 param's norm in float64)."""
    if all(t.dtype in _KERNEL_DTYPES and t.is_contiguous() for t in tensors):
        return _ops.multi_tensor_norm(tensors, 2.0, per_tensor=True)[1]
    # float64 (or strided) tensors: torch's norms, still on the device. vector_norm refuses to
    # narrow a float64 input to a float32 result, so each is taken at least in float32.
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)).to(dtype)
                        for t in tensors])


class LARC:
    """Wraps ``optimizer``; before each inner step every parameter's gradient is rescaled by its
    adaptive rate (You et al. 2017, "Large Batch Training of Convolutional Networks"):

        adaptive = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
        clip=True:  adaptive = min(adaptive / lr, 1)   (the step is min(adaptive_lr, lr))
        g = (g + weight_decay * p) * adaptive

    The group's weight decay is folded into the gradient this way and the group's
    ``weight_decay`` is 0 during the inner step, then restored. A parameter whose weight or
    gradient norm is 0 keeps its gradient as is and gets no decay (Apex's rule). Everything else
    (param_groups, state, state_dict, zero_grad, add_param_group, pickling) is the inner
    optimizer's.
    """

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        for name, value in (("trust_coefficient", trust_coefficient), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LARC: invalid {name} {value!r}; expected a finite number >= 0")
        if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"LARC: optimizer must be an optimizer with param_groups and step(), got "
                            f"{type(optimizer).__name__}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    # -- the inner optimizer's interface, passed through -------------------------------------------
    def __getstate__(self):
        return self.optim.__getstate__()

    def __setstate__(self, state):
        self.optim.__setstate__(state)

    def __reduce__(self):
        # __getstate__ hands out the inner optimizer's state (Apex's API), so pickling and deepcopy
        # rebuild a LARC from its constructor arguments instead.
        return (type(self), (self.optim, self.trust_coefficient, self.clip, self.eps))

    @property
    def state(self):
        return self.optim.state

    def __repr__(self):
        return self.optim.__repr__()

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    # -- the step -----------------------------------------------------------------------------------
    def _check_groups(self) -> None:
        # Checked before any gradient changes, so a refused step changes nothing.
        for i, group in enumerate(self.optim.param_groups):
            wd = group.get("weight_decay", 0)
            if isinstance(wd, torch.Tensor) or not math.isfinite(float(wd)) or float(wd) < 0:
                raise ValueError(f"LARC.step: param group {i}: invalid weight_decay {wd!r}; "
                                 "expected a finite number >= 0")
            lr = group.get("lr")
            if self.clip and (lr is None or (not isinstance(lr, torch.Tensor) and not float(lr) > 0)):
                raise ValueError(f"LARC.step: param group {i}: invalid lr {lr!r}; clip=True divides by it, "
                                 "expected a number > 0")

    @torch.no_grad()
    def _rescale(self, group, weight_decay: float, saved: list) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        saved.extend((g, g.clone()) for g in grads)  # bit for bit (NaN payloads, -0.0): no arithmetic
        p_norm, g_norm = _norms(params), _norms(grads)
        adaptive = self.trust_coefficient * p_norm / (g_norm + p_norm * weight_decay + self.eps)
        if self.clip:
            adaptive = torch.clamp(adaptive / group["lr"], max=1.0)
        apply = (p_norm != 0) & (g_norm != 0)
        factor = torch.where(apply, adaptive, torch.ones_like(adaptive))
        decay = torch.where(apply, torch.full_like(adaptive, weight_decay), torch.zeros_like(adaptive))
        for i, (p, g) in enumerate(zip(params, grads)):
            if weight_decay != 0:
                g.add_(p * decay[i].to(p.dtype))
            g.mul_(factor[i].to(g.dtype))

    def step(self, closure=None):
        """Rescales every gradient (see the class docstring), then runs the inner step. A step the
        inner optimizer refuses leaves the gradients as they were (a retry would otherwise rescale
        them twice): they are copied before the rescale, which costs one copy of them per step."""
        self._check_groups()
        weight_decays, saved = [], []
        try:
            for group in self.optim.param_groups:
                weight_decay = float(group.get("weight_decay", 0))
                weight_decays.append(group.get("weight_decay", 0) if "weight_decay" in group else None)
                self._rescale(group, weight_decay, saved)
                group["weight_decay"] = 0
            return self.optim.step(closure) if closure is not None else self.optim.step()
        except BaseException:
            with torch.no_grad():
                for grad, before in saved:
                    grad.copy_(before)
            raise
        finally:
            for group, wd in zip(self.optim.param_groups, weight_decays):
                if wd is None:
                    group.pop("weight_decay", None)
                else:
                    group["weight_decay"] = wd
