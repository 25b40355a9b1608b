# Tests of mixprec.optimizers.FusedAdam on CPU and CUDA: 20-step trajectories against torch.optim.Adam
# and AdamW and a float64 reference, low precision, torch.amp.GradScaler, checkpoints, hyper-parameters.
from __future__ import annotations

import math

import pytest
import torch

import optim_family as fam
from conftest import NON_FINITE, assert_rel_err, assert_unchanged, random_tensor, snapshot
from mixprec.optimizers import FusedAdam
from optim_family import LOW, SHAPES, flat, make_problem

OP = "adam_"
# Every FusedAdam hyper-parameter spelled out: torch.optim.AdamW's weight_decay default (1e-2)
# differs from Apex's (0), so references never rely on defaults.
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
             adam_w_mode=True, bias_correction=True)
# Option sets of the trajectory tests; eps=0.1 makes a misplaced eps visible, maximize flips signs.
CONFIGS = {
    "adam": dict(adam_w_mode=False),
    "adam_l2": dict(adam_w_mode=False, weight_decay=0.1),
    "adamw": dict(weight_decay=0.1),
    "adamw_amsgrad": dict(weight_decay=0.05, amsgrad=True),
    "adam_l2_amsgrad_maximize": dict(adam_w_mode=False, weight_decay=0.1, amsgrad=True, maximize=True),
    "adamw_maximize_eps_betas": dict(maximize=True, eps=0.1, betas=(0.8, 0.95), weight_decay=0.02),
    "adamw_no_bias_correction": dict(bias_correction=False, weight_decay=0.1),
    "adam_no_bias_correction_amsgrad": dict(adam_w_mode=False, bias_correction=False, amsgrad=True, lr=3e-3),
}

# ---- the float64 reference ----------------------------------------------------------------------


def reference_step(p, g, m, v, vmax, *, step, lr, betas, eps, weight_decay, adam_w_mode, bias_correction, maximize,
                   amsgrad, state_dtype=None):
    """One Adam (Kingma & Ba 2015, Algorithm 1) / AdamW (Loshchilov & Hutter 2019) step in the
    precision of the inputs, in torch.optim's formulation; returns new (p, m, v, vmax).
    ``state_dtype`` rounds the stored moments (bf16 state), keeping this step's math exact."""
    b1, b2 = betas
    if maximize:
        g = -g
    if weight_decay != 0.0:
        if adam_w_mode:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    second = v
    if amsgrad:
        vmax = torch.maximum(vmax, v)
        second = vmax
    bc1 = 1.0 - b1**step if bias_correction else 1.0
    bc2 = 1.0 - b2**step if bias_correction else 1.0
    p = p - (lr / bc1) * m / (second.sqrt() / math.sqrt(bc2) + eps)
    if state_dtype is not None:
        m, v = m.to(state_dtype).double(), v.to(state_dtype).double()
        vmax = vmax.to(state_dtype).double() if amsgrad else vmax
    return p, m, v, vmax


