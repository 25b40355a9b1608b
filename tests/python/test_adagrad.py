# Tests of mixprec.optimizers.FusedAdagrad on CPU and CUDA: 20-step trajectories against
# torch.optim.Adagrad in float64, low precision and master weights, GradScaler, checkpoints, hyper-parameters.
from __future__ import annotations

import inspect
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
from mixprec.optimizers.fused_adagrad import FusedAdagrad

OP = "adagrad_"
LOW = (torch.float16, torch.bfloat16)
STEPS = 20
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
SHAPES = [(17,), (5, 9), (3, 4, 2), (1,)]


def scalar(value: float, device) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def flat(tensors):
    return torch.cat([t.detach().to("cpu", torch.float64).flatten() for t in tensors])


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


def make_problem(group_shapes, gen, steps=STEPS):
    """float64 initial values and `steps` fresh, never-zero gradients for each group's shapes."""
    inits = [[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
    grads = [[[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
             for _ in range(steps)]
    return inits, grads


def fused_run(inits, grads, hypers, *, dtype, device, master_weights=False, **kw):
    """FusedAdagrad over params of `dtype` made from `inits`, fed `grads` cast to `dtype`."""
    params = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in group] for group in inits]
    base = {k: v for k, v in HYPER.items() if k not in kw}
    opt = FusedAdagrad([dict(params=ps, **dict(base, **h)) for ps, h in zip(params, hypers)],
                       master_weights=master_weights, **kw)
    for step_grads in grads:
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.to(dtype).to(device)
        opt.step()
    return opt, params


def reference_run(inits, grads, hypers, *, dtype, run_dtype=torch.float64, device="cpu"):
    """One reference optimizer per group over params in `run_dtype` starting from the `dtype`
    values, fed the same `dtype`-rounded grads; run_dtype=dtype gives the plain-PyTorch peer."""
    params = [[torch.nn.Parameter(x.to(dtype).to(run_dtype).to(device, copy=True)) for x in group] for group in inits]
    opts = [reference_optimizer(ps, h) for ps, h in zip(params, hypers)]
    for step_grads in grads:
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.to(dtype).to(run_dtype).to(device)
        for o in opts:
            o.step()
    return opts, params


def check_against_reference(opt, params, ref_opts, ref_params, inits, dtype, tol, what, weights=None):
    """Weights (masters when kept) and sums within `tol` of the reference (rel err over all
    tensors together), and the weights' displacement from the start within 5 * tol."""
    ws = weights if weights is not None else [p for ps in params for p in ps]
    refs = [p for ps in ref_params for p in ps]
    start = flat([x.to(dtype) for g in inits for x in g])
    assert_rel_err(flat(ws), flat(refs), tol, f"{what}: weights")
    assert_rel_err(flat(ws) - start, flat(refs) - start, 5 * tol, f"{what}: displacement")
    sums = [opt.state[p]["sum"] for ps in params for p in ps]
    assert all(s.dtype == torch.float32 for s in sums)
    ref_sums = [o.state[p]["sum"] for o, ps in zip(ref_opts, ref_params) for p in ps]
    assert_rel_err(flat(sums), flat(ref_sums), tol, f"{what}: sum")


# ---- the reference itself -----------------------------------------------------------------------


@pytest.mark.parametrize("config", TORCH_CONFIGS)
def test_reference_matches_torch_optim(config, gen):
    """HandAdagrad (used for adagrad_w_mode) is torch.optim.Adagrad in float64 where both apply."""
    inits, grads = make_problem([SHAPES], gen)
    _, torch_params = reference_run(inits, grads, [CONFIGS[config]], dtype=torch.float64)
    params = [torch.nn.Parameter(x.clone()) for x in inits[0]]
    hand = HandAdagrad(params, **dict(HYPER, **CONFIGS[config]))
    for step_grads in grads:
        for p, g in zip(params, step_grads[0]):
            p.grad = g.clone()
        hand.step()
    assert_rel_err(flat(params), flat(torch_params[0]), 1e-12, config)


# ---- FusedAdagrad trajectories ------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_adagrad_fp32_trajectory(device, config, gen):
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS[config]]
    opt, params = fused_run(inits, grads, hypers, dtype=torch.float32, device=device)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, config)
    assert opt.param_groups[0]["step"].item() == STEPS


