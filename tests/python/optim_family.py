# Test logic shared by the FusedAdam, FusedSGD and FusedAdagrad test files, parametrized by a Family.
# Each test_<family>.py keeps its own test functions (and parametrizations) and calls these.
from __future__ import annotations

import inspect
import io
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from conftest import (
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

LOW = (torch.float16, torch.bfloat16)
STEPS = 20
SHAPES = [(17,), (5, 9), (3, 4, 2), (1,)]


def flat(tensors):
    return torch.cat([t.detach().to("cpu", torch.float64).flatten() for t in tensors])


def bad_id(d):
    return ",".join(f"{k}={v}" for k, v in d.items())


def make_problem(group_shapes, gen, steps=STEPS):
    """float64 initial values and `steps` fresh, never-zero gradients for each group's shapes."""
    inits = [[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
    grads = [[[random_tensor(s, torch.float64, "cpu", gen) for s in shapes] for shapes in group_shapes]
             for _ in range(steps)]
    return inits, grads


def _set_grads(params, step_grads, dtype, device):
    for ps, gs in zip(params, step_grads):
        for p, g in zip(ps, gs):
            p.grad = None if g is None else g.to(dtype).to(device)


@dataclass(frozen=True)
class Family:
    """What the shared tests need to know of one optimizer family."""
    cls: type  # the fused optimizer under test
    hyper: dict  # every option spelled out, so references never rely on defaults
    configs: dict  # named option sets of the trajectory tests
    # (params, hyper, *, hand=False, **kw) -> a float64 reference optimizer (torch.optim's where it
    # has the options, else the family's hand-written one; hand=True forces the latter).
    reference_optimizer: Callable
    # (opt, params, ref_opts, ref_params, tol, what) -> asserts the optimizer state matches the reference
    check_state: Callable

    def fused_run(self, inits, grads, hypers, *, dtype, device, master_weights=False, **kw):
        """The fused optimizer over params of `dtype` made from `inits`, fed `grads` cast to
        `dtype` (None: no grad); `kw` goes to the constructor and overrides the groups' options."""
        params = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in group] for group in inits]
        base = {k: v for k, v in self.hyper.items() if k not in kw}
        opt = self.cls([dict(params=ps, **dict(base, **h)) for ps, h in zip(params, hypers)],
                       master_weights=master_weights, **kw)
        for step_grads in grads:
            _set_grads(params, step_grads, dtype, device)
            opt.step()
        return opt, params

    def reference_run(self, inits, grads, hypers, *, dtype, run_dtype=torch.float64, device="cpu", **ref_kw):
        """One reference optimizer per group over params in `run_dtype` starting from the `dtype`
        values, fed the same `dtype`-rounded grads (upcast); run_dtype=dtype gives the plain-PyTorch peer."""
        params = [[torch.nn.Parameter(x.to(dtype).to(run_dtype).to(device, copy=True)) for x in group]
                  for group in inits]
        opts = [self.reference_optimizer(ps, h, **ref_kw) for ps, h in zip(params, hypers)]
        for step_grads in grads:
            for ps, gs in zip(params, step_grads):
                for p, g in zip(ps, gs):
                    p.grad = None if g is None else g.to(dtype).to(run_dtype).to(device)
            for o in opts:
                o.step()
        return opts, params


def check_against_reference(family, opt, params, ref_opts, ref_params, inits, dtype, tol, what, weights=None):
    """Weights (masters when kept) and the state within `tol` of the reference (rel err over all
    tensors together, docs/architecture.md's metric), and the weights' displacement from the start within 5 * tol."""
    ws = weights if weights is not None else [p for ps in params for p in ps]
    refs = [p for ps in ref_params for p in ps]
    start = flat([x.to(dtype) for g in inits for x in g])
    assert_rel_err(flat(ws), flat(refs), tol, f"{what}: weights")
    # The displacement is ~lr*steps, so this sees the update's own error, not just the weights'.
    # 5x: the sum of 20 rounded steps (torch's own fp32 AdamW makes 1e-5 to 2e-5 here).
    assert_rel_err(flat(ws) - start, flat(refs) - start, 5 * tol, f"{what}: displacement")
    family.check_state(opt, params, ref_opts, ref_params, tol, what)


# ---- the reference itself and trajectories ------------------------------------------------------


def reference_matches_torch_optim(family, config, gen, state_key=None):
    """The hand-written reference is torch.optim's optimizer in float64 where both apply (and so is
    its `state_key` state, when given)."""
    inits, grads = make_problem([SHAPES], gen)
    hyper = [family.configs[config]]
    torch_opts, torch_params = family.reference_run(inits, grads, hyper, dtype=torch.float64)
    params = [torch.nn.Parameter(x.clone()) for x in inits[0]]
    hand = family.reference_optimizer(params, family.configs[config], hand=True)
    for step_grads in grads:
        for p, g in zip(params, step_grads[0]):
            p.grad = g.clone()
        hand.step()
    assert_rel_err(flat(params), flat(torch_params[0]), 1e-12, config)
    if state_key is not None:
        for p, tp in zip(params, torch_params[0]):
            assert_rel_err(hand.state[p][state_key], torch_opts[0].state[tp][state_key], 1e-12, config)


def fp32_trajectory(family, device, config, gen):
    inits, grads = make_problem([SHAPES], gen)
    hypers = [family.configs[config]]
    opt, params = family.fused_run(inits, grads, hypers, dtype=torch.float32, device=device)
    ref_opts, ref_params = family.reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(family, opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, config)
    assert opt.param_groups[0]["step"].item() == STEPS


def param_groups_differ(family, names, lrs, device, gen):
    """Groups of the named configs with their own lrs, in one optimizer (whose default lr is
    another), each follow their own reference."""
    hypers = [dict(family.configs[n], lr=lr) for n, lr in zip(names, lrs)]
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:], [(7, 3)], [(11,), (2, 2)]], gen)
    opt, params = family.fused_run(inits, grads, hypers, dtype=torch.float32, device=device, lr=0.5)
    ref_opts, ref_params = family.reference_run(inits, grads, hypers, dtype=torch.float32)
    check_against_reference(family, opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, "groups")


