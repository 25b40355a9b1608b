# Tests of the fused Adagrad op (mixprec.adagrad_) and mixprec.optimizers.fused_adagrad.FusedAdagrad
# on CPU and CUDA: 20-step trajectories against torch.optim.Adagrad in float64, low precision, masters.
from __future__ import annotations

import inspect
import io
import math

import pytest
import torch

import mixprec
from conftest import (
    torch_grad_scaler,
    CHUNK,
    NON_FINITE,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    boundary_sizes,
    check_rejected,
    inject_non_finite,
    peer_bound,
    poison_,
    random_tensor,
    rel_err,
    snapshot,
    sync,
    unaligned_view,
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


# ---- the op: mixprec.adagrad_ -------------------------------------------------------------------

OP_KEYS = ("params", "grads", "state_sums", "master_params")
OP_HYPER = dict(lr=0.1, eps=1e-3, weight_decay=0.05, lr_decay=0.1, adagrad_w_mode=False, maximize=False)
OP_CONFIGS = {
    "l2_lr_decay": {},
    "w_mode": dict(adagrad_w_mode=True),
    "maximize_eps": dict(maximize=True, eps=0.3, lr_decay=0.0),
    "no_decay": dict(weight_decay=0.0),
}


def op_lists(sizes, device, gen, *, dtype=torch.float32, grad_dtype=None, master=False):
    """Operands of one adagrad_ call in mid-run state: random weights and grads, positive sums."""
    dtypes = [dtype] if isinstance(dtype, torch.dtype) else dtype
    grad_dtypes = [grad_dtype or dtypes[0]] if isinstance(grad_dtype or dtypes[0], torch.dtype) else grad_dtype
    t = {k: [] for k in OP_KEYS}
    for i, n in enumerate(sizes):
        w = random_tensor(n, torch.float32, "cpu", gen)
        t["params"].append(w.to(dtypes[i % len(dtypes)]).to(device))
        t["grads"].append(random_tensor(n, grad_dtypes[i % len(grad_dtypes)], device, gen))
        t["state_sums"].append(random_tensor(n, torch.float32, device, gen).abs())
        if master:
            t["master_params"].append(w.to(device))  # the unrounded weight the model copy came from
    return t


def op_call(t, **kw):
    mixprec.adagrad_(t["params"], t["grads"], t["state_sums"], master_params=t["master_params"], **kw)


def op_clone(t):
    return {k: [x.clone() for x in v] for k, v in t.items()}


def op_all(t):
    return [x for k in OP_KEYS for x in t[k]]


def op_reference(t, *, step, **hyper):
    """float64 result (weights, sums) of one step over `t`, concatenated (element-wise update)."""
    return reference_step(flat(t["master_params"] or t["params"]), flat(t["grads"]), flat(t["state_sums"]),
                          step=step, **hyper)


def check_op_result(t, ref, tol, what):
    assert_rel_err(flat(t["master_params"] or t["params"]), ref[0], tol, f"{what}: weights")
    assert_rel_err(flat(t["state_sums"]), ref[1], tol, f"{what}: state_sums")
    for i, (p, m) in enumerate(zip(t["params"], t["master_params"])):
        assert_bitwise_equal(p, m.to(p.dtype), f"{what}: params[{i}] != rounded master")


@pytest.mark.parametrize("config", list(OP_CONFIGS))
def test_op_steps_match_reference(device, config, gen):
    """Three steps from a mid-run state (host step 1, 5, 6) against float64 math, fp32 throughout."""
    hyper = dict(OP_HYPER, **OP_CONFIGS[config])
    t = op_lists([17, 1, 300, 5], device, gen)
    for step in (1, 5, 6):
        t["grads"] = [random_tensor(g.shape, g.dtype, device, gen) for g in t["grads"]]
        ref = op_reference(t, step=step, **hyper)
        op_call(t, step=step, **hyper)
        check_op_result(t, ref, 1e-5, f"{config} step {step}")


def test_op_without_lr_decay_needs_no_step(device, gen):
    """Without lr_decay the step count is unused: step=0 and no step_tensor are fine."""
    hyper = dict(OP_HYPER, lr_decay=0.0)
    t = op_lists([9, 4], device, gen)
    ref = op_reference(t, step=1, **hyper)
    op_call(t, **hyper)
    check_op_result(t, ref, 1e-5, "no lr_decay, no step")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("master", [False, True], ids=["no_master", "master"])
def test_op_low_precision_is_rounded_fp32(device, dtype, grad_dtype, master, gen):
    """The fp16/bf16 step is the fp32 step, rounded once: without masters, fp32 params holding
    the upcast model copy; with masters, fp32 params holding the masters. Bit for bit."""
    hyper = dict(OP_HYPER, adagrad_w_mode=True)
    t = op_lists([33, 7, 130], device, gen, dtype=dtype, grad_dtype=grad_dtype, master=master)
    f = op_clone(t)
    f["master_params"] = []
    for step in (3, 4):
        f["params"] = [x.float().clone() for x in (t["master_params"] if master else t["params"])]
        op_call(t, step=step, **hyper)
        op_call(f, step=step, **hyper)
        for i, (lo, hi) in enumerate(zip(t["params"], f["params"])):
            assert_bitwise_equal(lo, hi.to(dtype), f"params[{i}]")
            if master:
                assert_bitwise_equal(t["master_params"][i], hi, f"master_params[{i}]")
        for i, (a, b) in enumerate(zip(t["state_sums"], f["state_sums"])):
            assert_bitwise_equal(a, b, f"state_sums[{i}]")


def test_op_mixed_dtypes_in_one_call(device, gen):
    """Params and grads of different dtypes side by side (one kernel per combination)."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    t = op_lists(list(range(1, 19)), device, gen, dtype=dtypes, grad_dtype=dtypes[::-1] + dtypes[:1], master=True)
    before = op_clone(t)
    op_call(t, step=2, **OP_HYPER)
    for i in range(18):
        ref = op_reference({k: v[i:i + 1] for k, v in before.items()}, step=2, **OP_HYPER)
        check_op_result({k: v[i:i + 1] for k, v in t.items()}, ref, 1e-5, f"tensor {i}")


def test_op_chunk_boundaries_and_unaligned_views(device, gen, rng):
    """Sizes straddling 64 Ki-element chunks plus views at odd offsets (no vector loads): the
    poisoned model copies (masters kept) are all written, every master and every sum changes,
    nothing outside a view is touched."""
    sizes = boundary_sizes(rng)
    t = op_lists(sizes, device, gen, dtype=torch.bfloat16, grad_dtype=torch.float16, master=True)
    hyper = dict(OP_HYPER, weight_decay=0.0)  # no decay: the step never cancels to zero
    bases = []
    for i in (0, 3):  # a master and a sum become unaligned views of larger buffers
        key = "master_params" if i == 0 else "state_sums"
        view, base = unaligned_view(sizes[i], torch.float32, device, gen)
        view.copy_(t[key][i])
        t[key][i] = view
        bases.append(base)
    edges = snapshot([b[0] for b in bases] + [b[-1] for b in bases])
    # Sums no larger than g^2, so each one grows by a visible fraction and each weight moves.
    for s, g in zip(t["state_sums"], t["grads"]):
        s.copy_(g.float().square() * 0.5)
    for x in t["params"]:
        poison_(x)
    start = op_clone(t)
    ref = op_reference(t, step=3, **hyper)
    op_call(t, step=3, **hyper)
    check_op_result(t, ref, 1e-5, "chunk boundaries")
    for key in ("master_params", "state_sums"):
        for i, (a, b) in enumerate(zip(t[key], start[key])):
            assert bool((a != b).all()), f"{key}[{i}] (size {a.numel()}) has elements that were not updated"
    assert_unchanged(edges, [b[0] for b in bases] + [b[-1] for b in bases], "outside the unaligned views")


def test_op_more_tensors_than_one_launch(device, gen, rng):
    """1500 tiny tensors with all four lists live: more than two launch tables (~640 entries for
    four lists); each tensor is checked on its own."""
    sizes = [rng.randint(1, 40) for _ in range(1500)]
    t = op_lists(sizes, device, gen, dtype=torch.float16, grad_dtype=torch.bfloat16, master=True)
    ref = op_reference(t, step=7, **OP_HYPER)
    op_call(t, step=7, **OP_HYPER)
    check_op_result(t, ref, 1e-5, "many tensors")
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    for i, (m, s) in enumerate(zip(t["master_params"], t["state_sums"])):
        assert_rel_err(m, ref[0][offsets[i]:offsets[i + 1]], 1e-5, f"master_params[{i}]")
        assert_rel_err(s, ref[1][offsets[i]:offsets[i + 1]], 1e-5, f"state_sums[{i}]")


def test_op_zero_size_and_empty_lists(device, gen):
    """Zero-size tensors are fine anywhere in the lists; all-zero-size lists still count the step;
    empty lists are a no-op."""
    t = op_lists([0, 5, 0, 9], device, gen, master=True)
    t["params"][1] = t["params"][1].half()
    for k in OP_KEYS:
        t[k][0] = torch.empty(3, 0, device=device)
    ref = op_reference(t, step=3, **OP_HYPER)
    op_call(t, step=3, **OP_HYPER)
    check_op_result(t, ref, 1e-5, "zero-size among others")

    z = op_lists([0, 0], device, gen)
    step = scalar(4.0, device)
    op_call(z, step_tensor=step, **OP_HYPER)
    assert step.item() == 5.0 and all(x.numel() == 0 for x in op_all(z))
    mixprec.adagrad_([], [], [], step=1, **OP_HYPER)


def test_op_step_tensor_equals_host_step(device, gen):
    """step_tensor (the count before this step, incremented on the device) gives exactly the host
    step's results through lr_decay."""
    a = op_lists([20, 3], device, gen, dtype=torch.float16, master=True)
    b = op_clone(a)
    count = scalar(0.0, device)
    for k in range(1, 4):
        a["grads"] = b["grads"] = [random_tensor(g.shape, g.dtype, device, gen) for g in a["grads"]]
        op_call(a, step=k, **OP_HYPER)
        op_call(b, step_tensor=count, **OP_HYPER)
        assert count.item() == k
        for key in OP_KEYS:
            for i, (x, y) in enumerate(zip(a[key], b[key])):
                assert_bitwise_equal(x, y, f"step {k}: {key}[{i}]")


def test_op_lr_tensor_equals_host_lr(device, gen):
    """lr_tensor wins over the host lr (given a different value here) and matches it bit for bit."""
    a = op_lists([20, 3], device, gen)
    b = op_clone(a)
    op_call(a, step=2, **OP_HYPER)
    op_call(b, step=2, lr_tensor=scalar(OP_HYPER["lr"], device), **dict(OP_HYPER, lr=0.5))
    for key in OP_KEYS:
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert_bitwise_equal(x, y, f"lr_tensor: {key}[{i}]")


@pytest.mark.parametrize("scale,grad_dtype", [(2.0**13, torch.float16), (2.0**-3, torch.bfloat16),
                                              (3.7, torch.float32)])
def test_op_grad_scale_unscales(device, scale, grad_dtype, gen):
    """grad_scale divides the grads in the kernel: equal to a step on pre-divided grads, bit for
    bit when the scale is a power of two, to fp32 rounding otherwise; grads are only read."""
    scaled = op_lists([CHUNK + 1, 9], device, gen, dtype=torch.float16, grad_dtype=grad_dtype, master=True)
    plain = op_clone(scaled)
    scaled["grads"] = [(g.double() * scale).to(grad_dtype) for g in scaled["grads"]]
    plain["grads"] = [(g.double() / scale).to(grad_dtype) for g in scaled["grads"]]
    exact = math.log2(scale).is_integer()
    scaled_grads = snapshot(scaled["grads"])
    op_call(scaled, step=3, grad_scale=scalar(scale, device), **OP_HYPER)
    op_call(plain, step=3, **OP_HYPER)
    assert_unchanged(scaled_grads, scaled["grads"], "grads (read-only)")
    for key in ("params", "master_params", "state_sums"):
        if exact:
            for i, (x, y) in enumerate(zip(scaled[key], plain[key])):
                assert_bitwise_equal(x, y, f"grad_scale={scale}: {key}[{i}]")
        elif key != "params":
            assert_rel_err(flat(scaled[key]), flat(plain[key]), 1e-6, key)


@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_op_found_inf_skips_everything(device, where, value, gen):
    """found_inf != 0 (GradScaler's flag; 2 when summed over devices): params, masters, sums and
    step_tensor stay bit-identical, whatever the grads hold. found_inf == 0 steps as if absent."""
    t = op_lists([CHUNK + 3, 4, 9], device, gen, dtype=torch.float16, master=True)
    count, lr, grad_scale = scalar(5.0, device), scalar(0.1, device), scalar(256.0, device)
    kw = dict(OP_HYPER, step_tensor=count, lr_tensor=lr, grad_scale=grad_scale)
    clean = op_clone(t)
    inject_non_finite(t["grads"][int(torch.randint(0, 3, (1,), generator=gen))], where, value, gen)
    for flag in (1.0, 2.0):
        before = snapshot(op_all(t) + [count, lr, grad_scale])
        op_call(t, found_inf=scalar(flag, device), **kw)
        sync(device)
        assert_unchanged(before, op_all(t) + [count, lr, grad_scale], f"found_inf={flag}")

    other, other_count = op_clone(clean), scalar(5.0, device)
    op_call(clean, found_inf=scalar(0.0, device), **kw)
    op_call(other, **dict(kw, step_tensor=other_count))
    assert count.item() == other_count.item() == 6.0
    for key in OP_KEYS:
        for i, (x, y) in enumerate(zip(clean[key], other[key])):
            assert_bitwise_equal(x, y, f"found_inf=0: {key}[{i}]")


def test_op_non_finite_grads_stay_element_wise(device, gen):
    """Without found_inf an inf/NaN gradient reaches only its own elements (torch's behaviour)."""
    t = op_lists([CHUNK + 7, 40], device, gen, master=True)
    positions = [inject_non_finite(t["grads"][0], w, v, gen) for w, v in zip(("first", "last", "random"), NON_FINITE)]
    finite = op_clone(t)
    for p in positions:
        finite["grads"][0].view(-1)[p] = 1.0
    op_call(t, step=2, **OP_HYPER)
    op_call(finite, step=2, **OP_HYPER)
    mask = torch.ones(t["grads"][0].numel(), dtype=torch.bool)
    mask[positions] = False
    for key in ("master_params", "state_sums"):
        got, want = t[key][0].cpu().view(-1), finite[key][0].cpu().view(-1)
        assert_bitwise_equal(got[mask], want[mask], f"{key}[0] away from the non-finite grads")
        assert not bool(got[~mask].isfinite().any()), f"{key}[0] hides a non-finite gradient"
        assert_bitwise_equal(t[key][1], finite[key][1], f"{key}[1]")


# ---- bad inputs ---------------------------------------------------------------------------------


def _set(key, i, fn):
    def edit(t, kw):
        t[key][i] = fn(t[key][i])
    return edit


def _kw(**changes):
    def edit(t, kw):
        kw.update(changes)
    return edit


def _noncontiguous(x):
    return x.t().contiguous().t()  # same shape and values, column-major


# name: (edit of the operands, exception, argument, list index or None)
BAD_INPUTS = {
    "grads_shorter": (lambda t, kw: t["grads"].pop(), ValueError, "grads", None),
    "state_sums_longer": (lambda t, kw: t["state_sums"].append(t["state_sums"][0].clone()), ValueError,
                          "state_sums", None),
    "state_sums_missing": (lambda t, kw: t.update(state_sums=[]), ValueError, "state_sums", None),
    "master_params_shorter": (lambda t, kw: t["master_params"].pop(), ValueError, "master_params", None),
    "grads_shape": (_set("grads", 1, lambda x: x.reshape(4, 3)), ValueError, "grads", 1),
    "state_sums_shape": (_set("state_sums", 2, lambda x: x[:-1].clone()), ValueError, "state_sums", 2),
    "params_noncontiguous": (_set("params", 1, _noncontiguous), RuntimeError, "params", 1),
    "state_sums_noncontiguous": (_set("state_sums", 1, _noncontiguous), RuntimeError, "state_sums", 1),
    "master_params_noncontiguous": (_set("master_params", 1, _noncontiguous), RuntimeError, "master_params", 1),
    "state_sums_fp16": (_set("state_sums", 2, lambda x: x.half()), TypeError, "state_sums", 2),
    "state_sums_bf16": (_set("state_sums", 0, lambda x: x.bfloat16()), TypeError, "state_sums", 0),
    "master_params_bf16": (_set("master_params", 1, lambda x: x.bfloat16()), TypeError, "master_params", 1),
    "params_fp64": (_set("params", 2, lambda x: x.double()), TypeError, "params", 2),
    "grads_int": (_set("grads", 0, lambda x: x.int()), TypeError, "grads", 0),
    "step_zero": (_kw(step=0), ValueError, "step", None),
    "lr_negative": (_kw(lr=-1e-3), ValueError, "lr", None),
    "lr_inf": (_kw(lr=math.inf), ValueError, "lr", None),
    "eps_negative": (_kw(eps=-1e-10), ValueError, "eps", None),
    "weight_decay_nan": (_kw(weight_decay=math.nan), ValueError, "weight_decay", None),
    "lr_decay_negative": (_kw(lr_decay=-0.1), ValueError, "lr_decay", None),
}


def _bad_scalar_cases(device):
    z = lambda *a, **k: torch.zeros(*a, device=device, **k)
    return {
        "step_tensor_fp64": (_kw(step_tensor=z(1, dtype=torch.float64)), TypeError, "step_tensor", None),
        "lr_tensor_two_elements": (_kw(lr_tensor=z(2)), ValueError, "lr_tensor", None),
        "grad_scale_int": (_kw(grad_scale=z(1, dtype=torch.int32)), TypeError, "grad_scale", None),
        "found_inf_empty": (_kw(found_inf=z(0)), ValueError, "found_inf", None),
    }


def _run_bad_case(device, gen, case):
    edit, exc, arg, index = case
    t = op_lists([6, (3, 4), 5], device, gen, dtype=torch.float16, master=True)
    kw = dict(OP_HYPER, step=3)
    edit(t, kw)
    scalars = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    check_rejected(lambda: op_call(t, **kw), op_all(t) + scalars, exc, OP, arg, index, device)


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_op_rejects_bad_inputs(device, name, gen):
    """The error names the op, the argument and the list index, and nothing is modified."""
    _run_bad_case(device, gen, BAD_INPUTS[name])


@pytest.mark.parametrize("name", ["step_tensor_fp64", "lr_tensor_two_elements", "grad_scale_int", "found_inf_empty"])
def test_op_rejects_bad_device_scalars(device, name, gen):
    _run_bad_case(device, gen, _bad_scalar_cases(device)[name])


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["grads", "state_sums", "master_params", "step_tensor", "found_inf", "grad_scale"])
def test_op_rejects_wrong_device(name, gen):
    """One operand on the CPU while the op runs on CUDA."""
    t = op_lists([6, (3, 4), 5], "cuda", gen, dtype=torch.float16, master=True)
    kw = dict(OP_HYPER, step=3)
    if name in t:
        t[name][1] = t[name][1].cpu()
        index = 1
    else:
        kw[name] = scalar(1.0 if name != "found_inf" else 0.0, "cpu")
        index = None
    scalars = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    check_rejected(lambda: op_call(t, **kw), op_all(t) + scalars, RuntimeError, OP, name, index, "cuda")


# ---- opcheck ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["fp32_host_scalars", "bf16_master_device_scalars"])
def test_opcheck(device, variant, gen):
    """Schema (mutation annotations), fake-tensor (Meta) and functionalization checks."""
    full = variant != "fp32_host_scalars"
    t = op_lists([5, (3, 4), 70], device, gen, dtype=torch.bfloat16 if full else torch.float32, master=full)
    kwargs = dict(OP_HYPER)
    step_tensor = None
    if full:
        step_tensor = scalar(2.0, device)
        kwargs.update(lr_tensor=scalar(0.1, device), grad_scale=scalar(8.0, device), found_inf=scalar(0.0, device))
    else:
        kwargs["step"] = 3
    args = (t["params"], t["grads"], t["state_sums"], t["master_params"], step_tensor)
    torch.library.opcheck(torch.ops.mixprec.adagrad_.default, args, kwargs)
