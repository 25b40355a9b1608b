# CPU/CUDA bit identity (docs/architecture.md): the same inputs stepped by the CPU op and by the
# CUDA op give the same bits, for every optimizer family and the loss-scaling ops; where a result
# passes through a reduction or a libm function the two backends do not share, the bound it is held to.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
import test_adagrad_op as adagrad_op
import test_adam_op as adam_op
import test_sgd_op as sgd_op
from conftest import CHUNK, FLOAT_DTYPES, assert_bitwise_equal, inject_non_finite, random_tensor, scalar
from test_adam_8bit import BLOCK, adam8
from test_adam_8bit import state_of as q8_state
from test_novograd import make_state as novograd_state

pytestmark = pytest.mark.cuda

# Tails of every vector width (1..16 elements), an 8-bit quantization block's end, a chunk boundary.
SIZES = [1, 3, 8, 17, BLOCK + 1, 1000, CHUNK + 7]
STEPS = (2, 3, 4)  # host steps; the second has a non-power-of-two grad_scale, the third an inf grad
GRAD_SCALE = 3.0 * 2**10
# Bias corrections go through expm1f/log1pf (kernels/adam.h, novograd.h): the host's libm and
# CUDA's each promise about one ulp, not the same bits, so the corrections may differ by a few
# float32 ulps between the backends. The update they scale then moves by at most ~2^-20 of itself;
# 2^-18 leaves room for the roundings after it.
COEFFICIENT_BOUND = 2.0**-18


def to_cuda(t: dict) -> dict:
    one = lambda x: x.clone().cuda() if isinstance(x, torch.Tensor) else x
    return {k: [one(x) for x in v] if isinstance(v, list) else one(v) for k, v in t.items()}


def pairs(cpu: dict, cuda: dict, keys):
    for k in keys:
        a, b = cpu[k], cuda[k]
        for i, (x, y) in enumerate(zip(a, b) if isinstance(a, list) else [(a, b)]):
            yield f"{k}[{i}]", x, y


def assert_same(cpu: dict, cuda: dict, what: str, keys=None) -> None:
    for name, x, y in pairs(cpu, cuda, keys or cpu.keys()):
        assert_bitwise_equal(y.cpu(), x, f"{what}: {name}, CUDA vs CPU", nan_equal=True)


def assert_within_coefficient_bound(cpu: dict, cuda: dict, before: dict, keys, decay: float, what: str) -> None:
    """|cuda - cpu| <= COEFFICIENT_BOUND * |update| + one ulp of the stored dtype (the final rounding
    of a value that moved by a hair may fall the other way), where |update| <= |cpu - before| plus
    the decoupled decay lr * wd * |before| (applied before the update, unscaled by the corrections)."""
    for name, x, y in pairs(cpu, cuda, keys):
        a, b, w0 = x.double(), y.cpu().double(), before[name].double()
        eps, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny
        tol = COEFFICIENT_BOUND * ((a - w0).abs() + decay * w0.abs()) + eps * torch.maximum(a.abs(), b.abs()) + tiny * eps
        bad = ((a - b).abs() > tol) | (a.isnan() != b.isnan())
        assert not bool(bad.any()), (f"{what}: {name}: {int(bad.sum())} elements past the bound; first at "
                                     f"{int(bad.nonzero()[0])}: CPU {float(a[bad][0])!r}, CUDA {float(b[bad][0])!r}")


def step_both(t: dict, call, gen, steps=STEPS, check=None) -> dict:
    """Steps `t` (CPU operands) and its CUDA copy with the same fresh grads at each host step; the
    second step has a grad_scale (the kernels write the unscaled grads back), the third an inf in
    one grad without found_inf (NaN then flows through that element). Returns the CUDA operands;
    check(cpu, cuda, step) runs after each step when given."""
    u = to_cuda(t)
    for k, step in enumerate(steps):
        grads = [random_tensor(g.shape, g.dtype, "cpu", gen) for g in t["grads"]]
        if k == 2:
            inject_non_finite(grads[-1], "random", math.inf, gen)
        t["grads"], u["grads"] = grads, [g.cuda() for g in grads]
        scale = GRAD_SCALE if k == 1 else None
        call(t, "cpu", step, scale)
        call(u, "cuda", step, scale)
        if check is not None:
            check(t, u, step)
    return u


