# The CPU optimizer kernels compute the shared per-element math (csrc/kernels/*.h) as written, one
# rounding per operation as CUDA does (nvcc -fmad=false), never a*b+c fused into one FMA (the CPU
# kernel tier builds with -ffp-contract=off): bitwise against that math one numpy float32 op at a time.
from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np
import pytest
import torch

import mixprec
from conftest import CHUNK, assert_bitwise_equal, random_tensor, scalar

# Scalar tails and the vector body of each clone (8 lanes of AVX2), a chunk boundary.
SIZES = [1, 7, 8, 17, 513, CHUNK + 3]
GRAD_SCALE = 3.0 * 2**10  # not a power of two: the unscale rounds


# A float32 scalar: each product and sum with it below is one float32 operation, rounded once.
# numpy, not torch: numpy's float32 sqrt is IEEE's (correctly rounded, as sqrtf on either backend),
# torch's CPU sqrt is not in every build (about 1 result in 140 an ulp off with its AVX-512 code here).
f32 = np.float32


def _libm(name: str):
    # The bias corrections call the C library's expm1f and log1pf on the CPU: the same functions,
    # for the same bits.
    lib = ctypes.util.find_library("m")
    if lib is None:
        return None
    fn = getattr(ctypes.CDLL(lib), name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lambda x: f32(fn(float(x)))


EXPM1F, LOG1PF = _libm("expm1f"), _libm("log1pf")


def cat(ts) -> np.ndarray:
    return torch.cat([t.reshape(-1) for t in ts]).numpy()


def steps_agree(lists: dict, op_step, math_step, hyper_steps, what, gen):
    """Runs op_step(lists, **kw) and math_step(flat, **kw) (the flat concatenation of `lists`,
    whose math is element-wise) for each kw of hyper_steps, with fresh grads, then compares every
    list bitwise: weights, states, and the grads the op leaves unscaled."""
    flat = {k: cat(v) for k, v in lists.items() if v}
    for kw in hyper_steps:
        lists["grads"] = [random_tensor(g.shape, torch.float32, "cpu", gen) for g in lists["grads"]]
        flat["grads"] = cat(lists["grads"])
        op_step(lists, **kw)
        flat = math_step(flat, **kw)
        for k, v in flat.items():
            assert_bitwise_equal(torch.from_numpy(cat(lists[k])), torch.from_numpy(v), f"{what} {kw}: {k}")


def grad_in(flat, grad_scale, maximize):
    flat["grads"] = flat["grads"] * (f32(1.0) / f32(grad_scale)) if grad_scale else flat["grads"]
    return -flat["grads"] if maximize else flat["grads"]


# ---- Adam (kernels/adam.h: adam_coefficients, adam_update) ------------------------------------

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-3)
ADAM_CONFIGS = {
    "adamw": dict(weight_decay=0.1, adam_w_mode=True),
    "l2_maximize_amsgrad": dict(weight_decay=0.05, adam_w_mode=False, maximize=True, amsgrad=True),
    "no_bias_correction": dict(weight_decay=0.0, bias_correction=False),
}


def adam_math(x, *, step, grad_scale, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True, maximize=False,
              bias_correction=True, amsgrad=False):
    x = dict(x)
    bc1 = bc2 = f32(1.0)
    if bias_correction:
        bc1 = -EXPM1F(f32(step) * f32(math.log(beta1)))
        bc2 = -EXPM1F(f32(step) * f32(math.log(beta2)))
    step_size, inv_bc2_sqrt = f32(lr) / bc1, f32(1.0) / np.sqrt(bc2)
    w, m, v = x["params"], x["exp_avgs"], x["exp_avg_sqs"]
    g = grad_in(x, grad_scale, maximize)
    if weight_decay != 0.0:
        if adam_w_mode:
            w = w - (f32(lr) * f32(weight_decay)) * w
        else:
            g = g + f32(weight_decay) * w
    m = f32(beta1) * m + f32(1.0 - beta1) * g
    v = f32(beta2) * v + (f32(1.0 - beta2) * g) * g
    second = v
    if amsgrad:
        x["max_exp_avg_sqs"] = second = np.fmax(x["max_exp_avg_sqs"], v)
    denom = np.sqrt(second) * inv_bc2_sqrt + f32(eps)
    x.update(params=w - (step_size * m) / denom, exp_avgs=m, exp_avg_sqs=v)
    return x


