# Tests of mixprec.optimizers.FusedAdam on CPU and CUDA: 20-step trajectories against torch.optim.Adam
# and AdamW and a float64 reference, low precision, torch.amp.GradScaler, checkpoints, hyper-parameters.
from __future__ import annotations

import io
import math

import pytest
import torch

from conftest import (
    NON_FINITE,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    inject_non_finite,
    peer_bound,
    random_tensor,
    rel_err,
    snapshot,
    torch_grad_scaler,
)
from mixprec.optimizers import FusedAdam

OP = "adam_"
LOW = (torch.float16, torch.bfloat16)
STEPS = 20
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
SHAPES = [(17,), (5, 9), (3, 4, 2), (1,)]


def scalar(value: float, device) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


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


def reference_optimizer(params, hyper, *, state_dtype=None):
    """torch.optim.Adam (L2) or AdamW (decoupled) on `params` when torch has the options; else
    HandAdam. One per param group: Adam groups are independent and torch has no per-group switch."""
    h = dict(HYPER, **hyper)
    if not h["bias_correction"] or state_dtype is not None:
        return HandAdam(params, state_dtype=state_dtype, **h)
    h.pop("bias_correction")
    cls = torch.optim.AdamW if h.pop("adam_w_mode") else torch.optim.Adam
    return cls(params, foreach=False, **h)


# ---- class-level trajectory helpers -------------------------------------------------------------


def make_problem(group_shapes, gen, steps=STEPS):
    """float64 initial values and `steps` fresh, never-zero gradients for each group's shapes."""
    inits = [[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
    grads = [[[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
             for _ in range(steps)]
    return inits, grads


def fused_run(inits, grads, hypers, *, dtype, device, master_weights=False, state_dtype=torch.float32, **kw):
    """FusedAdam over params of `dtype` made from `inits`, fed `grads` cast to `dtype`."""
    params = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in group] for group in inits]
    base = {k: v for k, v in HYPER.items() if k not in kw}  # every option explicit, as in the reference
    opt = FusedAdam([dict(params=ps, **dict(base, **h)) for ps, h in zip(params, hypers)],
                    master_weights=master_weights, state_dtype=state_dtype, **kw)
    for step_grads in grads:
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.to(dtype).to(device)
        opt.step()
    return opt, params


def reference_run(inits, grads, hypers, *, dtype, run_dtype=torch.float64, device="cpu", state_dtype=None):
    """One reference optimizer per group over params in `run_dtype` starting from the `dtype`
    values, fed the same `dtype`-rounded grads (upcast); run_dtype=dtype gives the plain-PyTorch peer."""
    params = [[torch.nn.Parameter(x.to(dtype).to(run_dtype).to(device, copy=True)) for x in group] for group in inits]
    opts = [reference_optimizer(ps, h, state_dtype=state_dtype) for ps, h in zip(params, hypers)]
    for step_grads in grads:
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.to(dtype).to(run_dtype).to(device)
        for o in opts:
            o.step()
    return opts, params


def flat(tensors):
    return torch.cat([t.detach().to("cpu", torch.float64).flatten() for t in tensors])


def check_against_reference(opt, params, ref_opts, ref_params, inits, dtype, tol, what, weights=None):
    """Weights (masters when kept) and every moment within `tol` of the reference (rel err,
    DESIGN.md's metric), and the weights' displacement from the start within 5 * tol."""
    ws = weights if weights is not None else [p for ps in params for p in ps]
    refs = [p for ps in ref_params for p in ps]
    start = flat([x.to(dtype) for g in inits for x in g])
    assert_rel_err(flat(ws), flat(refs), tol, f"{what}: weights")
    # The displacement is ~lr*steps, so this sees the update's own error, not just the weights'.
    # 5x: the sum of 20 rounded steps (torch's own fp32 AdamW makes 1e-5 to 2e-5 here).
    assert_rel_err(flat(ws) - start, flat(refs) - start, 5 * tol, f"{what}: displacement")
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        pairs = [(opt.state[p].get(key), ro.state[rp].get(key))
                 for ps, rps, ro in zip(params, ref_params, ref_opts) for p, rp in zip(ps, rps)]
        pairs = [(a, r) for a, r in pairs if a is not None]
        if pairs:
            assert_rel_err(flat([a for a, _ in pairs]), flat([r for _, r in pairs]), tol, f"{what}: {key}")


# ---- the reference itself -----------------------------------------------------------------------


@pytest.mark.parametrize("config", [c for c in CONFIGS if CONFIGS[c].get("bias_correction", True)])
def test_reference_matches_torch_optim(config, gen):
    """HandAdam (used where torch.optim has no equivalent) is torch.optim.Adam/AdamW in float64."""
    inits, grads = make_problem([SHAPES], gen)
    hyper = [CONFIGS[config]]
    torch_opts, torch_params = reference_run(inits, grads, hyper, dtype=torch.float64)
    params = [[torch.nn.Parameter(x.clone()) for x in inits[0]]]
    hand = HandAdam(params[0], **dict(HYPER, **CONFIGS[config]))
    for step_grads in grads:
        for p, g in zip(params[0], step_grads[0]):
            p.grad = g.clone()
        hand.step()
    assert_rel_err(flat(params[0]), flat(torch_params[0]), 1e-12, config)
    for p, tp in zip(params[0], torch_params[0]):
        assert_rel_err(hand.state[p]["exp_avg_sq"], torch_opts[0].state[tp]["exp_avg_sq"], 1e-12, config)


# ---- FusedAdam trajectories ---------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_adam_fp32_trajectory(device, config, gen):
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS[config]]
    opt, params = fused_run(inits, grads, hypers, dtype=torch.float32, device=device)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, config)
    assert opt.param_groups[0]["step"].item() == STEPS


