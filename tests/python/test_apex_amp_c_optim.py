# Tests of the optimizer ops of mixprec's amp_C stand-in (multi_tensor_sgd/adam/lamb/novograd):
# Apex's argument lists against float64 re-implementations of Apex's update rules and torch.optim,
# for a few steps, with each Apex kernel's noop_flag rule and refused input changing nothing.
from __future__ import annotations

import math

import pytest
import torch

from conftest import CHUNK, assert_rel_err, assert_unchanged, random_tensor, snapshot
from mixprec.apex_compat import amp_c
from mixprec.apex_compat.multi_tensor_apply import multi_tensor_applier
from test_sgd import reference_step  # the float64 SGD rule

SIZES = (0, 5, CHUNK + 3, 33)


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def rand(gen, device, dtype=torch.float32, sizes=SIZES, scale=1.0):
    return [random_tensor(n, dtype, device, gen, scale) for n in sizes]


def f64(ts):
    return [t.detach().double().cpu() for t in ts]


# ---- SGD --------------------------------------------------------------------------------------------

def sgd_reference(g, w, buf, wd, momentum, dampening, lr, nesterov, first_run, wd_after, scale):
    """Apex's SGD kernel per element in float64: torch.optim.SGD's rule (test_sgd's reference)
    on the gradient times Apex's ``scale``."""
    return reference_step(w, g * scale, buf, first=first_run, lr=lr, momentum=momentum, dampening=dampening,
                          weight_decay=wd, nesterov=nesterov, maximize=False, wd_after_momentum=wd_after)


@pytest.mark.parametrize("momentum,dampening,nesterov,wd_after", [(0.9, 0.0, False, False), (0.9, 0.0, True, False),
                                                                  (0.8, 0.3, False, True), (0.0, 0.0, False, False)])
@pytest.mark.parametrize("four_lists", [False, True])
def test_sgd_vs_float64(device, gen, momentum, dampening, nesterov, wd_after, four_lists):
    grad_dtype = torch.float16 if four_lists else torch.float32
    w = rand(gen, device)
    m = [torch.zeros_like(t) for t in w]
    model = [t.half() for t in w]
    rw, rm = f64(w), f64(m)
    for step in range(3):
        g = rand(gen, device, grad_dtype, scale=64.0)
        lists = [g, w, m, model] if four_lists else [g, w, m]
        before = snapshot(g)
        multi_tensor_applier(amp_c.multi_tensor_sgd, flag(device), lists, 0.01, momentum, dampening, 0.1,
                             nesterov, step == 0, wd_after, 1 / 64)
        assert_unchanged(before, g, "grads")
        for i in range(len(w)):
            rw[i], rm[i] = sgd_reference(g[i].double().cpu(), rw[i], rm[i], 0.01, momentum, dampening, 0.1, nesterov,
                                         step == 0, wd_after, 1 / 64)
    for i in range(len(w)):
        assert_rel_err(w[i], rw[i], 1e-5, f"weights[{i}]")
        if momentum:
            assert_rel_err(m[i], rm[i], 1e-5, f"momentum[{i}]")
        if four_lists:  # the model copy is the fp32 weight rounded
            assert torch.equal(model[i], w[i].half())


def test_sgd_matches_torch_sgd(device, gen):
    p = rand(gen, device, sizes=(7, 300))
    ref = [t.clone().requires_grad_() for t in p]
    opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
    m = [torch.zeros_like(t) for t in p]
    for step in range(3):
        g = rand(gen, device, sizes=(7, 300))
        for r, gi in zip(ref, g):
            r.grad = gi.clone()
        opt.step()
        amp_c.multi_tensor_sgd(65536, flag(device), [g, p, m], 0.01, 0.9, 0.0, 0.05, True, step == 0, False, 1.0)
    for a, r in zip(p, ref):
        assert_rel_err(a, r, 1e-6, "torch.optim.SGD")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nesterov,wd", [(False, 0.0), (True, 2.0 ** -7)])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -6])