def device_scale(scale, device):
    return None if scale is None else scalar(scale, device)


def to_remainder(t: dict) -> None:
    """fp32 masters as lean bf16 weights: the param holds the top 16 bits, the master list the low 16."""
    w = t["master_params"]
    t["params"] = [(x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16) for x in w]
    t["master_params"] = [(x.view(torch.int32) & 0xFFFF).to(torch.int16) for x in w]


# Model weights: (param dtype, masters): none, fp32 masters, lean bf16 remainders, stochastic rounding.
WEIGHTS = [(torch.float32, "none"), (torch.float16, "none"), (torch.bfloat16, "none"), (torch.float16, "fp32"),
           (torch.bfloat16, "fp32"), (torch.bfloat16, "remainder"), (torch.bfloat16, "stochastic")]
WEIGHT_IDS = [f"{str(d).split('.')[-1]}-{m}" for d, m in WEIGHTS]
# Every weight kind without bias correction (bitwise); with it (one step, bounded) fp32 weights,
# fp16 with fp32 masters and bf16 without.
CORRECTED = [(d, m, False) for d, m in WEIGHTS] + [(d, m, True) for d, m in (WEIGHTS[0], WEIGHTS[3], WEIGHTS[2])]
CORRECTED_IDS = [f"{str(d).split('.')[-1]}-{m}-{'bias_correction' if b else 'plain'}" for d, m, b in CORRECTED]


def weight_operands(make, dtype, masters, **kw):
    t = make(SIZES, "cpu", dtype=dtype, master=masters in ("fp32", "remainder"), **kw)
    if masters == "remainder":
        to_remainder(t)
    return t, (dict(stochastic_rounding=True, seed=11) if masters == "stochastic" else {})


def run_family(make, call, hyper, dtype, masters, bias_correction, state_keys, gen, steps=STEPS):
    """Without bias correction, three steps and every operand bitwise; with it, one step (later
    steps would start from weights apart by the bound), the states bitwise (the corrections only
    scale the weight's update) and the weights within COEFFICIENT_BOUND."""
    t, extra = weight_operands(make, dtype, masters)
    hyper = dict(hyper, bias_correction=bias_correction, **extra)
    run = lambda x, dev, step, scale: call(x, dev, step, scale, hyper)
    if not bias_correction:
        u = step_both(t, run, gen, steps)
        assert_same(t, u, f"{dtype} {masters}")
        return
    before = {name: x.clone() for name, x, _ in pairs(t, t, ("params", "master_params"))}
    u = step_both(t, run, gen, steps=(5,))
    assert_same(t, u, f"{dtype} {masters}", ("grads",) + state_keys)
    decay = hyper["lr"] * hyper.get("weight_decay", 0.0)  # a looser bound where the decay is L2: still 2^-18
    assert_within_coefficient_bound(t, u, before, ("params", "master_params"), decay, f"{dtype} {masters}")


# ---- Adam: fp32 and bf16 moments, amsgrad; 8-bit moments ----------------------------------------

# One config per loop the CUDA kernel compiles (AdamFlagCase, kernels/adam.h): decoupled decay,
# no decay, and every flag live (L2 decay; maximize with amsgrad; bf16 moments with amsgrad).
ADAM_CONFIGS = {
    "adamw": (dict(adam_w_mode=True, weight_decay=0.1), {}),
    "no_decay": (dict(weight_decay=0.0), {}),
    "l2": (dict(adam_w_mode=False, weight_decay=0.05), {}),
    "l2_maximize_amsgrad": (dict(adam_w_mode=False, weight_decay=0.05, maximize=True), dict(amsgrad=True)),
    "bf16_moments_amsgrad": (dict(weight_decay=0.0), dict(amsgrad=True, state_dtype=torch.bfloat16)),
}


def adam_call(t, device, step, scale, hyper):
    adam_op.op_call(t, step=step, grad_scale=device_scale(scale, device), **hyper)