def test_fused_adam_param_groups_differ(device, gen):
    """Groups with different lr, betas, eps, decay modes, amsgrad, maximize and bias correction,
    in one optimizer, each follow their own reference."""
    names = ["adam_l2", "adamw_amsgrad", "adamw_maximize_eps_betas", "adam_no_bias_correction_amsgrad"]
    hypers = [dict(CONFIGS[n], lr=lr) for n, lr in zip(names, (1e-2, 3e-3, 2e-2, 5e-3))]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:], [(7, 3)], [(11,), (2, 2)]], gen)
    opt, params = fused_run(inits, grads, hypers, dtype=torch.float32, device=device, lr=0.5)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "groups")


def test_fused_adam_add_param_group_mid_run(device, gen):
    """A group added after some steps starts its own step count (bias correction) from zero."""
    added_at = 7
    hypers = [CONFIGS["adamw"], dict(CONFIGS["adam_l2_amsgrad_maximize"], lr=3e-3)]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)
    params = [[torch.nn.Parameter(x.float().to(device)) for x in g] for g in inits]
    ref_params = [[torch.nn.Parameter(x.float().double()) for x in g] for g in inits]
    opt = FusedAdam([dict(params=params[0], **dict(HYPER, **hypers[0]))])
    ref_opts = [reference_optimizer(ref_params[0], hypers[0])]
    for k, step_grads in enumerate(grads):
        if k == added_at:
            opt.add_param_group(dict(params=params[1], **dict(HYPER, **hypers[1])))
            ref_opts.append(reference_optimizer(ref_params[1], hypers[1]))
        for gi in range(len(ref_opts)):
            for p, rp, g in zip(params[gi], ref_params[gi], step_grads[gi]):
                p.grad, rp.grad = g.float().to(device), g.float().double()
        opt.step()
        for o in ref_opts:
            o.step()
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "add_param_group")
    assert [g["step"].item() for g in opt.param_groups] == [STEPS, STEPS - added_at]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["adamw", "adam_l2_amsgrad_maximize", "adamw_no_bias_correction"])