def test_sgd_low_precision_momentum_matches_torch_sgd(device, gen, dtype, nesterov, wd, scale):
    """Apex's all-fp16 case (grads, weights and momentum in one low dtype) steps as torch.optim.SGD
    steps fp16/bf16 params, bit for bit: powers-of-two hyper-parameters make every product exact,
    so the roundings fall on the sums alone (test_sgd_momentum_dtype says why); `scale` is a power
    of two, exact too. The buffers stay in `dtype`."""
    sizes = (7, CHUNK + 3)
    p = [(torch.rand(n, generator=gen) - 0.5).to(device, dtype) for n in sizes]
    ref = [torch.nn.Parameter(t.clone()) for t in p]
    opt = torch.optim.SGD(ref, lr=0.25, momentum=0.125, weight_decay=wd, nesterov=nesterov)
    m = [torch.zeros_like(t) for t in p]
    for step in range(4):
        g = [(torch.rand(n, generator=gen) - 0.5).to(device, dtype) for n in sizes]
        for r, gi in zip(ref, g):
            r.grad = gi * scale  # Apex's kernel multiplies the grads by `scale`: exact, a power of two
        opt.step()
        amp_c.multi_tensor_sgd(65536, flag(device), [g, p, m], wd, 0.125, 0.0, 0.25, nesterov, step == 0, False,
                               scale)
        for i, (a, r) in enumerate(zip(p, ref)):
            assert m[i].dtype == dtype
            assert torch.equal(m[i], opt.state[r]["momentum_buffer"]), f"step {step}: momentum[{i}]"
            assert torch.equal(a, r.detach()), f"step {step}: weights[{i}]"


def test_sgd_skips_on_a_set_flag_and_never_sets_it(device, gen):
    w, g = rand(gen, device), rand(gen, device)
    m = rand(gen, device)
    noop = flag(device, 1)
    before = snapshot(w + g + m)
    amp_c.multi_tensor_sgd(65536, noop, [g, w, m], 0.01, 0.9, 0.0, 0.1, False, False, False, 1.0)
    assert_unchanged(before, w + g + m, "set flag: nothing")
    assert noop.item() == 1
    g[1].view(-1)[0] = math.inf  # Apex's SGD kernel reads the flag only
    noop.zero_()
    amp_c.multi_tensor_sgd(65536, noop, [g, w, m], 0.0, 0.0, 0.0, 0.1, False, False, False, 1.0)
    assert noop.item() == 0 and math.isinf(w[1].view(-1)[0].item())


# ---- Adam -------------------------------------------------------------------------------------------

