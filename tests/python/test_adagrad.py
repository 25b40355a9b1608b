# Tests of mixprec.optimizers.FusedAdagrad on CPU and CUDA: 20-step trajectories against
# torch.optim.Adagrad in float64, low precision and master weights, GradScaler, checkpoints, hyper-parameters.
from __future__ import annotations

import math

import pytest
import torch

import optim_family as fam
from conftest import NON_FINITE, assert_rel_err
from mixprec.optimizers.fused_adagrad import FusedAdagrad
from optim_family import LOW, SHAPES, flat, make_problem

OP = "adagrad_"
# Every option spelled out, so references never rely on defaults.
HYPER = dict(lr=5e-2, eps=1e-10, weight_decay=0.0, lr_decay=0.0, initial_accumulator_value=0.0, maximize=False,
             adagrad_w_mode=False)
# eps=0.1 makes a misplaced eps visible; the w_mode configs are Apex's decoupled decay.
CONFIGS = {
    "plain": {},
    "l2": dict(weight_decay=0.05),
    "lr_decay_initial_accumulator": dict(lr_decay=0.05, initial_accumulator_value=0.3),
    "l2_lr_decay_maximize_eps": dict(weight_decay=0.02, lr_decay=0.01, maximize=True, eps=0.1),
    "w_mode": dict(adagrad_w_mode=True, weight_decay=0.05),
    "w_mode_lr_decay_maximize": dict(adagrad_w_mode=True, weight_decay=0.1, lr_decay=0.02, maximize=True,
                                     initial_accumulator_value=0.1),
}
TORCH_CONFIGS = [c for c in CONFIGS if not CONFIGS[c].get("adagrad_w_mode")]

# ---- the float64 reference ----------------------------------------------------------------------


def reference_step(w, g, s, *, step, lr, eps, weight_decay, lr_decay, adagrad_w_mode, maximize):
    """One Adagrad step (Duchi et al. 2011) in torch.optim.Adagrad's formulation, with Apex's
    decoupled decay for adagrad_w_mode; returns new (w, sum)."""
    if maximize:
        g = -g
    if weight_decay != 0.0 and not adagrad_w_mode:
        g = g + weight_decay * w
    clr = lr / (1.0 + (step - 1) * lr_decay)
    s = s + g * g
    update = g / (s.sqrt() + eps)
    if weight_decay != 0.0 and adagrad_w_mode:
        update = update + weight_decay * w
    return w - clr * update, s


class HandAdagrad:
    """float64 optimizer over reference_step, for adagrad_w_mode (which torch.optim lacks);
    anchored to torch.optim.Adagrad by test_reference_matches_torch_optim."""

    def __init__(self, params, *, initial_accumulator_value, **hyper):
        self.params, self.hyper = list(params), hyper
        self.state = {p: {"sum": torch.full_like(p, initial_accumulator_value), "step": 0} for p in self.params}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None:
                continue
            s = self.state[p]
            s["step"] += 1
            new_p, s["sum"] = reference_step(p, p.grad, s["sum"], step=s["step"], **self.hyper)
            p.copy_(new_p)


def reference_optimizer(params, hyper, *, hand=False):
    h = dict(HYPER, **hyper)
    if hand or h["adagrad_w_mode"]:
        return HandAdagrad(params, **h)
    h.pop("adagrad_w_mode")
    return torch.optim.Adagrad(params, foreach=False, **h)


def check_state(opt, params, ref_opts, ref_params, tol, what):
    """The sums are fp32 and within `tol` of the reference."""
    sums = [opt.state[p]["sum"] for ps in params for p in ps]
    assert all(s.dtype == torch.float32 for s in sums)
    ref_sums = [o.state[p]["sum"] for o, ps in zip(ref_opts, ref_params) for p in ps]
    assert_rel_err(flat(sums), flat(ref_sums), tol, f"{what}: sum")


FAMILY = fam.Family(FusedAdagrad, HYPER, CONFIGS, reference_optimizer, check_state)


# ---- the reference itself -----------------------------------------------------------------------


@pytest.mark.parametrize("config", TORCH_CONFIGS)
def test_reference_matches_torch_optim(config, gen):
    """HandAdagrad (used for adagrad_w_mode) is torch.optim.Adagrad in float64 where both apply."""
    fam.reference_matches_torch_optim(FAMILY, config, gen)


# ---- FusedAdagrad trajectories ------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_adagrad_fp32_trajectory(device, config, gen):
    fam.fp32_trajectory(FAMILY, device, config, gen)