def groups_added_mid_run(family, inits, grads, hypers, *, initial, added_at, device, what, **kw):
    """fp32 run with the first `initial` groups from the start and the others added by
    add_param_group before step `added_at` (grads of None: no grad that step), against the
    reference; each added group counts its own steps."""
    params = [[torch.nn.Parameter(x.float().to(device)) for x in g] for g in inits]
    ref_params = [[torch.nn.Parameter(x.float().double()) for x in g] for g in inits]
    opt = family.cls([dict(params=ps, **dict(family.hyper, **h)) for ps, h in zip(params[:initial], hypers)], **kw)
    ref_opts = [family.reference_optimizer(ps, h) for ps, h in zip(ref_params[:initial], hypers)]
    for k, step_grads in enumerate(grads):
        if k == added_at:
            for ps, rps, h in zip(params[initial:], ref_params[initial:], hypers[initial:]):
                opt.add_param_group(dict(params=ps, **dict(family.hyper, **h)))
                ref_opts.append(family.reference_optimizer(rps, h))
        for gi in range(len(ref_opts)):
            for p, rp, g in zip(params[gi], ref_params[gi], step_grads[gi]):
                p.grad = None if g is None else g.float().to(device)
                rp.grad = None if g is None else g.float().double()
        opt.step()
        for o in ref_opts:
            o.step()
    check_against_reference(family, opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5, what)
    assert [g["step"].item() for g in opt.param_groups] == [STEPS] * initial + [STEPS - added_at] * (
        len(inits) - initial)