@pytest.mark.skipif(EXPM1F is None, reason="no C math library to call expm1f from")
@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
def test_adam_is_the_shared_math(config, gen):
    cfg = dict(ADAM, **ADAM_CONFIGS[config])
    amsgrad = cfg.get("amsgrad", False)
    lists = dict(params=[random_tensor(n, torch.float32, "cpu", gen) for n in SIZES], grads=[torch.empty(n) for n in SIZES],
                 exp_avgs=[random_tensor(n, torch.float32, "cpu", gen, 0.1) for n in SIZES],
                 exp_avg_sqs=[random_tensor(n, torch.float32, "cpu", gen, 0.5).abs() for n in SIZES],
                 max_exp_avg_sqs=[random_tensor(n, torch.float32, "cpu", gen, 0.5).abs() for n in SIZES] if amsgrad else [])
    op_cfg = {k: v for k, v in cfg.items() if k != "amsgrad"}

    def op_step(t, step, grad_scale):
        mixprec.adam_(t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"], max_exp_avg_sqs=t["max_exp_avg_sqs"],
                      step=step, grad_scale=scalar(grad_scale, "cpu") if grad_scale else None, **op_cfg)

    steps_agree(lists, op_step, lambda x, **kw: adam_math(x, **kw, **cfg),
                [dict(step=3, grad_scale=None), dict(step=4, grad_scale=GRAD_SCALE)], config, gen)


# ---- SGD with fp32 buffers (kernels/sgd.h: sgd_update with KeepFloat) --------------------------

SGD_CONFIGS = {
    "momentum_dampening_decay": dict(momentum=0.9, dampening=0.2, weight_decay=0.05),
    "nesterov_maximize": dict(momentum=0.9, nesterov=True, weight_decay=0.05, maximize=True),
    "wd_after_momentum": dict(momentum=0.5, dampening=0.1, weight_decay=0.05, wd_after_momentum=True),
}


def sgd_math(x, *, step, grad_scale, lr, momentum, dampening=0.0, weight_decay=0.0, nesterov=False,
             wd_after_momentum=False, maximize=False):
    x = dict(x)
    w, buf = x["params"], x["momentum_buffers"]
    g = grad_in(x, grad_scale, maximize)
    if weight_decay != 0.0 and not wd_after_momentum:
        g = g + f32(weight_decay) * w
    buf = g if step == 1 else f32(momentum) * buf + (f32(1.0) - f32(dampening)) * g
    g = g + f32(momentum) * buf if nesterov else buf
    if weight_decay != 0.0 and wd_after_momentum:
        g = g + f32(weight_decay) * w
    x.update(params=w - f32(lr) * g, momentum_buffers=buf)
    return x


@pytest.mark.parametrize("config", list(SGD_CONFIGS))
def test_sgd_is_the_shared_math(config, gen):
    cfg = dict(lr=0.1, **SGD_CONFIGS[config])
    lists = dict(params=[random_tensor(n, torch.float32, "cpu", gen) for n in SIZES], grads=[torch.empty(n) for n in SIZES],
                 momentum_buffers=[random_tensor(n, torch.float32, "cpu", gen) for n in SIZES])

    def op_step(t, step, grad_scale):
        mixprec.sgd_(t["params"], t["grads"], t["momentum_buffers"], step=step,
                     grad_scale=scalar(grad_scale, "cpu") if grad_scale else None, **cfg)

    # Step 1 sets the buffers (torch.optim.SGD); steps 2 and 3 blend into them.
    steps_agree(lists, op_step, lambda x, **kw: sgd_math(x, **kw, **cfg),
                [dict(step=1, grad_scale=None), dict(step=2, grad_scale=GRAD_SCALE), dict(step=3, grad_scale=None)],
                config, gen)


# ---- Adagrad (kernels/adagrad.h) ----------------------------------------------------------------

ADAGRAD_CONFIGS = {
    "l2_lr_decay": dict(weight_decay=0.05, lr_decay=0.1),
    "w_mode_maximize": dict(weight_decay=0.05, adagrad_w_mode=True, maximize=True),
}


def adagrad_math(x, *, step, grad_scale, lr, eps, weight_decay=0.0, lr_decay=0.0, adagrad_w_mode=False,
                 maximize=False):
    x = dict(x)
    w, h = x["params"], x["state_sums"]
    clr = f32(lr) / (f32(1.0) + (f32(step) - f32(1.0)) * f32(lr_decay)) if lr_decay else f32(lr)
    g = grad_in(x, grad_scale, maximize)
    if weight_decay != 0.0 and not adagrad_w_mode:
        g = g + f32(weight_decay) * w
    h = h + g * g
    update = g / (np.sqrt(h) + f32(eps))
    if weight_decay != 0.0 and adagrad_w_mode:
        update = update + f32(weight_decay) * w
    x.update(params=w - clr * update, state_sums=h)
    return x