def test_fused_adagrad_param_groups_differ(device, gen):
    """Groups with different lr, eps, lr_decay, accumulator start, decay modes and maximize in one
    optimizer each follow their own reference; a group added mid-run counts its own steps."""
    names = ["l2", "lr_decay_initial_accumulator", "l2_lr_decay_maximize_eps", "w_mode_lr_decay_maximize"]
    hypers = [dict(CONFIGS[n], lr=lr) for n, lr in zip(names, (2e-2, 5e-2, 3e-2, 1e-2))]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:], [(7, 3)], [(11,), (2, 2)]], gen)
    added_at = 6
    params = [[torch.nn.Parameter(x.float().to(device)) for x in g] for g in inits]
    ref_params = [[torch.nn.Parameter(x.float().double()) for x in g] for g in inits]
    opt = FusedAdagrad([dict(params=ps, **dict(HYPER, **h)) for ps, h in zip(params[:3], hypers[:3])], lr=0.5)
    ref_opts = [reference_optimizer(ps, h) for ps, h in zip(ref_params[:3], hypers[:3])]
    for k, step_grads in enumerate(grads):
        if k == added_at:
            opt.add_param_group(dict(params=params[3], **dict(HYPER, **hypers[3])))
            ref_opts.append(reference_optimizer(ref_params[3], hypers[3]))
        for gi in range(len(ref_opts)):
            for p, rp, g in zip(params[gi], ref_params[gi], step_grads[gi]):
                p.grad, rp.grad = g.float().to(device), g.float().double()
        opt.step()
        for o in ref_opts:
            o.step()
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "groups")
    assert [g["step"].item() for g in opt.param_groups] == [STEPS] * 3 + [STEPS - added_at]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["l2_lr_decay_maximize_eps", "w_mode_lr_decay_maximize"])
def test_fused_adagrad_master_weights(device, dtype, config, gen):
    """fp16/bf16 params with fp32 masters: the masters follow an fp32-accurate run fed the same
    (upcast) grads, and the model copy is the master rounded, bit for bit."""
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS[config]]
    opt, params = fused_run(inits, grads, hypers, dtype=dtype, device=device, master_weights=True)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=dtype)
    masters = [opt.state[p]["master_param"] for p in params[0]]
    assert all(m.dtype == torch.float32 for m in masters)
    check_against_reference(opt, params, ref_opts, ref_params, inits, dtype, 1e-5, "masters", weights=masters)
    for p, m in zip(params[0], masters):
        assert_bitwise_equal(p.detach(), m.to(dtype), "model copy != rounded master")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["l2", "lr_decay_initial_accumulator"])
def test_fused_adagrad_low_precision_without_masters(device, dtype, config, gen):
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
    assert rel_err(out - start, ref - start) < 0.5, "the low-precision params barely moved"


def test_fused_adagrad_lr_tensor(device, gen):
    """lr as a tensor gives the float lr's trajectory bit for bit, and an in-place change of the
    tensor takes effect at the next step."""
    inits, grads = make_problem([SHAPES], gen, steps=6)
    hyper = [CONFIGS["l2_lr_decay_maximize_eps"]]
    opt_a, pa = fused_run(inits, grads[:3], hyper, dtype=torch.float32, device=device, lr=1e-2)
    lr = torch.tensor(1e-2, device=device)
    opt_b, pb = fused_run(inits, grads[:3], hyper, dtype=torch.float32, device=device, lr=lr)
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


def assert_same_optimizer(a_params, a_opt, b_params, b_opt, what):
    """Params, every state tensor (masters and sums) and step counts equal bit for bit."""
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert_bitwise_equal(a.detach(), b.detach(), f"{what}: param {i}")
        assert sorted(a_opt.state[a]) == sorted(b_opt.state[b]), what
        for key in a_opt.state[a]:
            assert_bitwise_equal(a_opt.state[a][key], b_opt.state[b][key], f"{what}: state[{i}][{key}]")
    for ga, gb in zip(a_opt.param_groups, b_opt.param_groups):
        assert_bitwise_equal(ga["step"], gb["step"], f"{what}: step")