def master_weights(family, device, dtype, config, gen):
    """fp16/bf16 params with fp32 masters: the masters follow an fp32-accurate run fed the same
    (upcast) grads, and the model copy is the master rounded, bit for bit, after every step."""
    inits, grads = make_problem([SHAPES], gen)
    hypers = [family.configs[config]]
    opt, params = family.fused_run(inits, grads, hypers, dtype=dtype, device=device, master_weights=True)
    ref_opts, ref_params = family.reference_run(inits, grads, hypers, dtype=dtype)
    masters = [opt.state[p]["master_param"] for p in params[0]]
    assert all(m.dtype == torch.float32 for m in masters)
    check_against_reference(family, opt, params, ref_opts, ref_params, inits, dtype, 1e-5, "masters", weights=masters)
    for p, m in zip(params[0], masters):
        assert_bitwise_equal(p.detach(), m.to(dtype), "model copy != rounded master")
    assert list(opt.master_params()) == masters


def low_precision_without_masters(family, device, dtype, config, gen, moved_below=0.5):
    """fp16/bf16 params updated in place: within 2x of plain PyTorch's error in that precision,
    and their displacement within `moved_below` (rel err) of the float64 one."""
    inits, grads = make_problem([SHAPES], gen)
    hypers = [family.configs[config]]
    opt, params = family.fused_run(inits, grads, hypers, dtype=dtype, device=device)
    _, ref_params = family.reference_run(inits, grads, hypers, dtype=dtype)
    _, peer_params = family.reference_run(inits, grads, hypers, dtype=dtype, run_dtype=dtype, device=device)
    out, ref, peer = flat(params[0]), flat(ref_params[0]), flat(peer_params[0])
    assert all(p.dtype == dtype for p in params[0]) and "master_param" not in opt.state[params[0][0]]
    assert_rel_err(out, ref, peer_bound(dtype, peer, ref), f"{dtype} params vs float64")
    start = flat([x.to(dtype) for x in inits[0]])
    assert rel_err(out - start, ref - start) < moved_below, "the low-precision params barely moved"


def lr_tensor(family, hypers, device, gen):
    """lr as a tensor gives the float lr's trajectory bit for bit, and an in-place change of the
    tensor (what a captured graph's scheduler does) takes effect at the next step."""
    inits, grads = make_problem([SHAPES], gen, steps=6)
    opt_a, pa = family.fused_run(inits, grads[:3], hypers, dtype=torch.float32, device=device, lr=1e-2)
    lr = torch.tensor(1e-2, device=device)
    opt_b, pb = family.fused_run(inits, grads[:3], hypers, dtype=torch.float32, device=device, lr=lr)
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


def optimizer_pair(family, inits, dtype, device, master_weights, hyper):
    """Two identical fused optimizers over identical params (one group of `inits`)."""
    out = []
    for _ in range(2):
        ps = [torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in inits]
        out.append((ps, family.cls([dict(params=ps, **hyper)], master_weights=master_weights)))
    return out


def assert_same_optimizer(a_params, a_opt, b_params, b_opt, what):
    """Params, every state tensor (masters included) and step counts equal bit for bit."""
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert_bitwise_equal(a.detach(), b.detach(), f"{what}: param {i}")
        assert sorted(a_opt.state[a]) == sorted(b_opt.state[b]), what
        for key in a_opt.state[a]:
            assert_bitwise_equal(a_opt.state[a][key], b_opt.state[b][key], f"{what}: state[{i}][{key}]")
    for ga, gb in zip(a_opt.param_groups, b_opt.param_groups):
        assert_bitwise_equal(ga["step"], gb["step"], f"{what}: step")


def optimizer_tensors(params, opt):
    return [p.detach() for p in params] + [t for p in params for t in opt.state[p].values()] + \
        [g["step"] for g in opt.param_groups if "step" in g]


