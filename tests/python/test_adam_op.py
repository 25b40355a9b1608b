# Tests of the fused Adam/AdamW op mixprec.adam_ on CPU and CUDA: one step against float64, low
# precision and master weights, bf16 state, amsgrad, skipped steps, boundaries, bad inputs, opcheck.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import (
    CHUNK,
    NON_FINITE,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    check_rejected,
    inject_non_finite,
    random_tensor,
    snapshot,
    sync,
    unaligned_view,
)
from test_adam import LOW, OP, flat, reference_step, scalar  # the float64 reference and shared helpers


# ---- the op: mixprec.adam_ ----------------------------------------------------------------------

OP_KEYS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params")
OP_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-3, weight_decay=0.1, adam_w_mode=True, bias_correction=True,
                maximize=False)


def op_lists(sizes, device, gen, *, dtype=torch.float32, grad_dtype=None, master=False, amsgrad=False,
             state_dtype=torch.float32):
    """Operands of one adam_ call in mid-run state: random weights and grads, random moments
    (v > 0, max_exp_avg_sq above v in some places and below in others), never zeros."""
    grad_dtypes = [grad_dtype or dtype] if isinstance(grad_dtype or dtype, torch.dtype) else grad_dtype
    dtypes = [dtype] if isinstance(dtype, torch.dtype) else dtype
    t = {k: [] for k in OP_KEYS}
    for i, n in enumerate(sizes):
        w = random_tensor(n, torch.float32, "cpu", gen)
        t["params"].append(w.to(dtypes[i % len(dtypes)]).to(device))
        t["grads"].append(random_tensor(n, grad_dtypes[i % len(grad_dtypes)], device, gen))
        t["exp_avgs"].append(random_tensor(n, state_dtype, device, gen, 0.1))
        t["exp_avg_sqs"].append(random_tensor(n, state_dtype, device, gen, 0.5).abs())
        if amsgrad:
            t["max_exp_avg_sqs"].append(random_tensor(n, state_dtype, device, gen, 0.5).abs())
        if master:
            t["master_params"].append(w.to(device))  # the unrounded weight the model copy came from
    return t


def op_call(t, **kw):
    mixprec.adam_(t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"], max_exp_avg_sqs=t["max_exp_avg_sqs"],
                  master_params=t["master_params"], **kw)


def op_clone(t):
    return {k: [x.clone() for x in v] for k, v in t.items()}


def op_all(t):
    return [x for k in OP_KEYS for x in t[k]]


def op_reference(t, *, step, lr, beta1, beta2, **hyper):
    """float64 result of one step over `t` (concatenated: the update is element-wise)."""
    cat = lambda k: flat(t[k]) if t[k] else None
    w = cat("master_params") if t["master_params"] else cat("params")
    vmax = cat("max_exp_avg_sqs")
    return reference_step(w, cat("grads"), cat("exp_avgs"), cat("exp_avg_sqs"), vmax if vmax is not None else w,
                          step=step, lr=lr, betas=(beta1, beta2), amsgrad=vmax is not None, **hyper)


def check_op_result(t, ref, tol, what):
    w = t["master_params"] or t["params"]
    assert_rel_err(flat(w), ref[0], tol, f"{what}: weights")
    assert_rel_err(flat(t["exp_avgs"]), ref[1], tol, f"{what}: exp_avgs")
    assert_rel_err(flat(t["exp_avg_sqs"]), ref[2], tol, f"{what}: exp_avg_sqs")
    if t["max_exp_avg_sqs"]:
        assert_rel_err(flat(t["max_exp_avg_sqs"]), ref[3], tol, f"{what}: max_exp_avg_sqs")
    for i, (p, m) in enumerate(zip(t["params"], t["master_params"])):
        assert_bitwise_equal(p, m.to(p.dtype), f"{what}: params[{i}] != rounded master")


OP_CONFIGS = {
    "adamw": {},
    "adam_l2": dict(adam_w_mode=False),
    "amsgrad_maximize": dict(maximize=True, amsgrad=True),
    "no_bias_correction_amsgrad": dict(bias_correction=False, amsgrad=True, adam_w_mode=False),
    "no_decay": dict(weight_decay=0.0, beta1=0.0),
}


