# Tests of mixprec.optimizers.FusedSGD on CPU and CUDA: 20-step trajectories against torch.optim.SGD
# in float64, low precision and master weights, torch.amp.GradScaler, checkpoints, hyper-parameters.
from __future__ import annotations

import math

import pytest
import torch
from torch.optim.optimizer import required

import optim_family as fam
from conftest import NON_FINITE, assert_rel_err
from mixprec.optimizers.fused_sgd import FusedSGD
from optim_family import LOW, SHAPES, flat, make_problem

OP = "sgd_"
# Every option spelled out, so references never rely on defaults (torch's lr default is 1e-3,
# Apex's lr is required).
HYPER = dict(lr=1e-2, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
             wd_after_momentum=False)
CONFIGS = {
    "plain": {},
    "weight_decay": dict(weight_decay=0.05),
    "momentum": dict(momentum=0.9),
    "momentum_dampening_wd": dict(momentum=0.8, dampening=0.3, weight_decay=0.02),
    "nesterov_wd_maximize": dict(momentum=0.7, nesterov=True, weight_decay=0.02, maximize=True),
    "wd_after_momentum": dict(momentum=0.9, dampening=0.1, weight_decay=0.05, wd_after_momentum=True),
    "wd_after_momentum_nesterov_maximize": dict(momentum=0.6, nesterov=True, weight_decay=0.05,
                                                wd_after_momentum=True, maximize=True),
}
TORCH_CONFIGS = [c for c in CONFIGS if not CONFIGS[c].get("wd_after_momentum")]

# ---- the float64 reference ----------------------------------------------------------------------


def reference_step(w, g, buf, *, first, lr, momentum, dampening, weight_decay, nesterov, maximize, wd_after_momentum):
    """One SGD step in torch.optim.SGD's formulation (first step: buffer = gradient), with Apex's
    wd_after_momentum option; returns new (w, buf)."""
    if maximize:
        g = -g
    if weight_decay != 0.0 and not wd_after_momentum:
        g = g + weight_decay * w
    if momentum != 0.0:
        buf = g.clone() if first else momentum * buf + (1.0 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    if weight_decay != 0.0 and wd_after_momentum:
        g = g + weight_decay * w
    return w - lr * g, buf


class HandSGD:
    """float64 optimizer over reference_step, for wd_after_momentum (which torch.optim lacks);
    anchored to torch.optim.SGD by test_reference_matches_torch_optim."""

    def __init__(self, params, **hyper):
        self.params, self.hyper, self.state = list(params), hyper, {}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.state.get(p, {}).get("momentum_buffer")
            new_p, buf = reference_step(p, p.grad, buf, first=buf is None, **self.hyper)
            if self.hyper["momentum"] != 0.0:
                self.state[p] = {"momentum_buffer": buf}
            p.copy_(new_p)


def reference_optimizer(params, hyper, *, hand=False):
    h = dict(HYPER, **hyper)
    if hand or h["wd_after_momentum"]:
        return HandSGD(params, **h)
    h.pop("wd_after_momentum")
    return torch.optim.SGD(params, foreach=False, **h)


def check_state(opt, params, ref_opts, ref_params, tol, what):
    """The same params have momentum buffers as in the reference, fp32 and within `tol` of it."""
    ref_bufs = [o.state.get(p, {}).get("momentum_buffer") for o, ps in zip(ref_opts, ref_params) for p in ps]
    ours = [opt.state[p].get("momentum_buffer") for ps in params for p in ps]
    assert [b is None for b in ours] == [b is None for b in ref_bufs], f"{what}: which params have buffers"
    pairs = [(a, r) for a, r in zip(ours, ref_bufs) if a is not None]
    if pairs:
        assert all(a.dtype == torch.float32 for a, _ in pairs)
        assert_rel_err(flat([a for a, _ in pairs]), flat([r for _, r in pairs]), tol, f"{what}: momentum_buffer")


FAMILY = fam.Family(FusedSGD, HYPER, CONFIGS, reference_optimizer, check_state)


# ---- the reference itself -----------------------------------------------------------------------


@pytest.mark.parametrize("config", TORCH_CONFIGS)
def test_reference_matches_torch_optim(config, gen):
    """HandSGD (used for wd_after_momentum) is torch.optim.SGD in float64 where both apply."""
    fam.reference_matches_torch_optim(FAMILY, config, gen)


# ---- FusedSGD trajectories ----------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_sgd_fp32_trajectory(device, config, gen):
    fam.fp32_trajectory(FAMILY, device, config, gen)


def test_fused_sgd_param_groups_differ(device, gen):
    """Groups with different lr, momentum, dampening, Nesterov, decay placement and maximize in
    one optimizer each follow their own reference."""
    names = ["plain", "momentum_dampening_wd", "nesterov_wd_maximize", "wd_after_momentum"]
    fam.param_groups_differ(FAMILY, names, (2e-2, 1e-2, 5e-3, 3e-2), device, gen)


@pytest.mark.parametrize("config", ["momentum_dampening_wd", "momentum"])
def test_fused_sgd_late_params_start_their_own_buffer(device, config, gen):
    """A param whose first gradient comes after the group's first step starts its buffer at that
    gradient, as torch.optim.SGD does (dampening makes the difference visible), and a group
    added mid-run starts its own step count."""
    hypers = [CONFIGS[config], dict(CONFIGS["momentum_dampening_wd"], lr=2e-2)]
    inits, grads = make_problem([SHAPES, [(6,), (2, 3)]], gen)
    late = {1: 4, 3: 9}  # param index of group 0 -> first step with a grad
    for k, step_grads in enumerate(grads):
        for i, first in late.items():
            if k < first:
                step_grads[0][i] = None
    fam.groups_added_mid_run(FAMILY, inits, grads, hypers, initial=1, added_at=5, device=device, what="late params")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["momentum_dampening_wd", "nesterov_wd_maximize", "wd_after_momentum"])