def _optimizer_tensors(params, opt):
    return [p.detach() for p in params] + [t for p in params for t in opt.state[p].values()] + \
        [g["step"] for g in opt.param_groups if "step" in g]


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.bfloat16, True)])
@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_grad_scaler_drives_fused_path(device, dtype, master_weights, where, value, gen):
    """torch.amp.GradScaler hands its scale and found_inf to FusedAdagrad.step: the steps equal
    FusedAdagrad fed the unscaled grads bit for bit (power-of-two scales divide exactly), and an
    injected inf/NaN skips the step bit-identically (lr_decay's count too) and backs the scale off."""
    steps, bad_step, scale0 = 8, 3, 2.0**10
    hyper = dict(HYPER, **CONFIGS["w_mode_lr_decay_maximize"])
    inits, coefs = make_problem([SHAPES], gen, steps=steps)
    pairs = []
    for _ in range(2):
        ps = [torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in inits[0]]
        pairs.append((ps, FusedAdagrad([dict(params=ps, **hyper)], master_weights=master_weights)))
    (pa, opt_a), (pb, opt_b) = pairs
    scaler = torch_grad_scaler(device, dtype, init_scale=scale0, growth_interval=1000)
    for k in range(steps):
        cs = [c.to(dtype).to(device) for c in coefs[k][0]]  # d loss / d p, exact in `dtype`
        opt_a.zero_grad()
        loss = sum((p.float() * c.float()).sum() for p, c in zip(pa, cs))
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        if k == bad_step:
            inject_non_finite(pa[2].grad, where, value, gen)
        state_before = snapshot(_optimizer_tensors(pa, opt_a))
        scaler.step(opt_a)
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


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.float16, True),
                                                  (torch.bfloat16, False)])