def test_fused_adam_master_weights(device, dtype, config, gen):
    """fp16/bf16 params with fp32 masters: the masters follow an fp32-accurate run fed the same
    (upcast) grads, and the model copy is the master rounded, bit for bit, after every step."""
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS[config]]
    opt, params = fused_run(inits, grads, hypers, dtype=dtype, device=device, master_weights=True)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=dtype)
    masters = [opt.state[p]["master_param"] for p in params[0]]
    assert all(m.dtype == torch.float32 for m in masters)
    check_against_reference(opt, params, ref_opts, ref_params, inits, dtype, 1e-5, "masters", weights=masters)
    for p, m in zip(params[0], masters):
        assert_bitwise_equal(p.detach(), m.to(dtype), "model copy != rounded master")
    assert list(opt.master_params()) == masters


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["adamw", "adam_l2_amsgrad_maximize"])
def test_fused_adam_low_precision_without_masters(device, dtype, config, gen):
    """fp16/bf16 params updated in place: within 2x of plain PyTorch's error in that precision."""
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS[config]]
    opt, params = fused_run(inits, grads, hypers, dtype=dtype, device=device)
    _, ref_params = reference_run(inits, grads, hypers, dtype=dtype)
    _, peer_params = reference_run(inits, grads, hypers, dtype=dtype, run_dtype=dtype, device=device)
    out, ref, peer = flat(params[0]), flat(ref_params[0]), flat(peer_params[0])
    assert all(p.dtype == dtype for p in params[0]) and "master_param" not in opt.state[params[0][0]]
    assert_rel_err(out, ref, peer_bound(dtype, peer, ref), f"{dtype} params vs float64")
    start = flat([x.to(dtype) for x in inits[0]])
    assert rel_err(out - start, ref - start) < 0.75, "the low-precision params barely moved"  # fp16 rounding eats part of each small step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adam_bf16_state(device, dtype, gen):
    """state_dtype=bfloat16 stores the moments in bf16. Bounds are bf16's resolution (2^-9), not
    fp32's: computing a moment in fp32 rather than float64 flips its bf16 rounding now and then
    (often with bf16 grads, whose short mantissas land near ties), and a flip persists."""
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS["adamw_amsgrad"]]
    opt, params = fused_run(inits, grads, hypers, dtype=dtype, device=device, master_weights=True,
                            state_dtype=torch.bfloat16)
    for p in params[0]:
        assert all(opt.state[p][k].dtype == torch.bfloat16 for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    weights, start = flat(opt.master_params()), flat([x.to(dtype) for x in inits[0]])
    # float64 math, moments rounded to bf16 where they are stored: measured 3e-7..5e-5 on the
    # weights, 7e-6..1.5e-3 on their displacement, 0..2.5e-3 on the moments.
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=dtype, state_dtype=torch.bfloat16)
    ref = flat(ref_params[0])
    assert_rel_err(weights, ref, 2e-4, "bf16 state: weights")
    assert_rel_err(weights - start, ref - start, 5e-3, "bf16 state: displacement")
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert_rel_err(flat([opt.state[p][key] for p in params[0]]),
                       flat([ref_opts[0].state[p][key] for p in ref_params[0]]), 1e-2, f"bf16 state: {key}")
    # Against full-precision moments: measured 6e-5..9e-5 and 1.8e-3..2.9e-3.
    _, full_params = reference_run(inits, grads, hypers, dtype=dtype)
    full = flat(full_params[0])
    assert_rel_err(weights, full, 5e-4, "bf16 state vs fp32 state: weights")
    assert_rel_err(weights - start, full - start, 1e-2, "bf16 state vs fp32 state: displacement")