class HandAdam:
    """float64 optimizer over reference_step, for what torch.optim lacks (bias_correction=False,
    bf16 state); anchored to torch.optim.Adam/AdamW by test_reference_matches_torch_optim."""

    def __init__(self, params, *, state_dtype=None, **hyper):
        self.params, self.hyper, self.state_dtype, self.step_count = list(params), hyper, state_dtype, 0
        self.state = {p: {k: torch.zeros_like(p) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
                      for p in self.params}

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        for p in self.params:
            s = self.state[p]
            new_p, s["exp_avg"], s["exp_avg_sq"], s["max_exp_avg_sq"] = reference_step(
                p, p.grad, s["exp_avg"], s["exp_avg_sq"], s["max_exp_avg_sq"], step=self.step_count,
                state_dtype=self.state_dtype, **self.hyper)
            p.copy_(new_p)


def reference_optimizer(params, hyper, *, hand=False, state_dtype=None):
    """torch.optim.Adam (L2) or AdamW (decoupled) on `params` when torch has the options; else
    HandAdam. One per param group: Adam groups are independent and torch has no per-group switch."""
    h = dict(HYPER, **hyper)
    if hand or not h["bias_correction"] or state_dtype is not None:
        return HandAdam(params, state_dtype=state_dtype, **h)
    h.pop("bias_correction")
    cls = torch.optim.AdamW if h.pop("adam_w_mode") else torch.optim.Adam
    return cls(params, foreach=False, **h)


def check_state(opt, params, ref_opts, ref_params, tol, what):
    """Every moment within `tol` of the reference."""
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        pairs = [(opt.state[p].get(key), ro.state[rp].get(key))
                 for ps, rps, ro in zip(params, ref_params, ref_opts) for p, rp in zip(ps, rps)]
        pairs = [(a, r) for a, r in pairs if a is not None]
        if pairs:
            assert_rel_err(flat([a for a, _ in pairs]), flat([r for _, r in pairs]), tol, f"{what}: {key}")


FAMILY = fam.Family(FusedAdam, HYPER, CONFIGS, reference_optimizer, check_state)


# ---- the reference itself -----------------------------------------------------------------------


@pytest.mark.parametrize("config", [c for c in CONFIGS if CONFIGS[c].get("bias_correction", True)])
def test_reference_matches_torch_optim(config, gen):
    """HandAdam (used where torch.optim has no equivalent) is torch.optim.Adam/AdamW in float64."""
    fam.reference_matches_torch_optim(FAMILY, config, gen, state_key="exp_avg_sq")


# ---- FusedAdam trajectories ---------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_adam_fp32_trajectory(device, config, gen):
    fam.fp32_trajectory(FAMILY, device, config, gen)


def test_fused_adam_param_groups_differ(device, gen):
    """Groups with different lr, betas, eps, decay modes, amsgrad, maximize and bias correction,
    in one optimizer, each follow their own reference."""
    names = ["adam_l2", "adamw_amsgrad", "adamw_maximize_eps_betas", "adam_no_bias_correction_amsgrad"]
    fam.param_groups_differ(FAMILY, names, (1e-2, 3e-3, 2e-2, 5e-3), device, gen)


def test_fused_adam_add_param_group_mid_run(device, gen):
    """A group added after some steps starts its own step count (bias correction) from zero."""
    hypers = [CONFIGS["adamw"], dict(CONFIGS["adam_l2_amsgrad_maximize"], lr=3e-3)]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)
    fam.groups_added_mid_run(FAMILY, inits, grads, hypers, initial=1, added_at=7, device=device,
                             what="add_param_group")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["adamw", "adam_l2_amsgrad_maximize", "adamw_no_bias_correction"])
def test_fused_adam_master_weights(device, dtype, config, gen):
    fam.master_weights(FAMILY, device, dtype, config, gen)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["adamw", "adam_l2_amsgrad_maximize"])