def grad_scaler_drives_fused_path(family, config, device, dtype, master_weights, where, value, gen, *, steps,
                                  bad_step, bad_param):
    """torch.amp.GradScaler hands its scale and found_inf to the fused optimizer's step: the kernel
    leaves the grads unscaled (torch's fused contract), the steps equal the optimizer fed the
    unscaled grads bit for bit (power-of-two scales divide exactly), and an inf/NaN injected into
    param `bad_param`'s grad at step `bad_step` skips the step bit-identically (step counts and
    grads too) and backs the scale off."""
    scale0 = 2.0**10
    hyper = dict(family.hyper, **family.configs[config])
    inits, coefs = make_problem([SHAPES], gen, steps=steps)
    (pa, opt_a), (pb, opt_b) = optimizer_pair(family, inits[0], dtype, device, master_weights, hyper)
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
            inject_non_finite(pa[bad_param].grad, where, value, gen)
        grads_before = snapshot([p.grad for p in pa])
        state_before = snapshot(optimizer_tensors(pa, opt_a))
        scaler.step(opt_a)
        # The scaler's inf check multiplies by 1.0 in place, which may rewrite a NaN's payload.
        for i, (g0, p, c) in enumerate(zip(grads_before, pa, cs)):
            if k == bad_step:
                assert_bitwise_equal(p.grad, g0, f"grad {i} after a skipped step", nan_equal=True)
            else:
                assert_bitwise_equal(p.grad, c, f"grad {i} after GradScaler.step (unscaled by the kernel)")
        assert not hasattr(opt_a, "grad_scale") and not hasattr(opt_a, "found_inf")
        scaler.update()
        if k == bad_step:
            # Sliced: a skipped first step may still create (untouched) state and step counts.
            assert_unchanged(state_before, optimizer_tensors(pa, opt_a)[:len(state_before)], "skipped step")
            assert opt_a.param_groups[0]["step"].item() == k
            assert scaler.get_scale() == scale / 2
            continue
        assert scaler.get_scale() == scale
        for p, c in zip(pb, cs):
            p.grad = c
        opt_b.step()
        assert_same_optimizer(pa, opt_a, pb, opt_b, f"step {k}")
    assert opt_a.param_groups[0]["step"].item() == steps - 1


def grad_scaler_unscale_then_step(family, config, device, gen):
    """scaler.unscale_(opt) (for clipping) before scaler.step: the grads are unscaled once, by
    torch, and the fused step must not divide them again. (fp32: torch's unscale_ refuses fp16
    grads, and its CUDA kernel has no bf16.)"""
    hyper = dict(family.hyper, **family.configs[config])
    inits, coefs = make_problem([SHAPES], gen, steps=4)
    (pa, opt_a), (pb, opt_b) = optimizer_pair(family, inits[0], torch.float32, device, False, hyper)
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


