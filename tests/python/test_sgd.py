# Tests of mixprec.optimizers.FusedSGD on CPU and CUDA: 20-step trajectories against torch.optim.SGD
# in float64, low precision and master weights, torch.amp.GradScaler, checkpoints, hyper-parameters.
from __future__ import annotations

import inspect
import io
import math

import pytest
import torch
from torch.optim.optimizer import required

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
from mixprec.optimizers.fused_sgd import FusedSGD

OP = "sgd_"
LOW = (torch.float16, torch.bfloat16)
STEPS = 20
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
SHAPES = [(17,), (5, 9), (3, 4, 2), (1,)]


def scalar(value: float, device) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def flat(tensors):
    return torch.cat([t.detach().to("cpu", torch.float64).flatten() for t in tensors])


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


def make_problem(group_shapes, gen, steps=STEPS):
    """float64 initial values and `steps` fresh, never-zero gradients for each group's shapes."""
    inits = [[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
    grads = [[[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
             for _ in range(steps)]
    return inits, grads


def fused_run(inits, grads, hypers, *, dtype, device, master_weights=False, **kw):
    """FusedSGD over params of `dtype` made from `inits`, fed `grads` cast to `dtype` (None: no grad)."""
    params = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in group] for group in inits]
    base = {k: v for k, v in HYPER.items() if k not in kw}
    opt = FusedSGD([dict(params=ps, **dict(base, **h)) for ps, h in zip(params, hypers)],
                   master_weights=master_weights, **kw)
    for step_grads in grads:
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = None if g is None else g.to(dtype).to(device)
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
                p.grad = None if g is None else g.to(dtype).to(run_dtype).to(device)
        for o in opts:
            o.step()
    return opts, params


def buffers(opt, params):
    return [opt.state[p].get("momentum_buffer") for ps in params for p in ps]


def check_against_reference(opt, params, ref_opts, ref_params, inits, dtype, tol, what, weights=None):
    """Weights (masters when kept) and momentum buffers within `tol` of the reference (rel err over
    all tensors together), and the weights' displacement from the start within 5 * tol."""
    ws = weights if weights is not None else [p for ps in params for p in ps]
    refs = [p for ps in ref_params for p in ps]
    start = flat([x.to(dtype) for g in inits for x in g])
    assert_rel_err(flat(ws), flat(refs), tol, f"{what}: weights")
    # The displacement is ~lr*steps, so this sees the update's own error, not just the weights'.
    assert_rel_err(flat(ws) - start, flat(refs) - start, 5 * tol, f"{what}: displacement")
    ref_bufs = [o.state.get(p, {}).get("momentum_buffer") for o, ps in zip(ref_opts, ref_params) for p in ps]
    ours = buffers(opt, params)
    assert [b is None for b in ours] == [b is None for b in ref_bufs], f"{what}: which params have buffers"
    pairs = [(a, r) for a, r in zip(ours, ref_bufs) if a is not None]
    if pairs:
        assert all(a.dtype == torch.float32 for a, _ in pairs)
        assert_rel_err(flat([a for a, _ in pairs]), flat([r for _, r in pairs]), tol, f"{what}: momentum_buffer")


# ---- the reference itself -----------------------------------------------------------------------


@pytest.mark.parametrize("config", TORCH_CONFIGS)
def test_reference_matches_torch_optim(config, gen):
    """HandSGD (used for wd_after_momentum) is torch.optim.SGD in float64 where both apply."""
    inits, grads = make_problem([SHAPES], gen)
    _, torch_params = reference_run(inits, grads, [CONFIGS[config]], dtype=torch.float64)
    params = [torch.nn.Parameter(x.clone()) for x in inits[0]]
    hand = HandSGD(params, **dict(HYPER, **CONFIGS[config]))
    for step_grads in grads:
        for p, g in zip(params, step_grads[0]):
            p.grad = g.clone()
        hand.step()
    assert_rel_err(flat(params), flat(torch_params[0]), 1e-12, config)


# ---- FusedSGD trajectories ----------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_sgd_fp32_trajectory(device, config, gen):
    inits, grads = make_problem([SHAPES], gen)
    hypers = [CONFIGS[config]]
    opt, params = fused_run(inits, grads, hypers, dtype=torch.float32, device=device)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, config)
    assert opt.param_groups[0]["step"].item() == STEPS


def test_fused_sgd_param_groups_differ(device, gen):
    """Groups with different lr, momentum, dampening, Nesterov, decay placement and maximize in
    one optimizer each follow their own reference."""
    names = ["plain", "momentum_dampening_wd", "nesterov_wd_maximize", "wd_after_momentum"]
    hypers = [dict(CONFIGS[n], lr=lr) for n, lr in zip(names, (2e-2, 1e-2, 5e-3, 3e-2))]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:], [(7, 3)], [(11,), (2, 2)]], gen)
    opt, params = fused_run(inits, grads, hypers, dtype=torch.float32, device=device, lr=0.5)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "groups")