@pytest.mark.parametrize("config", list(ADAGRAD_CONFIGS))
def test_adagrad_is_the_shared_math(config, gen):
    cfg = dict(lr=0.1, eps=1e-3, **ADAGRAD_CONFIGS[config])
    lists = dict(params=[random_tensor(n, torch.float32, "cpu", gen) for n in SIZES], grads=[torch.empty(n) for n in SIZES],
                 state_sums=[random_tensor(n, torch.float32, "cpu", gen).abs() for n in SIZES])

    def op_step(t, step, grad_scale):
        mixprec.adagrad_(t["params"], t["grads"], t["state_sums"], step=step,
                         grad_scale=scalar(grad_scale, "cpu") if grad_scale else None, **cfg)

    steps_agree(lists, op_step, lambda x, **kw: adagrad_math(x, **kw, **cfg),
                [dict(step=2, grad_scale=GRAD_SCALE), dict(step=3, grad_scale=None)], config, gen)


# ---- NovoGrad with given gradient norms (kernels/novograd.h) -----------------------------------

NOVOGRAD_CONFIGS = {
    "apex": dict(bias_correction=True),
    "reg_inside_no_averaging": dict(reg_inside_moment=True, grad_averaging=False, bias_correction=False),
}


def per_element(values, sizes) -> np.ndarray:
    """One float32 value per tensor, repeated over its elements (the flat math's view of it)."""
    return np.repeat(np.asarray(values, dtype=np.float32), sizes)


def novograd_math(x, *, step, grad_scale, norms, lr, beta1, beta2, eps, weight_decay, bias_correction,
                  reg_inside_moment=False, grad_averaging=True):
    x = dict(x)
    b1, b2 = f32(beta1), f32(beta2)
    one_minus_pow = lambda b: -EXPM1F(f32(step) * LOG1PF(b - f32(1.0)))
    bc1 = one_minus_pow(b1) if bias_correction else f32(1.0)
    bc2 = np.sqrt(one_minus_pow(b2)) if bias_correction else f32(1.0)
    inv_scale = f32(1.0) / f32(grad_scale) if grad_scale else f32(1.0)
    n = norms.numpy() * inv_scale
    v = x["exp_avg_sq_norms"]  # L2: v = sqrt(beta2 v^2 + (1 - beta2) n^2); step 1 seeds it with n
    v = n if step == 1 else np.sqrt((b2 * v) * v + ((f32(1.0) - b2) * n) * n)
    denom = per_element(v / bc2 + f32(eps), SIZES)
    beta3 = f32(1.0) - b1 if grad_averaging else f32(1.0)
    w, m, g = x["params"], x["exp_avgs"], grad_in(x, grad_scale, False)
    if reg_inside_moment:
        m = b1 * m + beta3 * (g / denom + f32(weight_decay) * w)
        w = w - f32(lr) * (m / bc1)
    else:
        m = b1 * m + beta3 * g
        w = w - f32(lr) * ((m / bc1) / denom + f32(weight_decay) * w)
    x.update(params=w, exp_avgs=m, exp_avg_sq_norms=v)
    return x


@pytest.mark.skipif(EXPM1F is None or LOG1PF is None, reason="no C math library to call expm1f/log1pf from")
@pytest.mark.parametrize("config", list(NOVOGRAD_CONFIGS))
def test_novograd_is_the_shared_math(config, gen):
    cfg = dict(lr=0.05, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01, **NOVOGRAD_CONFIGS[config])
    lists = dict(params=[random_tensor(n, torch.float32, "cpu", gen) for n in SIZES], grads=[torch.empty(n) for n in SIZES],
                 exp_avgs=[random_tensor(n, torch.float32, "cpu", gen, 0.1) for n in SIZES],
                 exp_avg_sq_norms=[random_tensor(len(SIZES), torch.float32, "cpu", gen).abs()])
    norms = {}  # the gradients' norms as given to the op: any values do, the same to both

    def op_step(t, step, grad_scale):
        norms[step] = torch.stack([g.double().norm() for g in t["grads"]]).float()
        torch.ops.mixprec.novograd_(t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sq_norms"][0], [], None, step=step,
                                    grad_scale=scalar(grad_scale, "cpu") if grad_scale else None, grad_norms=norms[step],
                                    **cfg)

    steps_agree(lists, op_step, lambda x, step, **kw: novograd_math(x, step=step, norms=norms[step], **kw, **cfg),
                [dict(step=1, grad_scale=None), dict(step=2, grad_scale=GRAD_SCALE), dict(step=3, grad_scale=None)],
                config, gen)