@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
@pytest.mark.parametrize("dtype,masters,bias_correction", CORRECTED, ids=CORRECTED_IDS)
def test_adam(dtype, masters, config, bias_correction, gen):
    hyper, make_kw = ADAM_CONFIGS[config]
    make = lambda sizes, device, **kw: adam_op.op_lists(sizes, device, gen, **kw, **make_kw)
    run_family(make, adam_call, dict(adam_op.OP_HYPER, **hyper), dtype, masters, bias_correction,
               ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), gen)


def q8_lists(sizes, device, gen, *, dtype, master):
    w = [random_tensor(n, torch.float32, "cpu", gen) for n in sizes]
    cm, sm, cs, ss = q8_state(w, gen, "cpu")
    return dict(params=[x.to(dtype) for x in w], grads=[random_tensor(n, dtype, "cpu", gen) for n in sizes],
                codes_m=cm, scales_m=sm, codes_v=cs, scales_v=ss, master_params=w if master else [])


def q8_call(t, device, step, scale, hyper):
    adam8(t["params"], t["grads"], [t["codes_m"], t["scales_m"], t["codes_v"], t["scales_v"]],
          master_params=t["master_params"], step=step, grad_scale=device_scale(scale, device), **hyper)


@pytest.mark.parametrize("dtype,masters,bias_correction", CORRECTED, ids=CORRECTED_IDS)
def test_adam_8bit_moments(dtype, masters, bias_correction, gen):
    make = lambda sizes, device, **kw: q8_lists(sizes, device, gen, **kw)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    run_family(make, q8_call, hyper, dtype, masters, bias_correction, ("codes_m", "scales_m", "codes_v", "scales_v"),
               gen)


# ---- SGD and Adagrad: no transcendental function, every configuration bitwise -----------------

def sgd_call(t, device, step, scale, hyper):
    sgd_op.op_call(t, step=step, grad_scale=device_scale(scale, device), **hyper)


@pytest.mark.parametrize("config", list(sgd_op.OP_CONFIGS) + ["param_dtype_buffers", "first_step"])
@pytest.mark.parametrize("dtype,masters", WEIGHTS, ids=WEIGHT_IDS)
def test_sgd(dtype, masters, config, gen):
    hyper = dict(sgd_op.OP_HYPER, **sgd_op.OP_CONFIGS.get(config, {}))
    t, extra = weight_operands(lambda s, d, **kw: sgd_op.op_lists(s, d, gen, momentum=hyper["momentum"] != 0, **kw),
                               dtype, masters)
    if config == "param_dtype_buffers":  # 16-bit buffers round every intermediate (kernels/sgd.h)
        if dtype == torch.float32:
            pytest.skip("an fp32 param's buffer in its own dtype is the default case")
        t["momentum_buffers"] = [b.to(dtype) for b in t["momentum_buffers"]]
    steps = (1, 2, 3) if config == "first_step" else STEPS  # step 1 sets the buffer without reading it
    u = step_both(t, lambda x, dev, step, scale: sgd_call(x, dev, step, scale, dict(hyper, **extra)), gen, steps)
    assert_same(t, u, f"{dtype} {masters} {config}")


@pytest.mark.parametrize("config", list(adagrad_op.OP_CONFIGS))
@pytest.mark.parametrize("dtype,masters", WEIGHTS, ids=WEIGHT_IDS)
def test_adagrad(dtype, masters, config, gen):
    hyper = dict(adagrad_op.OP_HYPER, **adagrad_op.OP_CONFIGS[config])
    t, extra = weight_operands(lambda s, d, **kw: adagrad_op.op_lists(s, d, gen, **kw), dtype, masters)
    call = lambda x, dev, step, scale: adagrad_op.op_call(x, step=step, grad_scale=device_scale(scale, dev),
                                                          **hyper, **extra)
    assert_same(t, step_both(t, call, gen), f"{dtype} {masters} {config}")


# ---- NovoGrad: given the same gradient norms, element-wise -------------------------------------

NOVOGRAD_CONFIGS = {
    "apex": {},
    "reg_inside_init_zero": dict(reg_inside_moment=True, init_zero=True),
    "inf_norm_no_averaging": dict(norm_type=math.inf, grad_averaging=False),
}