def test_state_dict_round_trip_continues_bit_identically(device, dtype, master_weights, gen):
    """Save after 10 steps (torch.save, torch.load(weights_only=True)) into a fresh model and
    optimizer; 10 more steps equal an uninterrupted 20-step run bit for bit."""
    hypers = [dict(HYPER, **CONFIGS["lr_decay_initial_accumulator"]),
              dict(HYPER, **CONFIGS["w_mode_lr_decay_maximize"]) | dict(lr=torch.tensor(3e-3))]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)

    def build(values):
        ps = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in g] for g in values]
        hs = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in h.items()} for h in hypers]
        return ps, FusedAdagrad([dict(params=p, **h) for p, h in zip(ps, hs)], master_weights=master_weights)

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
        assert state["sum"].dtype == torch.float32 and state["sum"].device == p.device
        assert ("master_param" in state) == (master_weights and dtype != torch.float32)
    run(resumed_p, resumed_opt, range(STEPS // 2, STEPS))
    assert_same_optimizer([p for g in resumed_p for p in g], resumed_opt, [p for g in full_p for p in g], full_opt,
                          "resumed vs uninterrupted")


def test_loads_torch_optim_adagrad_checkpoint(device, gen):
    """A torch.optim.Adagrad checkpoint (per-parameter step counts, none of Apex's options)
    resumes as if torch had gone on: sums and lr_decay's count carry over."""
    # No initial_accumulator_value in a group: torch.optim.Adagrad takes only its constructor's.
    hypers = [dict(lr_decay=0.03, weight_decay=0.01), CONFIGS["l2_lr_decay_maximize_eps"]]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    torch_params = [[torch.nn.Parameter(x.float()) for x in g] for g in inits]
    torch_hypers = [{k: v for k, v in dict(HYPER, **h).items() if k != "adagrad_w_mode"} for h in hypers]
    torch_opt = torch.optim.Adagrad([dict(params=ps, **h) for ps, h in zip(torch_params, torch_hypers)],
                                    foreach=False)
    for step_grads in grads[:STEPS // 2]:
        for ps, gs in zip(torch_params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.float()
        torch_opt.step()
    buf = io.BytesIO()
    torch.save(torch_opt.state_dict(), buf)
    buf.seek(0)
    params = [[torch.nn.Parameter(p.detach().to(device, copy=True)) for p in g] for g in torch_params]
    opt = FusedAdagrad([dict(params=ps) for ps in params], lr=0.5)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    assert [g["step"].item() for g in opt.param_groups] == [STEPS // 2] * 2
    for step_grads in grads[STEPS // 2:]:
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.float().to(device)
        opt.step()
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "from torch checkpoint")


# ---- constructor and hyper-parameters -----------------------------------------------------------


def test_constructor_matches_apex():
    """Apex's positional arguments and defaults, then torch.optim.Adagrad's and mixprec's
    keyword-only extras."""
    sig = inspect.signature(FusedAdagrad.__init__).parameters
    apex = dict(lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False)
    positional = [n for n, p in sig.items() if p.kind == p.POSITIONAL_OR_KEYWORD][2:]
    assert positional == list(apex)
    assert {n: sig[n].default for n in apex} == apex
    assert {n for n, p in sig.items() if p.kind == p.KEYWORD_ONLY} == {
        "lr_decay", "initial_accumulator_value", "maximize", "master_weights"}


def test_zero_grad_follows_set_grad_none(device):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    for set_grad_none in (False, True):
        p.grad = torch.ones_like(p)
        FusedAdagrad([p], set_grad_none=set_grad_none).zero_grad()
        assert (p.grad is None) if set_grad_none else bool((p.grad == 0).all())


def test_initial_accumulator_value_fills_state(device):
    p = torch.nn.Parameter(torch.ones(2, 3, device=device, dtype=torch.float16))
    opt = FusedAdagrad([p], initial_accumulator_value=0.25, master_weights=True)
    p.grad = torch.zeros_like(p)
    opt.step()  # a zero gradient leaves the sum at its start
    assert opt.state[p]["sum"].dtype == torch.float32 and bool((opt.state[p]["sum"] == 0.25).all())


BAD_HYPER = [dict(lr=-1e-3), dict(lr=math.nan), dict(lr=math.inf), dict(eps=-1e-10), dict(eps=math.nan),
             dict(weight_decay=-0.1), dict(weight_decay=math.inf), dict(lr_decay=-0.1), dict(lr_decay=math.nan),
             dict(initial_accumulator_value=-1.0), dict(initial_accumulator_value=math.inf)]


def _bad_id(d):
    return ",".join(f"{k}={v}" for k, v in d.items())


@pytest.mark.parametrize("bad", BAD_HYPER, ids=_bad_id)
def test_bad_hyper_parameters(bad):
    """Checked as defaults, in a param group at construction and in add_param_group (nothing added)."""
    p, q = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    with pytest.raises(ValueError):
        FusedAdagrad([p], **bad)
    with pytest.raises(ValueError):
        FusedAdagrad([dict(params=[p]), dict(params=[q], **bad)])
    opt = FusedAdagrad([p])
    with pytest.raises(ValueError):
        opt.add_param_group(dict(params=[q], **bad))
    assert len(opt.param_groups) == 1


def test_bad_group_value_at_step_modifies_nothing(device, gen):
    """A hyper-parameter made invalid after construction is caught by the op before any kernel
    runs: the error names it, and nothing has changed."""
    inits, grads = make_problem([SHAPES], gen, steps=1)
    params = [torch.nn.Parameter(x.float().to(device)) for x in inits[0]]
    opt = FusedAdagrad(params)
    for p, g in zip(params, grads[0][0]):
        p.grad = g.float().to(device)
    opt.param_groups[0]["lr_decay"] = -1.0
    with pytest.raises(ValueError, match="lr_decay"):
        opt.step()
    assert_unchanged(snapshot([x.float() for x in inits[0]]), [p.detach().cpu() for p in params], "params")
    assert float(opt.param_groups[0]["step"]) == 0