@pytest.mark.parametrize("config", list(OP_CONFIGS))
def test_op_steps_match_reference(device, config, gen):
    """Three steps from a mid-run state (host step 6..8) against float64 math, fp32 throughout."""
    cfg = dict(OP_CONFIGS[config])
    amsgrad = cfg.pop("amsgrad", False)
    hyper = dict(OP_HYPER, **cfg)
    t = op_lists([17, 1, 300, 5], device, gen, amsgrad=amsgrad)
    for step in (6, 7, 8):
        t["grads"] = [random_tensor(g.shape, g.dtype, device, gen) for g in t["grads"]]
        ref = op_reference(t, step=step, **hyper)
        op_call(t, step=step, **hyper)
        check_op_result(t, ref, 1e-5, f"{config} step {step}")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("master", [False, True], ids=["no_master", "master"])
def test_op_low_precision_is_rounded_fp32(device, dtype, grad_dtype, master, gen):
    """The fp16/bf16 step is the fp32 step, rounded once: without masters, fp32 params holding
    the upcast model copy; with masters, fp32 params holding the masters. Bit for bit."""
    hyper = dict(OP_HYPER, adam_w_mode=False)
    t = op_lists([33, 7, 130], device, gen, dtype=dtype, grad_dtype=grad_dtype, master=master, amsgrad=True)
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
        for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
            for i, (a, b) in enumerate(zip(t[key], f[key])):
                assert_bitwise_equal(a, b, f"{key}[{i}]")