def adam_reference(g, p, m, v, lr, b1, b2, eps, step, mode, bias_correction, wd):
    """Apex's Adam kernel per element, in float64."""
    c1 = 1 - b1 ** step if bias_correction else 1.0
    c2 = 1 - b2 ** step if bias_correction else 1.0
    if mode == 0:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / c1) / ((v / c2).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    return p - lr * update, m, v


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_adam_vs_float64(device, gen, mode, bias_correction, dtype):
    p = rand(gen, device, dtype)
    m = [torch.zeros_like(t, dtype=torch.float32) for t in p]
    v = [torch.zeros_like(t, dtype=torch.float32) for t in p]
    rp, rm, rv = f64(p), f64(m), f64(v)
    for step in range(1, 4):
        g = rand(gen, device, dtype)
        noop = flag(device)
        multi_tensor_applier(amp_c.multi_tensor_adam, noop, [g, p, m, v], 1e-2, 0.9, 0.99, 1e-8, step, mode,
                             bias_correction, 0.05)
        assert noop.item() == 0
        for i in range(len(p)):
            rp[i], rm[i], rv[i] = adam_reference(g[i].double().cpu(), rp[i].to(dtype).double() if dtype != torch.float32
                                                 else rp[i], rm[i], rv[i], 1e-2, 0.9, 0.99, 1e-8, step, mode,
                                                 bias_correction, 0.05)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for i in range(len(p)):
        assert_rel_err(p[i], rp[i], tol, f"params[{i}]")
        assert_rel_err(m[i], rm[i], 1e-5, f"exp_avg[{i}]")


@pytest.mark.parametrize("mode,torch_opt", [(0, torch.optim.Adam), (1, torch.optim.AdamW)])
def test_adam_matches_torch(device, gen, mode, torch_opt):
    p = rand(gen, device, sizes=(9, 1000))
    ref = [t.clone().requires_grad_() for t in p]
    opt = torch_opt(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    for step in range(1, 4):
        g = rand(gen, device, sizes=(9, 1000))
        for r, gi in zip(ref, g):
            r.grad = gi.clone()
        opt.step()
        amp_c.multi_tensor_adam(65536, flag(device), [g, p, m, v], 1e-2, 0.9, 0.99, 1e-8, step, mode, 1, 0.05)
    for a, r in zip(p, ref):
        assert_rel_err(a, r, 1e-5, torch_opt.__name__)


def test_adam_ignores_the_flag_like_apex(device, gen):
    p, g = rand(gen, device, sizes=(4,)), rand(gen, device, sizes=(4,))
    m, v = [torch.zeros(4, device=device)], [torch.zeros(4, device=device)]
    before = snapshot(p)
    noop = flag(device, 1)
    amp_c.multi_tensor_adam(65536, noop, [g, p, m, v], 1e-2, 0.9, 0.99, 1e-8, 1, 1, 1, 0.0)
    assert noop.item() == 1 and not torch.equal(p[0], before[0])


# ---- Adagrad ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0, 1])
def test_adagrad_vs_float64(device, gen, mode):
    p = rand(gen, device)
    h = [torch.full_like(t, 0.1) for t in p]
    rp, rh = f64(p), f64(h)
    for _ in range(3):
        g = rand(gen, device)
        before = snapshot(g)
        multi_tensor_applier(amp_c.multi_tensor_adagrad, flag(device), [g, p, h], 1e-2, 1e-10, mode, 0.05)
        assert_unchanged(before, g, "grads")
        for i in range(len(p)):  # Apex's kernel, in float64
            gi = g[i].double().cpu() + (0.05 * rp[i] if mode == 0 else 0.0)
            rh[i] = rh[i] + gi * gi
            update = gi / (rh[i].sqrt() + 1e-10) + (0.05 * rp[i] if mode == 1 else 0.0)
            rp[i] = rp[i] - 1e-2 * update
    for i in range(len(p)):
        assert_rel_err(p[i], rp[i], 1e-5, f"params[{i}]")
        assert_rel_err(h[i], rh[i], 1e-5, f"state_sum[{i}]")


# ---- LAMB -------------------------------------------------------------------------------------------

def lamb_reference(g, p, m, v, lr, b1, b2, eps, step, bias_correction, wd, grad_averaging, mode, ggn, max_norm,
                   nvlamb):
    """Apex's LAMB (stage 1, norms, stage 2) per tensor, in float64."""
    c1 = 1 - b1 ** step if bias_correction else 1.0
    c2 = 1 - b2 ** step if bias_correction else 1.0
    b3 = 1 - b1 if grad_averaging else 1.0
    g = g / (ggn / max_norm if ggn > max_norm else 1.0)
    if mode == 0:
        g = g + wd * p
    m = b1 * m + b3 * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / c1) / ((v / c2).sqrt() + eps)
    if mode == 1:
        u = u + wd * p
    pn, un = p.norm(), u.norm()
    ratio = lr * pn / un if (nvlamb or wd != 0) and pn != 0 and un != 0 else lr
    return p - ratio * u, m, v


@pytest.mark.parametrize("mode,wd,nvlamb", [(1, 0.05, False), (0, 0.05, False), (1, 0.0, True), (1, 0.0, False)])
@pytest.mark.parametrize("max_norm", [1.0, 1e6])
def test_lamb_vs_float64(device, gen, mode, wd, nvlamb, max_norm):
    p = rand(gen, device)
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    rp, rm, rv = f64(p), f64(m), f64(v)
    for step in range(1, 4):
        g = rand(gen, device)
        ggn = torch.stack([t.double().norm() for t in g]).norm()
        noop = flag(device)
        multi_tensor_applier(amp_c.multi_tensor_lamb, noop, [g, p, m, v], 1e-2, 0.9, 0.99, 1e-6, step, 1, wd, 1,
                             mode, ggn.float().reshape(1).to(device), max_norm, nvlamb)
        assert noop.item() == 0
        for i in range(len(p)):
            rp[i], rm[i], rv[i] = lamb_reference(g[i].double().cpu(), rp[i], rm[i], rv[i], 1e-2, 0.9, 0.99, 1e-6, step,
                                                 1, wd, 1, mode, ggn.item(), max_norm, nvlamb)
    for i in range(1, len(p)):  # params[0] is empty
        assert_rel_err(p[i], rp[i], 1e-5, f"params[{i}]")
        assert_rel_err(v[i], rv[i], 1e-5, f"exp_avg_sq[{i}]")


def test_lamb_non_finite_sets_flag_without_skipping(device, gen):
    p, g = rand(gen, device, sizes=(6, 7)), rand(gen, device, sizes=(6, 7))
    g[1][2] = math.nan
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    noop = flag(device)
    amp_c.multi_tensor_lamb(65536, noop, [g, p, m, v], 1e-2, 0.9, 0.99, 1e-6, 1, 1, 0.01, 1, 1,
                            torch.full((1,), math.nan, device=device), 1.0, False)
    assert noop.item() == 1 and p[1].isnan().any()


# ---- NovoGrad ---------------------------------------------------------------------------------------

def novograd_reference(g, p, m, v, lr, b1, b2, eps, step, bias_correction, wd, grad_averaging, mode, norm_type):
    """Apex's NovoGrad (norm blend, then the kernel) per tensor, in float64."""
    n = g.abs().max() if norm_type == 0 else g.norm()
    v = b2 * v + (1 - b2) * n if norm_type == 0 else (b2 * v * v + (1 - b2) * n * n).sqrt()
    c1 = 1 - b1 ** step if bias_correction else 1.0
    c2 = math.sqrt(1 - b2 ** step) if bias_correction else 1.0
    b3 = 1 - b1 if grad_averaging else 1.0
    d = v / c2 + eps
    if mode == 0:
        m = b1 * m + b3 * (g / d + wd * p)
        return p - lr * m / c1, m, v
    m = b1 * m + b3 * g
    return p - lr * (m / c1 / d + wd * p), m, v


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("norm_type", [0, 2])
@pytest.mark.parametrize("grad_averaging", [0, 1])
def test_novograd_vs_float64(device, gen, mode, norm_type, grad_averaging):
    sizes = SIZES[1:]  # Apex's max-norm of an empty tensor is no norm at all
    p = rand(gen, device, sizes=sizes)
    m = [torch.zeros_like(t) for t in p]
    v = torch.rand(len(p), generator=gen).add_(0.5).to(device)  # the per-tensor second moments
    rp, rm, rv = f64(p), f64(m), list(v.double().cpu())
    for step in range(1, 4):
        g = rand(gen, device, sizes=sizes)
        noop = flag(device)
        multi_tensor_applier(amp_c.multi_tensor_novograd, noop, [g, p, m], v, 1e-2, 0.9, 0.95, 1e-8, step, 1, 0.02,
                             grad_averaging, mode, norm_type)
        assert noop.item() == 0
        for i in range(len(p)):
            rp[i], rm[i], rv[i] = novograd_reference(g[i].double().cpu(), rp[i], rm[i], rv[i], 1e-2, 0.9, 0.95, 1e-8,
                                                     step, 1, 0.02, grad_averaging, mode, norm_type)
    assert_rel_err(v, torch.stack(rv), 1e-5, "grad_norms")
    for i in range(len(p)):
        assert_rel_err(p[i], rp[i], 1e-5, f"params[{i}]")
        assert_rel_err(m[i], rm[i], 1e-5, f"exp_avg[{i}]")


def test_novograd_non_finite_grad_sets_flag(device, gen):
    p, g = rand(gen, device, sizes=(4, 5)), rand(gen, device, sizes=(4, 5))
    g[0][1] = math.inf
    m, v = [torch.zeros_like(t) for t in p], torch.ones(2, device=device)
    noop = flag(device)
    amp_c.multi_tensor_novograd(65536, noop, [g, p, m], v, 1e-2, 0.9, 0.95, 1e-8, 1, 1, 0.0, 1, 1, 2)
    assert noop.item() == 1 and math.isinf(v[0].item()) and math.isfinite(v[1].item())


# ---- refused input changes nothing ----------------------------------------------------------------

def test_optimizer_ops_refuse_bad_input_and_change_nothing(device, gen):
    p, g = rand(gen, device, sizes=(4, 6)), rand(gen, device, sizes=(4, 6))
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    half = [t.half() for t in m]
    norms = torch.ones(2, device=device)
    ggn = torch.ones(1, device=device)
    noop = flag(device)
    cases = [
        (NotImplementedError, r"multi_tensor_sgd: tensor_lists\[2\]\[0\] \(momentum buffer\) is torch.float16 "
         r"beside a torch.float32 weight",
         lambda: amp_c.multi_tensor_sgd(65536, noop, [g, p, half], 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)),
        (NotImplementedError, r"multi_tensor_sgd: tensor_lists\[2\]\[1\] \(momentum buffer\) is torch.float16",
         lambda: amp_c.multi_tensor_sgd(65536, noop, [[t.half() for t in g], p, [m[0], half[1]],
                                                       [t.half() for t in p]], 0.0, 0.9, 0.0, 0.1, False, False,
                                        False, 1.0)),
        (ValueError, r"multi_tensor_sgd: mixprec::sgd_: nesterov",
         lambda: amp_c.multi_tensor_sgd(65536, noop, [g, p, m], 0.0, 0.9, 0.5, 0.1, True, False, False, 1.0)),
        (NotImplementedError, r"multi_tensor_adagrad: tensor_lists\[2\]\[0\] \(state_sum\) is torch.float16",
         lambda: amp_c.multi_tensor_adagrad(65536, noop, [g, p, half], 1e-2, 1e-10, 0, 0.0)),
        (ValueError, "multi_tensor_adam: invalid mode 2",
         lambda: amp_c.multi_tensor_adam(65536, noop, [g, p, m, v], 1e-3, 0.9, 0.99, 1e-8, 1, 2, 1, 0.0)),
        (ValueError, "multi_tensor_adam: mixprec::adam_: step",
         lambda: amp_c.multi_tensor_adam(65536, noop, [g, p, m, v], 1e-3, 0.9, 0.99, 1e-8, 0, 1, 1, 0.0)),
        (ValueError, "multi_tensor_adam: tensor_lists has 5 lists; expected 4",
         lambda: amp_c.multi_tensor_adam(65536, noop, [g, p, m, v, p], 1e-3, 0.9, 0.99, 1e-8, 1, 1, 1, 0.0)),
        (NotImplementedError, r"multi_tensor_lamb: tensor_lists\[3\]\[0\] \(exp_avg_sq\) is torch.float16",
         lambda: amp_c.multi_tensor_lamb(65536, noop, [g, p, m, half], 1e-3, 0.9, 0.99, 1e-6, 1, 1, 0.0, 1, 1, ggn, 1.0)),
        (NotImplementedError, "multi_tensor_lamb: max_grad_norm 0.0",
         lambda: amp_c.multi_tensor_lamb(65536, noop, [g, p, m, v], 1e-3, 0.9, 0.99, 1e-6, 1, 1, 0.0, 1, 1, ggn, 0.0)),
        (ValueError, "multi_tensor_novograd: invalid norm_type 1",
         lambda: amp_c.multi_tensor_novograd(65536, noop, [g, p, m], norms, 1e-3, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 1, 1)),
        (ValueError, r"multi_tensor_novograd: mixprec::novograd_: exp_avg_sq_norms",
         lambda: amp_c.multi_tensor_novograd(65536, noop, [g, p, m], norms[:1], 1e-3, 0.9, 0.99, 1e-8, 1, 1, 0.0,
                                             1, 1, 2)),
    ]
    everything = p + g + m + v + half + [norms, ggn, noop]
    for exc, match, call in cases:
        before = snapshot(everything)
        with pytest.raises(exc, match=match):
            call()
        assert_unchanged(before, everything, match)