def test_fused_adam_zero_size_and_gradless_params(device, gen):
    """Zero-size params step (nothing to do); params without a grad are not touched and get no state."""
    shapes = [(0,), (13,), (3, 0), (4, 5)]
    inits, grads = make_problem([shapes], gen)
    hypers = [CONFIGS["adamw_amsgrad"]]
    opt, params = fused_run(inits, grads, hypers, dtype=torch.float32, device=device)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "zero-size")
    idle = torch.nn.Parameter(random_tensor(6, torch.float32, device, gen))
    before = snapshot([idle])
    opt.add_param_group(dict(params=[idle]))
    opt.step()
    assert_unchanged(before, [idle], "grad-less param")
    assert idle not in opt.state or len(opt.state[idle]) == 0


def test_fused_adam_lr_tensor(device, gen):
    """lr as a tensor gives the float lr's trajectory bit for bit, and an in-place change of the
    tensor (what a captured graph's scheduler does) takes effect at the next step."""
    inits, grads = make_problem([SHAPES], gen, steps=6)
    opt_a, pa = fused_run(inits, grads[:3], [{}], dtype=torch.float32, device=device, lr=1e-2)
    lr = torch.tensor(1e-2, device=device)
    opt_b, pb = fused_run(inits, grads[:3], [{}], dtype=torch.float32, device=device, lr=lr)
    for a, b in zip(pa[0], pb[0]):
        assert_bitwise_equal(b.detach(), a.detach(), "lr tensor vs float lr")
    opt_a.param_groups[0]["lr"] = 2.5e-3
    lr.fill_(2.5e-3)
    for step_grads in grads[3:]:
        for a, b, g in zip(pa[0], pb[0], step_grads[0]):
            a.grad, b.grad = g.float().to(device), g.float().to(device)
        opt_a.step()
        opt_b.step()
    for a, b in zip(pa[0], pb[0]):
        assert_bitwise_equal(b.detach(), a.detach(), "after changing the lr tensor in place")



# ---- torch.amp.GradScaler through the fused path ------------------------------------------------


def _adam_pair(inits, dtype, device, master_weights, hyper):
    """Two identical FusedAdam optimizers over identical params."""
    out = []
    for _ in range(2):
        ps = [torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in inits]
        out.append((ps, FusedAdam([dict(params=ps, **hyper)], master_weights=master_weights)))
    return out


def assert_same_optimizer(a_params, a_opt, b_params, b_opt, what):
    """Params, every state tensor (masters and moments) and step counts equal bit for bit."""
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert_bitwise_equal(a.detach(), b.detach(), f"{what}: param {i}")
        assert sorted(a_opt.state[a]) == sorted(b_opt.state[b]), what
        for key in a_opt.state[a]:
            assert_bitwise_equal(a_opt.state[a][key], b_opt.state[b][key], f"{what}: state[{i}][{key}]")
    for ga, gb in zip(a_opt.param_groups, b_opt.param_groups):
        assert_bitwise_equal(ga["step"], gb["step"], f"{what}: step")


def _optimizer_tensors(params, opt):
    return [p.detach() for p in params] + [t for p in params for t in opt.state[p].values()] + \
        [g["step"] for g in opt.param_groups]


