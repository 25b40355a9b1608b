# Tests of the fused Adam/AdamW op mixprec.adam_ on CPU and CUDA: one step against float64, low
# precision and master weights, bf16 state, amsgrad, skipped steps, boundaries, bad inputs, opcheck.
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import mixprec
import optim_op_family as opf
from conftest import assert_bitwise_equal, assert_rel_err, boundary_sizes, random_tensor, scalar
from optim_family import flat
from optim_op_family import (  # shared tests: pytest collects them here, on this module's op_family
    test_op_found_inf_skips_everything,
    test_op_grad_scale_unscales,
    test_op_low_precision_is_rounded_fp32,
    test_op_lr_tensor_equals_host_lr,
    test_op_non_finite_grads_stay_element_wise,
)
from optim_op_family import clone, noncontiguous, set_item, set_kw
from test_adam import OP, reference_step  # the float64 reference


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


ADAM = opf.OpFamily(OP, OP_KEYS, OP_HYPER, op_lists, op_call, op_reference, check_op_result,
                    rounding=(dict(adam_w_mode=False), (3, 4)), full=dict(amsgrad=True))


@pytest.fixture
def op_family():
    return ADAM

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
    t = op_lists([17, 1, 300, 5], device, gen, amsgrad=amsgrad)
    opf.steps_match_reference(ADAM, t, dict(OP_HYPER, **cfg), (6, 7, 8), config, device, gen)