def test_fused_adagrad_param_groups_differ(device, gen):
    """Groups with different lr, eps, lr_decay, accumulator start, decay modes and maximize in one
    optimizer each follow their own reference; a group added mid-run counts its own steps."""
    names = ["l2", "lr_decay_initial_accumulator", "l2_lr_decay_maximize_eps", "w_mode_lr_decay_maximize"]
    hypers = [dict(CONFIGS[n], lr=lr) for n, lr in zip(names, (2e-2, 5e-2, 3e-2, 1e-2))]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:], [(7, 3)], [(11,), (2, 2)]], gen)
    fam.groups_added_mid_run(FAMILY, inits, grads, hypers, initial=3, added_at=6, device=device, what="groups",
                             lr=0.5)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["l2_lr_decay_maximize_eps", "w_mode_lr_decay_maximize"])
def test_fused_adagrad_master_weights(device, dtype, config, gen):
    fam.master_weights(FAMILY, device, dtype, config, gen)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["l2", "lr_decay_initial_accumulator"])
def test_fused_adagrad_low_precision_without_masters(device, dtype, config, gen):
    fam.low_precision_without_masters(FAMILY, device, dtype, config, gen)


def test_fused_adagrad_lr_tensor(device, gen):
    fam.lr_tensor(FAMILY, [CONFIGS["l2_lr_decay_maximize_eps"]], device, gen)


# ---- torch.amp.GradScaler through the fused path ------------------------------------------------


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.bfloat16, True)])
@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_grad_scaler_drives_fused_path(device, dtype, master_weights, where, value, gen):
    """A skipped step leaves lr_decay's count where it was."""
    fam.grad_scaler_drives_fused_path(FAMILY, "w_mode_lr_decay_maximize", device, dtype, master_weights, where,
                                      value, gen, steps=8, bad_step=3, bad_param=2)


def test_grad_scaler_unscale_then_step(device, gen):
    fam.grad_scaler_unscale_then_step(FAMILY, "l2_lr_decay_maximize_eps", device, gen)


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.bfloat16, False)])
def test_state_dict_round_trip_continues_bit_identically(device, dtype, master_weights, gen):
    hypers = [dict(HYPER, **CONFIGS["lr_decay_initial_accumulator"]),
              dict(HYPER, **CONFIGS["w_mode_lr_decay_maximize"]) | dict(lr=torch.tensor(3e-3))]
    fam.state_dict_round_trip(FAMILY, hypers, device, dtype, master_weights, gen, state_key="sum")


def test_loads_torch_optim_adagrad_checkpoint(device, gen):
    """A torch.optim.Adagrad checkpoint (per-parameter step counts, none of Apex's options)
    resumes as if torch had gone on: sums and lr_decay's count carry over."""
    # No initial_accumulator_value in a group: torch.optim.Adagrad takes only its constructor's.
    hypers = [dict(lr_decay=0.03, weight_decay=0.01), CONFIGS["l2_lr_decay_maximize_eps"]]
    fam.loads_torch_optim_checkpoint(FAMILY, torch.optim.Adagrad, hypers, device, gen, apex_only="adagrad_w_mode",
                                     steps_kept=True)


# ---- constructor and hyper-parameters -----------------------------------------------------------


def test_constructor_matches_apex():
    """Apex's positional arguments and defaults, then torch.optim.Adagrad's and mixprec's
    keyword-only extras."""
    apex = dict(lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False)
    fam.constructor_matches_apex(FusedAdagrad, apex, {"lr_decay", "initial_accumulator_value", "maximize",
                                                      "master_weights", "rounding", "seed"})


def test_zero_grad_follows_set_grad_none(device):
    fam.zero_grad_follows_set_grad_none(FusedAdagrad, device)


def test_initial_accumulator_value_fills_state(device):
    p = torch.nn.Parameter(torch.ones(2, 3, device=device, dtype=torch.float16))
    opt = FusedAdagrad([p], initial_accumulator_value=0.25, master_weights=True)
    p.grad = torch.zeros_like(p)
    opt.step()  # a zero gradient leaves the sum at its start
    assert opt.state[p]["sum"].dtype == torch.float32 and bool((opt.state[p]["sum"] == 0.25).all())


BAD_HYPER = [dict(lr=-1e-3), dict(lr=math.nan), dict(lr=math.inf), dict(eps=-1e-10), dict(eps=math.nan),
             dict(weight_decay=-0.1), dict(weight_decay=math.inf), dict(lr_decay=-0.1), dict(lr_decay=math.nan),
             dict(initial_accumulator_value=-1.0), dict(initial_accumulator_value=math.inf)]


@pytest.mark.parametrize("bad", BAD_HYPER, ids=fam.bad_id)
def test_bad_hyper_parameters(bad):
    """Checked as defaults, in a param group at construction and in add_param_group (nothing added)."""
    fam.bad_hyper_rejected_as_defaults(FusedAdagrad, bad)
    fam.bad_hyper_rejected_in_param_groups(FusedAdagrad, bad)


def test_bad_group_value_at_step_modifies_nothing(device, gen):
    fam.bad_group_value_at_step_modifies_nothing(FAMILY, device, gen, [SHAPES], group=0, key="lr_decay", value=-1.0,
                                                 match="lr_decay")