def test_op_mixed_dtypes_in_one_call(device, gen):
    """Params, grads and moments of different dtypes side by side (one kernel per combination)."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    t = op_lists(list(range(1, 19)), device, gen, dtype=dtypes, grad_dtype=dtypes[::-1] + dtypes[:1], master=True,
                 amsgrad=True)
    bf16_state = [i % 4 == 3 for i in range(18)]
    for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        t[key] = [x.bfloat16() if b else x for x, b in zip(t[key], bf16_state)]
    before = op_clone(t)
    op_call(t, step=2, **OP_HYPER)
    for i in range(18):
        one = {k: v[i:i + 1] for k, v in before.items()}
        ref = op_reference(one, step=2, **OP_HYPER)
        got = {k: v[i:i + 1] for k, v in t.items()}
        check_op_result(got, tuple(r.to(torch.bfloat16).double() if bf16_state[i] else r for r in ref),
                        1e-2 if bf16_state[i] else 1e-5, f"tensor {i}")


def test_op_chunk_boundaries_and_unaligned_views(device, gen, rng):
    """Sizes straddling 64 Ki-element chunks, plus contiguous views at odd offsets (no vector
    loads): every element is updated (the update is never zero), nothing outside a view is."""
    from conftest import boundary_sizes

    sizes = boundary_sizes(rng)
    t = op_lists(sizes, device, gen, grad_dtype=torch.bfloat16, amsgrad=True)
    # Moments that make every element's change far larger than its rounding: m and g of one
    # sign, v below g^2, no decay (which could cancel the Adam term).
    hyper = dict(OP_HYPER, weight_decay=0.0)
    for i, g in enumerate(t["grads"]):
        t["exp_avgs"][i] = 0.5 * g.float()
        t["exp_avg_sqs"][i] = 0.5 * g.float().square()
        t["max_exp_avg_sqs"][i] = 0.25 * g.float().square()
    bases = []
    for i in (0, 3):  # two params become unaligned views of larger buffers
        view, base = unaligned_view(sizes[i], torch.float32, device, gen)
        view.copy_(t["params"][i])
        t["params"][i] = view
        bases.append(base)
    edges = snapshot([b[0] for b in bases] + [b[-1] for b in bases])
    start = op_clone(t)
    ref = op_reference(t, step=4, **hyper)
    op_call(t, step=4, **hyper)
    check_op_result(t, ref, 1e-5, "chunk boundaries")
    for key in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        for i, (a, b) in enumerate(zip(t[key], start[key])):
            assert bool((a != b).all()), f"{key}[{i}] (size {a.numel()}) has elements that were not updated"
    assert_unchanged(edges, [b[0] for b in bases] + [b[-1] for b in bases], "outside the unaligned views")


def test_op_more_tensors_than_one_launch(device, gen, rng):
    """~1000 tiny tensors with all six lists live (fp16 params, bf16 grads, fp32 masters,
    amsgrad): more than two launch tables (~450 entries for six lists); each tensor is checked."""
    sizes = [rng.randint(1, 40) for _ in range(1000)]
    t = op_lists(sizes, device, gen, dtype=torch.float16, grad_dtype=torch.bfloat16, master=True, amsgrad=True)
    ref = op_reference(t, step=9, **OP_HYPER)
    op_call(t, step=9, **OP_HYPER)
    check_op_result(t, ref, 1e-5, "many tensors")
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    for i, m in enumerate(t["master_params"]):
        assert_rel_err(m, ref[0][offsets[i]:offsets[i + 1]], 1e-5, f"master_params[{i}]")


def test_op_zero_size_and_empty_lists(device, gen):
    """Zero-size tensors are fine anywhere in the lists; all-zero-size lists still count the step;
    empty lists are a no-op."""
    t = op_lists([0, 5, 0, 9], device, gen, master=True, amsgrad=True)
    t["params"][1] = t["params"][1].half()
    t["params"][0] = torch.empty(3, 0, device=device)
    for k in ("grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"):
        t[k][0] = torch.empty(3, 0, device=device)
    ref = op_reference(t, step=3, **OP_HYPER)
    op_call(t, step=3, **OP_HYPER)
    check_op_result(t, ref, 1e-5, "zero-size among others")

    z = op_lists([0, 0], device, gen)
    step = scalar(4.0, device)
    op_call(z, step_tensor=step, **OP_HYPER)
    assert step.item() == 5.0 and all(x.numel() == 0 for x in op_all(z))
    mixprec.adam_([], [], [], [], step_tensor=step, **OP_HYPER)  # nothing to update; must not fail


def test_op_empty_lists_without_tensors_is_noop():
    """All lists empty and no device scalars: nothing to do, on no device (a filtered param list
    can come out empty); the dispatcher has no tensor to pick a backend from."""
    mixprec.adam_([], [], [], [], step=1, **OP_HYPER)


def _fresh_grads(t, device, gen):
    return [random_tensor(g.shape, g.dtype, device, gen) for g in t["grads"]]


def assert_same_lists(a, b, what, keys=OP_KEYS):
    for key in keys:
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert_bitwise_equal(x, y, f"{what}: {key}[{i}]")


@pytest.mark.parametrize("bias_correction", [True, False])
def test_op_step_tensor_equals_host_step(device, bias_correction, gen):
    """step_tensor (the count before this step, incremented on the device) gives exactly the
    host step's results; without bias correction any host step, 0 included, is accepted."""
    hyper = dict(OP_HYPER, bias_correction=bias_correction)
    a = op_lists([20, 3], device, gen, dtype=torch.bfloat16, master=True, amsgrad=True)
    b = op_clone(a)
    count = scalar(0.0, device)
    for k in range(1, 5):
        a["grads"] = b["grads"] = _fresh_grads(a, device, gen)
        op_call(a, step=k if bias_correction else 0, **hyper)
        op_call(b, step_tensor=count, **hyper)
        assert count.item() == k
        assert_same_lists(a, b, f"step {k}")


def test_op_lr_tensor_equals_host_lr(device, gen):
    """lr_tensor wins over the host lr (given a different value here) and matches it bit for bit."""
    a = op_lists([20, 3], device, gen, amsgrad=True)
    b = op_clone(a)
    op_call(a, step=2, **OP_HYPER)
    op_call(b, step=2, lr_tensor=scalar(OP_HYPER["lr"], device), **dict(OP_HYPER, lr=0.5))
    assert_same_lists(a, b, "lr_tensor")