# No bf16: torch's CUDA GradScaler has no bf16 kernel (and bf16 needs no loss scaling).
@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.float16, False)])
@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_grad_scaler_drives_fused_path(device, dtype, master_weights, where, value, gen):
    """torch.amp.GradScaler hands its scale and found_inf to FusedAdam.step (the fused path): the
    grads are not unscaled in place, the steps equal FusedAdam fed the unscaled grads bit for bit
    (power-of-two scales divide exactly), and an injected inf/NaN skips the step bit-identically
    and backs the scale off."""
    steps, bad_step, scale0 = 10, 4, 2.0**10
    hyper = dict(HYPER, **CONFIGS["adamw_amsgrad"])
    inits, coefs = make_problem([SHAPES], gen, steps=steps)
    (pa, opt_a), (pb, opt_b) = _adam_pair(inits[0], dtype, device, master_weights, hyper)
    scaler = torch_grad_scaler(device, dtype, init_scale=scale0, growth_interval=1000)
    for k in range(steps):
        cs = [c.to(dtype).to(device) for c in coefs[k][0]]  # d loss / d p, exact in `dtype`
        opt_a.zero_grad()
        loss = sum((p.float() * c.float()).sum() for p, c in zip(pa, cs))
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        for p, c in zip(pa, cs):
            assert_bitwise_equal(p.grad, (c.float() * scale).to(dtype), "scaled grad")
        if k == bad_step:
            inject_non_finite(pa[1].grad, where, value, gen)
        grads_before = snapshot([p.grad for p in pa])
        state_before = snapshot(_optimizer_tensors(pa, opt_a)) if k > 0 else None
        scaler.step(opt_a)
        # The scaler's inf check multiplies by 1.0 in place, which may rewrite a NaN's payload.
        for i, (g0, p) in enumerate(zip(grads_before, pa)):
            assert_bitwise_equal(p.grad, g0, f"grad {i} after GradScaler.step (fused: not unscaled)", nan_equal=True)
        assert not hasattr(opt_a, "grad_scale") and not hasattr(opt_a, "found_inf")
        scaler.update()
        if k == bad_step:
            assert_unchanged(state_before, _optimizer_tensors(pa, opt_a), "skipped step")
            assert scaler.get_scale() == scale / 2
            continue
        assert scaler.get_scale() == scale
        for p, c in zip(pb, cs):
            p.grad = c
        opt_b.step()
        assert_same_optimizer(pa, opt_a, pb, opt_b, f"step {k}")
    assert opt_a.param_groups[0]["step"].item() == steps - 1


def test_grad_scaler_unscale_then_step(device, gen):
    """scaler.unscale_(opt) (for clipping) before scaler.step: the grads are unscaled once, by
    torch, and the fused step must not divide them again. (fp32: torch's unscale_ refuses fp16
    grads, and its CUDA kernel has no bf16.)"""
    hyper = dict(HYPER, **CONFIGS["adamw"])
    inits, coefs = make_problem([SHAPES], gen, steps=4)
    (pa, opt_a), (pb, opt_b) = _adam_pair(inits[0], torch.float32, device, False, hyper)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    for k in range(4):
        cs = [c.to(torch.float32).to(device) for c in coefs[k][0]]
        opt_a.zero_grad()
        scaler.scale(sum((p.float() * c.float()).sum() for p, c in zip(pa, cs))).backward()
        scaler.unscale_(opt_a)
        for p, c in zip(pa, cs):
            assert_bitwise_equal(p.grad, c, "unscaled grad")
        scaler.step(opt_a)
        scaler.update()
        for p, c in zip(pb, cs):
            p.grad = c
        opt_b.step()
    assert_same_optimizer(pa, opt_a, pb, opt_b, "unscale_ then step")


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,master_weights,state_dtype", [
    (torch.float32, False, torch.float32), (torch.float16, True, torch.float32),
    (torch.bfloat16, True, torch.bfloat16), (torch.float16, False, torch.float32)])