# ---- LAMB, its two halves (kernels/lamb.h): moments and u, then the update with given norms ------

LAMB_CONFIGS = {
    "adamw_clipped": dict(adam_w_mode=True, max_grad_norm=1.0),
    "l2_unclipped_no_averaging": dict(adam_w_mode=False, max_grad_norm=4.0, grad_averaging=False),
}
GLOBAL_GRAD_NORM = 2.0  # given (unscaled): clips by 2 under max_grad_norm 1


def lamb_direction(m, v, w, *, inv_bc1, inv_bc2, eps, weight_decay, adam_w_mode):
    u = (m * inv_bc1) / (np.sqrt(v * inv_bc2) + f32(eps))
    return u + f32(weight_decay) * w if adam_w_mode else u


def lamb_math(x, *, step, grad_scale, trust, lr, beta1, beta2, eps, weight_decay, adam_w_mode, max_grad_norm,
              grad_averaging=True):
    x = dict(x)
    # The corrections in double, rounded once (lamb_coefficients); the clip in float32.
    inv_bc1, inv_bc2 = f32(1.0 / (1.0 - beta1**step)), f32(1.0 / (1.0 - beta2**step))
    inv_scale = f32(1.0) / f32(grad_scale) if grad_scale else f32(1.0)
    norm, max_norm = f32(GLOBAL_GRAD_NORM), f32(max_grad_norm)
    grad_factor = inv_scale / (norm / max_norm if norm > max_norm else f32(1.0))
    w, m, v = x["params"], x["exp_avgs"], x["exp_avg_sqs"]
    g = x["grads"] * grad_factor
    x["grads"] = x["grads"] * inv_scale if grad_scale else x["grads"]
    if not adam_w_mode:
        g = g + f32(weight_decay) * w
    beta3 = f32(1.0 - beta1) if grad_averaging else f32(1.0)
    m = f32(beta1) * m + beta3 * g
    v = f32(beta2) * v + (f32(1.0 - beta2) * g) * g
    # The second half: lr times each tensor's trust ratio, on the direction from the new moments.
    pn, un = trust.numpy()
    step_size = per_element(np.where((pn != 0) & (un != 0), f32(lr) * (pn / un), f32(lr)), SIZES)
    u = lamb_direction(m, v, w, inv_bc1=inv_bc1, inv_bc2=inv_bc2, eps=eps, weight_decay=weight_decay,
                       adam_w_mode=adam_w_mode)
    x.update(params=w - step_size * u, exp_avgs=m, exp_avg_sqs=v)
    return x


@pytest.mark.parametrize("config", list(LAMB_CONFIGS))
def test_lamb_is_the_shared_math(config, gen):
    cfg = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, **LAMB_CONFIGS[config])
    lists = dict(params=[random_tensor(n, torch.float32, "cpu", gen) for n in SIZES], grads=[torch.empty(n) for n in SIZES],
                 exp_avgs=[random_tensor(n, torch.float32, "cpu", gen, 0.1) for n in SIZES],
                 exp_avg_sqs=[random_tensor(n, torch.float32, "cpu", gen, 0.01).abs() for n in SIZES])
    trust = {}  # ||w|| and ||u|| per tensor from the first half (a sum in the CPU's order), given to the second

    def op_step(t, step, grad_scale):
        args = (t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"], [], None)
        kw = dict(step=step, grad_scale=scalar(grad_scale, "cpu") if grad_scale else None,
                  global_grad_norm=scalar(GLOBAL_GRAD_NORM, "cpu"), **cfg)
        trust[step] = torch.zeros(2, len(SIZES))
        torch.ops.mixprec.lamb_(*args, local_norms=trust[step], **kw)
        torch.ops.mixprec.lamb_(*args, trust_norms=trust[step], **kw)

    steps_agree(lists, op_step, lambda x, step, **kw: lamb_math(x, step=step, trust=trust[step], **kw, **cfg),
                [dict(step=2, grad_scale=GRAD_SCALE), dict(step=3, grad_scale=None)], config, gen)