@pytest.mark.parametrize("scale,grad_dtype", [(2.0**13, torch.float16), (2.0**-3, torch.bfloat16),
                                              (3.7, torch.float32)])
def test_op_grad_scale_unscales(device, scale, grad_dtype, gen):
    """grad_scale divides the grads in the kernel: equal to a step on pre-divided grads, bit for
    bit when the scale is a power of two, to fp32 rounding (it multiplies by 1/scale) otherwise."""
    scaled = op_lists([CHUNK + 1, 9], device, gen, dtype=torch.float16, grad_dtype=grad_dtype, master=True,
                      amsgrad=True)
    plain = op_clone(scaled)
    true_grads = scaled["grads"]
    scaled["grads"] = [(g.double() * scale).to(grad_dtype) for g in true_grads]
    plain["grads"] = [(g.double() / scale).to(grad_dtype) for g in scaled["grads"]]
    exact = math.log2(scale).is_integer()
    if exact:
        assert_unchanged(true_grads, plain["grads"], "power-of-two scaling is exact")
    scaled_grads = snapshot(scaled["grads"])
    op_call(scaled, step=3, grad_scale=scalar(scale, device), **OP_HYPER)
    op_call(plain, step=3, **OP_HYPER)
    assert_unchanged(scaled_grads, scaled["grads"], "grads (read-only)")
    if exact:
        assert_same_lists(scaled, plain, f"grad_scale={scale}", keys=[k for k in OP_KEYS if k != "grads"])
    else:
        for key in ("master_params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
            assert_rel_err(flat(scaled[key]), flat(plain[key]), 1e-6, key)


@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_op_found_inf_skips_everything(device, where, value, gen):
    """found_inf != 0 (GradScaler's flag; 2 when summed over devices): params, masters, moments
    and step_tensor stay bit-identical, whatever the grads hold. found_inf == 0 steps as if absent."""
    t = op_lists([CHUNK + 3, 4, 9], device, gen, dtype=torch.float16, master=True, amsgrad=True)
    count, lr, grad_scale = scalar(5.0, device), scalar(1e-2, device), scalar(256.0, device)
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
    assert_same_lists(clean, other, "found_inf=0")


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
    "exp_avgs_longer": (lambda t, kw: t["exp_avgs"].append(t["exp_avgs"][0].clone()), ValueError, "exp_avgs", None),
    "exp_avg_sqs_shorter": (lambda t, kw: t["exp_avg_sqs"].pop(0), ValueError, "exp_avg_sqs", None),
    "max_exp_avg_sqs_shorter": (lambda t, kw: t["max_exp_avg_sqs"].pop(), ValueError, "max_exp_avg_sqs", None),
    "master_params_shorter": (lambda t, kw: t["master_params"].pop(), ValueError, "master_params", None),
    "grads_shape": (_set("grads", 1, lambda x: x.reshape(4, 3)), ValueError, "grads", 1),
    "exp_avgs_shape": (_set("exp_avgs", 2, lambda x: x[:-1].clone()), ValueError, "exp_avgs", 2),
    "params_noncontiguous": (_set("params", 1, _noncontiguous), RuntimeError, "params", 1),
    "exp_avg_sqs_noncontiguous": (_set("exp_avg_sqs", 1, _noncontiguous), RuntimeError, "exp_avg_sqs", 1),
    "master_params_noncontiguous": (_set("master_params", 1, _noncontiguous), RuntimeError, "master_params", 1),
    "exp_avgs_fp16": (_set("exp_avgs", 2, lambda x: x.half()), TypeError, "exp_avgs", 2),
    "exp_avg_sqs_unlike_exp_avgs": (_set("exp_avg_sqs", 0, lambda x: x.bfloat16()), TypeError, "exp_avg_sqs", 0),
    "max_exp_avg_sqs_fp64": (_set("max_exp_avg_sqs", 1, lambda x: x.double()), TypeError, "max_exp_avg_sqs", 1),
    "master_params_fp16": (_set("master_params", 0, lambda x: x.half()), TypeError, "master_params", 0),
    "master_params_bf16": (_set("master_params", 2, lambda x: x.bfloat16()), TypeError, "master_params", 2),
    "params_fp64": (_set("params", 2, lambda x: x.double()), TypeError, "params", 2),
    "grads_int": (_set("grads", 0, lambda x: x.int()), TypeError, "grads", 0),
    "step_zero": (_kw(step=0), ValueError, "step", None),
    "step_negative": (_kw(step=-3), ValueError, "step", None),
    "lr_negative": (_kw(lr=-1e-3), ValueError, "lr", None),
    "lr_nan": (_kw(lr=math.nan), ValueError, "lr", None),
    "beta1_one": (_kw(beta1=1.0), ValueError, "beta1", None),
    "beta2_negative": (_kw(beta2=-0.1), ValueError, "beta2", None),
    "eps_negative": (_kw(eps=-1e-8), ValueError, "eps", None),
    "weight_decay_negative": (_kw(weight_decay=-0.1), ValueError, "weight_decay", None),
}