def test_state_dict_round_trip_continues_bit_identically(device, dtype, master_weights, state_dtype, gen):
    """Save after 10 steps (torch.save, torch.load(weights_only=True)) into a fresh model and
    optimizer; 10 more steps equal an uninterrupted 20-step run bit for bit."""
    hypers = [dict(HYPER, **CONFIGS["adamw_amsgrad"]),
              dict(HYPER, **CONFIGS["adam_no_bias_correction_amsgrad"]) | dict(lr=torch.tensor(3e-3), amsgrad=False)]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)

    def build(values):
        ps = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in g] for g in values]
        hs = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in h.items()} for h in hypers]
        return ps, FusedAdam([dict(params=p, **h) for p, h in zip(ps, hs)], master_weights=master_weights,
                             state_dtype=state_dtype)

    def run(ps, opt, step_range):
        for k in step_range:
            for group, gs in zip(ps, grads[k]):
                for p, g in zip(group, gs):
                    p.grad = g.to(dtype).to(device)
            opt.step()

    full_p, full_opt = build(inits)
    run(full_p, full_opt, range(STEPS))

    first_p, first_opt = build(inits)
    run(first_p, first_opt, range(STEPS // 2))
    buf = io.BytesIO()
    torch.save({"model": [[p.detach() for p in g] for g in first_p], "optim": first_opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed_p, resumed_opt = build(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optim"])
    for p in (p for g in resumed_p for p in g):
        state = resumed_opt.state[p]
        assert state["exp_avg"].dtype == state_dtype and state["exp_avg"].device == p.device
        assert ("master_param" in state) == (master_weights and dtype != torch.float32)
    run(resumed_p, resumed_opt, range(STEPS // 2, STEPS))
    assert_same_optimizer([p for g in resumed_p for p in g], resumed_opt, [p for g in full_p for p in g], full_opt,
                          "resumed vs uninterrupted")


# ---- hyper-parameters -------------------------------------------------------------------------

BAD_HYPER = [dict(lr=-1e-3), dict(lr=math.nan), dict(lr=math.inf),
             dict(eps=-1e-8), dict(eps=math.nan), dict(eps=math.inf),
             dict(betas=(1.0, 0.999)), dict(betas=(0.9, 1.0)), dict(betas=(-0.1, 0.999)), dict(betas=(0.9,)),
             dict(betas=(math.nan, 0.999)), dict(weight_decay=-0.1), dict(weight_decay=math.nan),
             dict(weight_decay=math.inf)]


def _bad_id(d):
    return ",".join(f"{k}={v}" for k, v in d.items())


@pytest.mark.parametrize("bad", BAD_HYPER, ids=_bad_id)
def test_bad_hyper_parameters_as_defaults(bad):
    with pytest.raises(ValueError):
        FusedAdam([torch.nn.Parameter(torch.ones(3))], **bad)


@pytest.mark.parametrize("bad", BAD_HYPER, ids=_bad_id)
def test_bad_hyper_parameters_in_param_groups(bad):
    """A param group's own values are checked like the defaults, at construction and in
    add_param_group, not left to fail (or not) at some later step; nothing is added."""
    p, q = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    with pytest.raises(ValueError):
        FusedAdam([dict(params=[p]), dict(params=[q], **bad)])
    opt = FusedAdam([p])
    with pytest.raises(ValueError):
        opt.add_param_group(dict(params=[q], **bad))
    assert len(opt.param_groups) == 1


def test_bad_state_dtype():
    with pytest.raises(ValueError, match="state_dtype"):
        FusedAdam([torch.nn.Parameter(torch.ones(3))], state_dtype=torch.float16)


def test_bad_group_value_at_step_modifies_nothing(device, gen):
    """A hyper-parameter made invalid after construction is caught by the op before any kernel
    runs, in whichever group it is: the error names it, and no group has stepped."""
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen, steps=1)
    params = [[torch.nn.Parameter(x.float().to(device)) for x in g] for g in inits]
    opt = FusedAdam([dict(params=ps) for ps in params])
    for ps, gs in zip(params, grads[0]):
        for p, g in zip(ps, gs):
            p.grad = g.float().to(device)
    opt.param_groups[1]["lr"] = -1.0
    flat_params = [p for g in params for p in g]
    with pytest.raises(ValueError, match="lr|learning rate"):
        opt.step()
    assert_unchanged(snapshot([x.float() for g in inits for x in g]), [p.detach().cpu() for p in flat_params],
                     "params after a rejected step")
    assert all(len(opt.state[p]) == 0 or not bool(opt.state[p]["exp_avg"].any()) for p in flat_params)
    assert all(float(g.get("step", 0)) == 0 for g in opt.param_groups), "a group stepped"