def test_fused_adam_low_precision_without_masters(device, dtype, config, gen):
    # 0.75: fp16 rounding eats part of each small Adam step.
    fam.low_precision_without_masters(FAMILY, device, dtype, config, gen, moved_below=0.75)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adam_bf16_state(device, dtype, gen):
    """state_dtype=bfloat16 stores the moments in bf16. Bounds are bf16's resolution (2^-9), not
    fp32's: computing a moment in fp32 rather than float64 flips its bf16 rounding now and then
    (often with bf16 grads, whose short mantissas land near ties), and a flip persists."""
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS["adamw_amsgrad"]]
    opt, params = FAMILY.fused_run(inits, grads, hypers, dtype=dtype, device=device, master_weights=True,
                                   state_dtype=torch.bfloat16)
    for p in params[0]:
        assert all(opt.state[p][k].dtype == torch.bfloat16 for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    weights, start = flat(opt.master_params()), flat([x.to(dtype) for x in inits[0]])
    # float64 math, moments rounded to bf16 where they are stored: measured 3e-7..5e-5 on the
    # weights, 7e-6..1.5e-3 on their displacement, 0..2.5e-3 on the moments.
    ref_opts, ref_params = FAMILY.reference_run(inits, grads, hypers, dtype=dtype, state_dtype=torch.bfloat16)
    ref = flat(ref_params[0])
    assert_rel_err(weights, ref, 2e-4, "bf16 state: weights")
    assert_rel_err(weights - start, ref - start, 5e-3, "bf16 state: displacement")
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert_rel_err(flat([opt.state[p][key] for p in params[0]]),
                       flat([ref_opts[0].state[p][key] for p in ref_params[0]]), 1e-2, f"bf16 state: {key}")
    # Against full-precision moments: measured 6e-5..9e-5 and 1.8e-3..2.9e-3.
    _, full_params = FAMILY.reference_run(inits, grads, hypers, dtype=dtype)
    full = flat(full_params[0])
    assert_rel_err(weights, full, 5e-4, "bf16 state vs fp32 state: weights")
    assert_rel_err(weights - start, full - start, 1e-2, "bf16 state vs fp32 state: displacement")


def test_fused_adam_zero_size_and_gradless_params(device, gen):
    """Zero-size params step (nothing to do); params without a grad are not touched and get no state."""
    shapes = [(0,), (13,), (3, 0), (4, 5)]
    inits, grads = make_problem([shapes], gen)
    hypers = [CONFIGS["adamw_amsgrad"]]
    opt, params = FAMILY.fused_run(inits, grads, hypers, dtype=torch.float32, device=device)
    ref_opts, ref_params = FAMILY.reference_run(inits, grads, hypers, dtype=torch.float32)
    fam.check_against_reference(FAMILY, opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "zero-size")
    idle = torch.nn.Parameter(random_tensor(6, torch.float32, device, gen))
    before = snapshot([idle])
    opt.add_param_group(dict(params=[idle]))
    opt.step()
    assert_unchanged(before, [idle], "grad-less param")
    assert idle not in opt.state or len(opt.state[idle]) == 0


def test_fused_adam_lr_tensor(device, gen):
    fam.lr_tensor(FAMILY, [{}], device, gen)


# ---- torch.amp.GradScaler through the fused path ------------------------------------------------


# No bf16: torch's CUDA GradScaler has no bf16 kernel (and bf16 needs no loss scaling).
@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.float16, False)])
@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_grad_scaler_drives_fused_path(device, dtype, master_weights, where, value, gen):
    fam.grad_scaler_drives_fused_path(FAMILY, "adamw_amsgrad", device, dtype, master_weights, where, value, gen,
                                      steps=10, bad_step=4, bad_param=1)


def test_grad_scaler_unscale_then_step(device, gen):
    fam.grad_scaler_unscale_then_step(FAMILY, "adamw", device, gen)


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,master_weights,state_dtype", [
    (torch.float32, False, torch.float32), (torch.float16, True, torch.float32),
    (torch.bfloat16, True, torch.bfloat16), (torch.float16, False, torch.float32)])
def test_state_dict_round_trip_continues_bit_identically(device, dtype, master_weights, state_dtype, gen):
    hypers = [dict(HYPER, **CONFIGS["adamw_amsgrad"]),
              dict(HYPER, **CONFIGS["adam_no_bias_correction_amsgrad"]) | dict(lr=torch.tensor(3e-3), amsgrad=False)]
    fam.state_dict_round_trip(FAMILY, hypers, device, dtype, master_weights, gen, state_key="exp_avg",
                              state_dtype=state_dtype)


# ---- hyper-parameters -------------------------------------------------------------------------

BAD_HYPER = [dict(lr=-1e-3), dict(lr=math.nan), dict(lr=math.inf),
             dict(eps=-1e-8), dict(eps=math.nan), dict(eps=math.inf),
             dict(betas=(1.0, 0.999)), dict(betas=(0.9, 1.0)), dict(betas=(-0.1, 0.999)), dict(betas=(0.9,)),
             dict(betas=(math.nan, 0.999)), dict(weight_decay=-0.1), dict(weight_decay=math.nan),
             dict(weight_decay=math.inf)]


@pytest.mark.parametrize("bad", BAD_HYPER, ids=fam.bad_id)
def test_bad_hyper_parameters_as_defaults(bad):
    fam.bad_hyper_rejected_as_defaults(FusedAdam, bad)


@pytest.mark.parametrize("bad", BAD_HYPER, ids=fam.bad_id)
def test_bad_hyper_parameters_in_param_groups(bad):
    fam.bad_hyper_rejected_in_param_groups(FusedAdam, bad)


def test_bad_state_dtype():
    with pytest.raises(ValueError, match="state_dtype"):
        FusedAdam([torch.nn.Parameter(torch.ones(3))], state_dtype=torch.float16)


def test_bad_group_value_at_step_modifies_nothing(device, gen):
    fam.bad_group_value_at_step_modifies_nothing(FAMILY, device, gen, [SHAPES[:2], SHAPES[2:]], group=1, key="lr",
                                                 value=-1.0, match="lr|learning rate")