def novograd_call(t, device, step, scale, hyper):
    # The gradient norms are a reduction (see test_norms); given, the same to both backends, the
    # rest of the step is element-wise (the moment update is per tensor, in basic operations).
    grads = [g.detach().cpu().double() for g in t["grads"]]
    ord = hyper.get("norm_type", 2.0)
    norms = torch.stack([torch.linalg.vector_norm(g, ord) for g in grads]).float().to(device)
    torch.ops.mixprec.novograd_(t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sq_norms"], t["master_params"],
                                None, step=step, grad_scale=device_scale(scale, device), grad_norms=norms, **hyper)


@pytest.mark.parametrize("config", list(NOVOGRAD_CONFIGS))
@pytest.mark.parametrize("dtype,masters,bias_correction", CORRECTED, ids=CORRECTED_IDS)
def test_novograd(dtype, masters, config, bias_correction, gen):
    hyper = dict(lr=0.05, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01, **NOVOGRAD_CONFIGS[config])
    if bias_correction and hyper.get("reg_inside_moment"):
        # The moment itself then divides by the corrected denominator, and where the new moment
        # nearly cancels, the weight's update is no longer a bound on its error: checked bitwise
        # without bias correction only.
        pytest.skip("reg_inside_moment with bias correction has no bound of this form")
    make = lambda sizes, device, dtype, master: novograd_state(sizes, dtype, dtype, device, gen, master)
    run_family(make, novograd_call, hyper, dtype, masters, bias_correction, ("exp_avgs", "exp_avg_sq_norms"), gen,
               steps=(1, 2, 3))


# ---- LAMB: the trust ratio's norms are a reduction; the rest element-wise ----------------------

LAMB_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True,
                  grad_averaging=True, adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False)
LAMB_CONFIGS = {
    "trust_ratio_clipped": {},
    "nvlamb_l2_unclipped": dict(use_nvlamb=True, adam_w_mode=False, max_grad_norm=4.0),
    "no_trust_ratio": dict(weight_decay=0.0),
}
GLOBAL_GRAD_NORM = 2.0  # given to both backends (unscaled): clips by 2 unless max_grad_norm is above it


def lamb_lists(sizes, device, gen, *, dtype, master):
    w = [random_tensor(n, torch.float32, "cpu", gen) for n in sizes]
    return dict(params=[x.to(dtype) for x in w], grads=[random_tensor(n, dtype, "cpu", gen) for n in sizes],
                exp_avgs=[random_tensor(n, torch.float32, "cpu", gen, 0.1) for n in sizes],
                exp_avg_sqs=[random_tensor(n, torch.float32, "cpu", gen, 0.01).abs() for n in sizes],
                master_params=w if master else [])


def assert_within_reduction_bound(cpu, cuda, sizes, what):
    """Norms are float32 sums of squares in an order each backend picks (lanes over tiles on the
    CPU, threads and a block tree on CUDA), so their bits may differ. In any order a sum of n
    non-negative terms is within (n - 1) u (u = 2^-24) of the exact sum (Higham, Accuracy and
    Stability of Numerical Algorithms, 4.2), its square root within half that, so two backends'
    norms lie within (n + 1) u of each other, the roundings of the root included."""
    a, b = cpu.double(), cuda.cpu().double()
    n = torch.tensor(sizes, dtype=torch.float64).expand_as(a)
    tol = (n + 1) * 2.0**-24 * torch.maximum(a, b)
    ok = ((a - b).abs() <= tol) | (a == b) | (a.isnan() & b.isnan())  # an inf gradient: inf or NaN on both
    assert bool(ok.all()), f"{what}: CPU {a.tolist()} vs CUDA {b.tolist()}, bound {tol.tolist()}"