@pytest.mark.parametrize("config", ["momentum_dampening_wd", "momentum"])
def test_fused_sgd_late_params_start_their_own_buffer(device, config, gen):
    """A param whose first gradient comes after the group's first step starts its buffer at that
    gradient, as torch.optim.SGD does (dampening makes the difference visible), and a group
    added mid-run starts its own step count."""
    hypers = [CONFIGS[config], dict(CONFIGS["momentum_dampening_wd"], lr=2e-2)]
    inits, grads = make_problem([SHAPES, [(6,), (2, 3)]], gen)
    late = {1: 4, 3: 9}  # param index of group 0 -> first step with a grad
    added_at = 5
    for k, step_grads in enumerate(grads):
        for i, first in late.items():
            if k < first:
                step_grads[0][i] = None
    params = [[torch.nn.Parameter(x.float().to(device)) for x in g] for g in inits]
    ref_params = [[torch.nn.Parameter(x.float().double()) for x in g] for g in inits]
    opt = FusedSGD([dict(params=params[0], **dict(HYPER, **hypers[0]))])
    ref_opts = [reference_optimizer(ref_params[0], hypers[0])]
    for k, step_grads in enumerate(grads):
        if k == added_at:
            opt.add_param_group(dict(params=params[1], **dict(HYPER, **hypers[1])))
            ref_opts.append(reference_optimizer(ref_params[1], hypers[1]))
        for gi in range(len(ref_opts)):
            for p, rp, g in zip(params[gi], ref_params[gi], step_grads[gi]):
                p.grad = None if g is None else g.float().to(device)
                rp.grad = None if g is None else g.float().double()
        opt.step()
        for o in ref_opts:
            o.step()
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "late params")
    assert [g["step"].item() for g in opt.param_groups] == [STEPS, STEPS - added_at]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["momentum_dampening_wd", "nesterov_wd_maximize", "wd_after_momentum"])
def test_fused_sgd_master_weights(device, dtype, config, gen):
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
    assert list(opt.master_params()) == masters


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", ["weight_decay", "momentum_dampening_wd", "nesterov_wd_maximize"])
def test_fused_sgd_low_precision_without_masters(device, dtype, config, gen):
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