def test_op_mixed_dtypes_in_one_call(device, gen):
    """Params, grads and moments of different dtypes side by side (one kernel per combination)."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    t = op_lists(list(range(1, 19)), device, gen, dtype=dtypes, grad_dtype=dtypes[::-1] + dtypes[:1], master=True,
                 amsgrad=True)
    bf16_state = [i % 4 == 3 for i in range(18)]
    for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        t[key] = [x.bfloat16() if b else x for x, b in zip(t[key], bf16_state)]
    before = clone(t)
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
    sizes = boundary_sizes(rng)
    t = op_lists(sizes, device, gen, grad_dtype=torch.bfloat16, amsgrad=True)
    # Moments that make every element's change far larger than its rounding: m and g of one
    # sign, v below g^2, no decay (which could cancel the Adam term).
    hyper = dict(OP_HYPER, weight_decay=0.0)
    for i, g in enumerate(t["grads"]):
        t["exp_avgs"][i] = 0.5 * g.float()
        t["exp_avg_sqs"][i] = 0.5 * g.float().square()
        t["max_exp_avg_sqs"][i] = 0.25 * g.float().square()
    edges, bases = opf.make_unaligned(t, sizes, {0: "params", 3: "params"}, device, gen)
    start = clone(t)
    opf.checked_step(ADAM, t, hyper, 4, "chunk boundaries")
    opf.assert_all_updated(t, start, ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), edges, bases)


def test_op_more_tensors_than_one_launch(device, gen, rng):
    """~1000 tiny tensors with all six lists live (fp16 params, bf16 grads, fp32 masters,
    amsgrad): more than two launch tables (~450 entries for six lists); each tensor is checked."""
    sizes = [rng.randint(1, 40) for _ in range(1000)]
    t = op_lists(sizes, device, gen, dtype=torch.float16, grad_dtype=torch.bfloat16, master=True, amsgrad=True)
    ref = opf.checked_step(ADAM, t, OP_HYPER, 9, "many tensors")
    offsets = opf.offsets_of(sizes)
    for i, m in enumerate(t["master_params"]):
        assert_rel_err(m, ref[0][offsets[i]:offsets[i + 1]], 1e-5, f"master_params[{i}]")


def test_op_zero_size_and_empty_lists(device, gen):
    """Zero-size tensors are fine anywhere in the lists; all-zero-size lists still count the step;
    empty lists are a no-op."""
    opf.zero_size_lists(ADAM, device, gen)
    mixprec.adam_([], [], [], [], step_tensor=scalar(4.0, device), **OP_HYPER)  # nothing to update; must not fail


def test_op_empty_lists_without_tensors_is_noop():
    """All lists empty and no device scalars: nothing to do, on no device (a filtered param list
    can come out empty); the dispatcher has no tensor to pick a backend from."""
    mixprec.adam_([], [], [], [], step=1, **OP_HYPER)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_op_step_tensor_equals_host_step(device, bias_correction, gen):
    """Without bias correction any host step, 0 included, is accepted."""
    opf.step_tensor_equals_host_step(ADAM, dict(OP_HYPER, bias_correction=bias_correction), torch.bfloat16, 4,
                                     device, gen, host_step=lambda k: k if bias_correction else 0)


# ---- bad inputs ---------------------------------------------------------------------------------


# name: (edit of the operands, exception, argument, list index or None); the common cases and this op's.
BAD_INPUTS = opf.COMMON_BAD_INPUTS | {
    "exp_avgs_longer": (lambda t, kw: t["exp_avgs"].append(t["exp_avgs"][0].clone()), ValueError, "exp_avgs", None),
    "exp_avg_sqs_shorter": (lambda t, kw: t["exp_avg_sqs"].pop(0), ValueError, "exp_avg_sqs", None),
    "max_exp_avg_sqs_shorter": (lambda t, kw: t["max_exp_avg_sqs"].pop(), ValueError, "max_exp_avg_sqs", None),
    "exp_avgs_shape": (set_item("exp_avgs", 2, lambda x: x[:-1].clone()), ValueError, "exp_avgs", 2),
    "exp_avg_sqs_noncontiguous": (set_item("exp_avg_sqs", 1, noncontiguous), RuntimeError, "exp_avg_sqs", 1),
    "exp_avgs_fp16": (set_item("exp_avgs", 2, lambda x: x.half()), TypeError, "exp_avgs", 2),
    "exp_avg_sqs_unlike_exp_avgs": (set_item("exp_avg_sqs", 0, lambda x: x.bfloat16()), TypeError, "exp_avg_sqs", 0),
    "max_exp_avg_sqs_fp64": (set_item("max_exp_avg_sqs", 1, lambda x: x.double()), TypeError, "max_exp_avg_sqs", 1),
    "master_params_fp16": (set_item("master_params", 0, lambda x: x.half()), TypeError, "master_params", 0),
    "master_params_bf16": (set_item("master_params", 2, lambda x: x.bfloat16()), TypeError, "master_params", 2),
    "step_negative": (set_kw(step=-3), ValueError, "step", None),
    "lr_nan": (set_kw(lr=math.nan), ValueError, "lr", None),
    "beta1_one": (set_kw(beta1=1.0), ValueError, "beta1", None),
    "beta2_negative": (set_kw(beta2=-0.1), ValueError, "beta2", None),
    "eps_negative": (set_kw(eps=-1e-8), ValueError, "eps", None),
    "weight_decay_negative": (set_kw(weight_decay=-0.1), ValueError, "weight_decay", None),
}


# The error names the op, the argument and the list index, and nothing is modified.
# Cases of optim_op_family.bad_scalar_cases that apply, and operands to put on the wrong device.
SCALAR_CASES = ["step_tensor_fp64", "step_tensor_two_elements", "lr_tensor_int", "grad_scale_empty", "found_inf_fp16"]
WRONG_DEVICE = ["grads", "exp_avgs", "master_params", "step_tensor", "found_inf", "lr_tensor"]
(test_op_rejects_bad_inputs, test_op_rejects_bad_device_scalars,
 test_op_rejects_wrong_device) = opf.bad_input_tests(ADAM, BAD_INPUTS, SCALAR_CASES, WRONG_DEVICE)


# ---- opcheck ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["fp32_host_scalars", "fp16_master_amsgrad_device_scalars"])
def test_opcheck(device, variant, gen):
    full = variant != "fp32_host_scalars"
    t = op_lists([5, (3, 4), 70], device, gen, dtype=torch.float16 if full else torch.float32, master=full,
                 amsgrad=full)
    # The schema's last two positional lists (8-bit moments' scales, test_adam_8bit.py) stay empty.
    t.update(exp_avg_scales=[], exp_avg_sq_scales=[])
    keys = OP_KEYS + ("exp_avg_scales", "exp_avg_sq_scales")
    opf.opcheck(dataclasses.replace(ADAM, keys=keys), t, dict(OP_HYPER), device, full)