def _bad_scalar_cases(device):
    z = lambda *a, **k: torch.zeros(*a, device=device, **k)
    return {
        "step_tensor_fp64": (_kw(step_tensor=z(1, dtype=torch.float64)), TypeError, "step_tensor", None),
        "step_tensor_two_elements": (_kw(step_tensor=z(2)), ValueError, "step_tensor", None),
        "lr_tensor_int": (_kw(lr_tensor=z(1, dtype=torch.int32)), TypeError, "lr_tensor", None),
        "grad_scale_empty": (_kw(grad_scale=z(0)), ValueError, "grad_scale", None),
        "found_inf_fp16": (_kw(found_inf=z(1, dtype=torch.float16)), TypeError, "found_inf", None),
    }


def _run_bad_case(device, gen, case):
    edit, exc, arg, index = case
    t = op_lists([6, (3, 4), 5], device, gen, dtype=torch.float16, master=True, amsgrad=True)
    kw = dict(OP_HYPER, step=3)
    edit(t, kw)
    scalars = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    check_rejected(lambda: op_call(t, **kw), op_all(t) + scalars, exc, OP, arg, index, device)


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_op_rejects_bad_inputs(device, name, gen):
    """The error names the op, the argument and the list index, and nothing is modified."""
    _run_bad_case(device, gen, BAD_INPUTS[name])


@pytest.mark.parametrize("name", ["step_tensor_fp64", "step_tensor_two_elements", "lr_tensor_int",
                                  "grad_scale_empty", "found_inf_fp16"])
def test_op_rejects_bad_device_scalars(device, name, gen):
    _run_bad_case(device, gen, _bad_scalar_cases(device)[name])


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["grads", "exp_avgs", "master_params", "step_tensor", "found_inf", "lr_tensor"])
def test_op_rejects_wrong_device(name, gen):
    """One operand on the CPU while the op runs on CUDA."""
    t = op_lists([6, (3, 4), 5], "cuda", gen, dtype=torch.float16, master=True, amsgrad=True)
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


@pytest.mark.parametrize("variant", ["fp32_host_scalars", "fp16_master_amsgrad_device_scalars"])
def test_opcheck(device, variant, gen):
    """Schema (mutation annotations), fake-tensor (Meta) and functionalization checks."""
    full = variant != "fp32_host_scalars"
    t = op_lists([5, (3, 4), 70], device, gen, dtype=torch.float16 if full else torch.float32, master=full,
                 amsgrad=full)
    kwargs = dict(OP_HYPER)
    step_tensor = None
    if full:
        step_tensor = scalar(2.0, device)
        kwargs.update(lr_tensor=scalar(1e-2, device), grad_scale=scalar(8.0, device), found_inf=scalar(0.0, device))
    else:
        kwargs["step"] = 3
    args = (t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"], t["max_exp_avg_sqs"], t["master_params"],
            step_tensor)
    torch.library.opcheck(torch.ops.mixprec.adam_.default, args, kwargs)