def test_fused_sgd_lr_tensor(device, gen):
    """lr as a tensor gives the float lr's trajectory bit for bit, and an in-place change of the
    tensor takes effect at the next step."""
    inits, grads = make_problem([SHAPES], gen, steps=6)
    hyper = [CONFIGS["momentum_dampening_wd"]]
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
    """Params, every state tensor (masters and buffers) and step counts equal bit for bit."""
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
@pytest.mark.parametrize("bad_step", [0, 4])
@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_grad_scaler_drives_fused_path(device, dtype, master_weights, bad_step, where, value, gen):
    """torch.amp.GradScaler hands its scale and found_inf to FusedSGD.step: the steps equal
    FusedSGD fed the unscaled grads bit for bit (power-of-two scales divide exactly), and an
    injected inf/NaN skips the step bit-identically and backs the scale off. Skipping the very
    first step leaves the next one a first step (its buffer is the gradient)."""
    steps, scale0 = 8, 2.0**10
    hyper = dict(HYPER, **CONFIGS["momentum_dampening_wd"])
    inits, coefs = make_problem([SHAPES], gen, steps=steps)
    pairs = []
    for _ in range(2):
        ps = [torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in inits[0]]
        pairs.append((ps, FusedSGD([dict(params=ps, **hyper)], master_weights=master_weights)))
    (pa, opt_a), (pb, opt_b) = pairs
    scaler = torch_grad_scaler(device, dtype, init_scale=scale0, growth_interval=1000)
    for k in range(steps):
        cs = [c.to(dtype).to(device) for c in coefs[k][0]]  # d loss / d p, exact in `dtype`
        opt_a.zero_grad()
        loss = sum((p.float() * c.float()).sum() for p, c in zip(pa, cs))
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        if k == bad_step:
            inject_non_finite(pa[1].grad, where, value, gen)
        state_before = snapshot(_optimizer_tensors(pa, opt_a))
        scaler.step(opt_a)
        assert not hasattr(opt_a, "grad_scale") and not hasattr(opt_a, "found_inf")
        scaler.update()
        if k == bad_step:
            assert_unchanged(state_before, _optimizer_tensors(pa, opt_a)[:len(state_before)], "skipped step")
            assert opt_a.param_groups[0]["step"].item() == k
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
    hypers = [dict(HYPER, **CONFIGS["momentum_dampening_wd"]),
              dict(HYPER, **CONFIGS["wd_after_momentum_nesterov_maximize"]) | dict(lr=torch.tensor(3e-3))]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)

    def build(values):
        ps = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in g] for g in values]
        hs = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in h.items()} for h in hypers]
        return ps, FusedSGD([dict(params=p, **h) for p, h in zip(ps, hs)], master_weights=master_weights)

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
        assert state["momentum_buffer"].dtype == torch.float32 and state["momentum_buffer"].device == p.device
        assert ("master_param" in state) == (master_weights and dtype != torch.float32)
    run(resumed_p, resumed_opt, range(STEPS // 2, STEPS))
    assert_same_optimizer([p for g in resumed_p for p in g], resumed_opt, [p for g in full_p for p in g], full_opt,
                          "resumed vs uninterrupted")


def test_loads_torch_optim_sgd_checkpoint(device, gen):
    """A torch.optim.SGD checkpoint (buffers, no state for a momentum-free group, no step count,
    none of Apex's options) resumes as if torch had gone on: the buffers are not restarted."""
    hypers = [CONFIGS["momentum_dampening_wd"], CONFIGS["weight_decay"]]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)
    ref_opts, ref_params = reference_run(inits, grads, hypers, dtype=torch.float32)
    torch_params = [[torch.nn.Parameter(x.float()) for x in g] for g in inits]
    torch_hypers = [{k: v for k, v in dict(HYPER, **h).items() if k != "wd_after_momentum"} for h in hypers]
    torch_opt = torch.optim.SGD([dict(params=ps, **h) for ps, h in zip(torch_params, torch_hypers)], foreach=False)
    for step_grads in grads[:STEPS // 2]:
        for ps, gs in zip(torch_params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.float()
        torch_opt.step()
    buf = io.BytesIO()
    torch.save(torch_opt.state_dict(), buf)
    buf.seek(0)
    params = [[torch.nn.Parameter(p.detach().to(device, copy=True)) for p in g] for g in torch_params]
    opt = FusedSGD([dict(params=ps) for ps in params], lr=0.5)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    for step_grads in grads[STEPS // 2:]:
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = g.float().to(device)
        opt.step()
    check_against_reference(opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "from torch checkpoint")


# ---- constructor and hyper-parameters -----------------------------------------------------------


def test_constructor_matches_apex():
    """Apex's positional arguments and defaults, then mixprec's keyword-only extras."""
    sig = inspect.signature(FusedSGD.__init__).parameters
    apex = dict(lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False, wd_after_momentum=False,
                materialize_master_grads=True, set_grad_none=False)
    positional = [n for n, p in sig.items() if p.kind == p.POSITIONAL_OR_KEYWORD][2:]
    assert positional == list(apex)
    assert {n: sig[n].default for n in apex} == apex
    assert {n for n, p in sig.items() if p.kind == p.KEYWORD_ONLY} == {"master_weights", "maximize"}
    with pytest.raises(ValueError, match="lr"):
        FusedSGD([torch.nn.Parameter(torch.ones(3))])  # lr is required, as in Apex


def test_zero_grad_follows_set_grad_none(device):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    for set_grad_none in (False, True):
        p.grad = torch.ones_like(p)
        FusedSGD([p], lr=0.1, set_grad_none=set_grad_none).zero_grad()
        assert (p.grad is None) if set_grad_none else bool((p.grad == 0).all())


BAD_HYPER = [dict(lr=-1e-3), dict(lr=math.nan), dict(lr=math.inf), dict(momentum=-0.1), dict(momentum=math.nan),
             dict(weight_decay=-0.1), dict(weight_decay=math.inf), dict(dampening=math.nan),
             dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1)]


def _bad_id(d):
    return ",".join(f"{k}={v}" for k, v in d.items())


@pytest.mark.parametrize("bad", BAD_HYPER, ids=_bad_id)
def test_bad_hyper_parameters(bad):
    """Checked as defaults, in a param group at construction and in add_param_group (nothing added)."""
    p, q = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    with pytest.raises(ValueError):
        FusedSGD([p], **dict(dict(lr=0.1), **bad))
    with pytest.raises(ValueError):
        FusedSGD([dict(params=[p]), dict(params=[q], **bad)], lr=0.1)
    opt = FusedSGD([p], lr=0.1)
    with pytest.raises(ValueError):
        opt.add_param_group(dict(params=[q], **bad))
    assert len(opt.param_groups) == 1


def test_bad_group_value_at_step_modifies_nothing(device, gen):
    """A hyper-parameter made invalid after construction is caught by the op before any kernel
    runs: the error names it, and nothing has changed."""
    inits, grads = make_problem([SHAPES], gen, steps=1)
    params = [torch.nn.Parameter(x.float().to(device)) for x in inits[0]]
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    for p, g in zip(params, grads[0][0]):
        p.grad = g.float().to(device)
    opt.param_groups[0]["momentum"] = -1.0
    with pytest.raises(ValueError, match="momentum"):
        opt.step()
    assert_unchanged(snapshot([x.float() for x in inits[0]]), [p.detach().cpu() for p in params], "params")
    assert float(opt.param_groups[0]["step"]) == 0