def test_fused_sgd_master_weights(device, dtype, config, gen):
    fam.master_weights(FAMILY, device, dtype, config, gen)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["weight_decay", "momentum_dampening_wd", "nesterov_wd_maximize"])
def test_fused_sgd_low_precision_without_masters(device, dtype, config, gen):
    fam.low_precision_without_masters(FAMILY, device, dtype, config, gen)


def test_fused_sgd_lr_tensor(device, gen):
    fam.lr_tensor(FAMILY, [CONFIGS["momentum_dampening_wd"]], device, gen)


# ---- torch.amp.GradScaler through the fused path ------------------------------------------------


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.bfloat16, True)])
@pytest.mark.parametrize("bad_step", [0, 4])
@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_grad_scaler_drives_fused_path(device, dtype, master_weights, bad_step, where, value, gen):
    """Skipping the very first step leaves the next one a first step (its buffer is the gradient)."""
    fam.grad_scaler_drives_fused_path(FAMILY, "momentum_dampening_wd", device, dtype, master_weights, where, value,
                                      gen, steps=8, bad_step=bad_step, bad_param=1)


def test_grad_scaler_unscale_then_step(device, gen):
    fam.grad_scaler_unscale_then_step(FAMILY, "momentum_dampening_wd", device, gen)


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.bfloat16, False)])
def test_state_dict_round_trip_continues_bit_identically(device, dtype, master_weights, gen):
    hypers = [dict(HYPER, **CONFIGS["momentum_dampening_wd"]),
              dict(HYPER, **CONFIGS["wd_after_momentum_nesterov_maximize"]) | dict(lr=torch.tensor(3e-3))]
    fam.state_dict_round_trip(FAMILY, hypers, device, dtype, master_weights, gen, state_key="momentum_buffer")


def test_loads_torch_optim_sgd_checkpoint(device, gen):
    """A torch.optim.SGD checkpoint (buffers, no state for a momentum-free group, no step count,
    none of Apex's options) resumes as if torch had gone on: the buffers are not restarted."""
    hypers = [CONFIGS["momentum_dampening_wd"], CONFIGS["weight_decay"]]
    fam.loads_torch_optim_checkpoint(FAMILY, torch.optim.SGD, hypers, device, gen, apex_only="wd_after_momentum")


# ---- constructor and hyper-parameters -----------------------------------------------------------


def test_constructor_matches_apex():
    """Apex's positional arguments and defaults, then mixprec's keyword-only extras."""
    apex = dict(lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False, wd_after_momentum=False,
                materialize_master_grads=True, set_grad_none=False)
    fam.constructor_matches_apex(FusedSGD, apex, {"master_weights", "maximize", "state_dtype", "rounding", "seed"})
    with pytest.raises(ValueError, match="lr"):
        FusedSGD([torch.nn.Parameter(torch.ones(3))])  # lr is required, as in Apex


def test_zero_grad_follows_set_grad_none(device):
    fam.zero_grad_follows_set_grad_none(FusedSGD, device, lr=0.1)


BAD_HYPER = [dict(lr=-1e-3), dict(lr=math.nan), dict(lr=math.inf), dict(momentum=-0.1), dict(momentum=math.nan),
             dict(weight_decay=-0.1), dict(weight_decay=math.inf), dict(dampening=math.nan),
             dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1)]


@pytest.mark.parametrize("bad", BAD_HYPER, ids=fam.bad_id)
def test_bad_hyper_parameters(bad):
    """Checked as defaults, in a param group at construction and in add_param_group (nothing added)."""
    fam.bad_hyper_rejected_as_defaults(FusedSGD, bad, lr=0.1)
    fam.bad_hyper_rejected_in_param_groups(FusedSGD, bad, lr=0.1)


def test_bad_group_value_at_step_modifies_nothing(device, gen):
    fam.bad_group_value_at_step_modifies_nothing(FAMILY, device, gen, [SHAPES], group=0, key="momentum", value=-1.0,
                                                 match="momentum", lr=0.1, momentum=0.9)