def state_dict_round_trip(family, hypers, device, dtype, master_weights, gen, *, state_key, **opt_kw):
    """Save after 10 steps (torch.save, torch.load(weights_only=True)) into a fresh model and
    optimizer; 10 more steps equal an uninterrupted 20-step run bit for bit. The loaded
    `state_key` state keeps its dtype (fp32 unless opt_kw's state_dtype says) and the param's device."""
    state_dtype = opt_kw.get("state_dtype", torch.float32)
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)

    def build(values):
        ps = [[torch.nn.Parameter(x.to(dtype).to(device, copy=True)) for x in g] for g in values]
        hs = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in h.items()} for h in hypers]
        return ps, family.cls([dict(params=p, **h) for p, h in zip(ps, hs)], master_weights=master_weights, **opt_kw)

    def run(ps, opt, step_range):
        for k in step_range:
            _set_grads(ps, grads[k], dtype, device)
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
        assert state[state_key].dtype == state_dtype and state[state_key].device == p.device
        assert ("master_param" in state) == (master_weights and dtype != torch.float32)
    run(resumed_p, resumed_opt, range(STEPS // 2, STEPS))
    assert_same_optimizer([p for g in resumed_p for p in g], resumed_opt, [p for g in full_p for p in g], full_opt,
                          "resumed vs uninterrupted")


def loads_torch_optim_checkpoint(family, torch_cls, hypers, device, gen, *, apex_only, steps_kept=False):
    """A checkpoint of `torch_cls` (none of Apex's options: `apex_only` is left out) resumes as if
    torch had gone on; with steps_kept, torch's step counts are the groups' counts after loading."""
    inits, grads = make_problem([SHAPES[:2], SHAPES[2:]], gen)
    ref_opts, ref_params = family.reference_run(inits, grads, hypers, dtype=torch.float32)
    torch_params = [[torch.nn.Parameter(x.float()) for x in g] for g in inits]
    torch_hypers = [{k: v for k, v in dict(family.hyper, **h).items() if k != apex_only} for h in hypers]
    torch_opt = torch_cls([dict(params=ps, **h) for ps, h in zip(torch_params, torch_hypers)], foreach=False)
    for step_grads in grads[:STEPS // 2]:
        _set_grads(torch_params, step_grads, torch.float32, "cpu")
        torch_opt.step()
    buf = io.BytesIO()
    torch.save(torch_opt.state_dict(), buf)
    buf.seek(0)
    params = [[torch.nn.Parameter(p.detach().to(device, copy=True)) for p in g] for g in torch_params]
    opt = family.cls([dict(params=ps) for ps in params], lr=0.5)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    if steps_kept:
        assert [g["step"].item() for g in opt.param_groups] == [STEPS // 2] * 2
    for step_grads in grads[STEPS // 2:]:
        _set_grads(params, step_grads, torch.float32, device)
        opt.step()
    check_against_reference(family, opt, params, ref_opts, ref_params, inits, torch.float32, 1e-5,
                            "from torch checkpoint")


# ---- constructor and hyper-parameters -----------------------------------------------------------


def constructor_matches_apex(cls, apex, keyword_only):
    """Apex's positional arguments and defaults (`apex`, in order), then the `keyword_only` extras."""
    sig = inspect.signature(cls.__init__).parameters
    positional = [n for n, p in sig.items() if p.kind == p.POSITIONAL_OR_KEYWORD][2:]
    assert positional == list(apex)
    assert {n: sig[n].default for n in apex} == apex
    assert {n for n, p in sig.items() if p.kind == p.KEYWORD_ONLY} == keyword_only


def zero_grad_follows_set_grad_none(cls, device, **kw):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    for set_grad_none in (False, True):
        p.grad = torch.ones_like(p)
        cls([p], set_grad_none=set_grad_none, **kw).zero_grad()
        assert (p.grad is None) if set_grad_none else bool((p.grad == 0).all())


def bad_hyper_rejected_as_defaults(cls, bad, **required):
    with pytest.raises(ValueError):
        cls([torch.nn.Parameter(torch.ones(3))], **dict(required, **bad))


def bad_hyper_rejected_in_param_groups(cls, bad, **required):
    """A param group's own values are checked like the defaults, at construction and in
    add_param_group, not left to fail (or not) at some later step; nothing is added."""
    p, q = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    with pytest.raises(ValueError):
        cls([dict(params=[p]), dict(params=[q], **bad)], **required)
    opt = cls([p], **required)
    with pytest.raises(ValueError):
        opt.add_param_group(dict(params=[q], **bad))
    assert len(opt.param_groups) == 1


def bad_group_value_at_step_modifies_nothing(family, device, gen, group_shapes, *, group, key, value, match,
                                             **opt_kw):
    """A hyper-parameter (`key` of group `group`) made invalid after construction is caught by the
    op before any kernel runs, in whichever group it is: the error names it, no param or state
    has changed and no group has stepped."""
    inits, grads = make_problem(group_shapes, gen, steps=1)
    params = [[torch.nn.Parameter(x.float().to(device)) for x in g] for g in inits]
    opt = family.cls([dict(params=ps) for ps in params], **opt_kw)
    _set_grads(params, grads[0], torch.float32, device)
    opt.param_groups[group][key] = value
    flat_params = [p for g in params for p in g]
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_unchanged(snapshot([x.float() for g in inits for x in g]), [p.detach().cpu() for p in flat_params],
                     "params after a rejected step")
    # State made before the check (if any) is still at its zero start.
    assert all(not bool(t.any()) for p in flat_params for t in opt.state[p].values()), "state after a rejected step"
    assert all(float(g.get("step", 0)) == 0 for g in opt.param_groups), "a group stepped"