@pytest.mark.parametrize("config", list(LAMB_CONFIGS))
@pytest.mark.parametrize("dtype,masters", WEIGHTS, ids=WEIGHT_IDS)
def test_lamb(dtype, masters, config, gen):
    """With a trust ratio the step runs as the op's two halves (local_norms, then trust_norms):
    each backend's ||w|| and ||u|| within the reduction bound of the other's, then both apply
    the CPU's norms, after which every operand must agree bitwise (LAMB's bias corrections are
    computed in double and rounded once to float32, which the backends' pow leaves the same)."""
    t, extra = weight_operands(lambda s, d, **kw: lamb_lists(s, d, gen, **kw), dtype, masters)
    hyper = dict(LAMB_HYPER, **LAMB_CONFIGS[config], **extra)
    trust_ratio = hyper["weight_decay"] != 0.0 or hyper["use_nvlamb"]
    cpu_norms = {}

    def call(x, device, step, scale):
        args = (x["params"], x["grads"], x["exp_avgs"], x["exp_avg_sqs"], x["master_params"], None)
        kw = dict(step=step, grad_scale=device_scale(scale, device), global_grad_norm=scalar(GLOBAL_GRAD_NORM, device),
                  **hyper)
        if not trust_ratio:
            torch.ops.mixprec.lamb_(*args, **kw)
            return
        norms = torch.zeros(2, len(SIZES), device=device)
        torch.ops.mixprec.lamb_(*args, local_norms=norms, **kw)
        if x is t:  # the CPU's operands step first
            cpu_norms["last"] = norms
        else:
            assert_within_reduction_bound(cpu_norms["last"], norms, SIZES, f"step {step}: ||w||, ||u||")
        torch.ops.mixprec.lamb_(*args, trust_norms=cpu_norms["last"].to(device), **kw)

    assert_same(t, step_both(t, call, gen), f"{dtype} {masters} {config}")


# ---- the loss-scaling ops and the norms -------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16], ids=["in_place", "to_fp32", "to_fp16"])
@pytest.mark.parametrize("bad", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_finite_check_and_unscale(dtype, bad, out_dtype, gen):
    grads = [random_tensor(n, dtype, "cpu", gen, 1e3) for n in SIZES]
    if bad is not None:
        inject_non_finite(grads[3], "random", bad, gen)
    out = [torch.full((n,), math.nan, dtype=out_dtype) for n in SIZES] if out_dtype else []  # poisoned
    t = dict(grads=grads, out=out, found_inf=torch.zeros(1), per_tensor=torch.zeros(len(SIZES)))
    u = to_cuda(t)
    for x, device in ((t, "cpu"), (u, "cuda")):
        mixprec.non_finite_check_and_unscale_(x["grads"], x["found_inf"], scalar(1 / 3000, device), x["out"],
                                              x["per_tensor"])
    assert_same(t, u, f"{dtype} bad={bad} out={out_dtype}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scale(dtype, gen):
    t = dict(tensors=[random_tensor(n, dtype, "cpu", gen) for n in SIZES])
    u = to_cuda(t)
    for x, device in ((t, "cpu"), (u, "cuda")):
        mixprec.scale_(x["tensors"], scalar(0.37, device))
    assert_same(t, u, f"{dtype}")


def test_update_scale(rng):
    t = dict(scale=scalar(2.0**15, "cpu"), growth_tracker=torch.zeros(1, dtype=torch.int32),
             hysteresis_tracker=torch.full((1,), 2, dtype=torch.int32), skipped_steps=torch.zeros(1, dtype=torch.int64))
    u = to_cuda(t)
    for k in range(200):
        found = float(rng.random() < 0.3)
        for x, device in ((t, "cpu"), (u, "cuda")):
            mixprec.update_scale_(x["scale"], x["growth_tracker"], scalar(found, device), 3.0, 0.37, 3, hysteresis=2,
                                  hysteresis_tracker=x["hysteresis_tracker"], skipped_steps=x["skipped_steps"],
                                  min_scale=1.0, max_scale=2.0**24)
        assert_same(t, u, f"update {k}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_norms(dtype, gen):
    """The inf-norm is a max, the same in any order: bitwise. The 2-norm within the reduction bound."""
    tensors = [random_tensor(n, dtype, "cpu", gen) for n in SIZES]
    for ord in (2.0, math.inf):
        (total, per), (total_cuda, per_cuda) = (mixprec.multi_tensor_norm(ts, ord, per_tensor=True)
                                                for ts in (tensors, [x.cuda() for x in tensors]))
        if ord == math.inf:
            assert_same(dict(total=total, per=per), dict(total=total_cuda, per=per_cuda), f"{dtype} inf-norm")
        else:
            assert_within_reduction_bound(per, per_cuda, SIZES, f"{dtype} per-tensor 2-norms")
            assert_within_reduction_bound(total.reshape(1), total_cuda.reshape(1), [sum(SIZES)], f"{dtype} total 2-norm")
