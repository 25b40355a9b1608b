# Tests of the fused Adagrad op mixprec.adagrad_ on CPU and CUDA: one step against float64, low
# precision and master weights, skipped steps, chunk and launch boundaries, bad inputs, opcheck.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
import optim_op_family as opf
from conftest import assert_bitwise_equal, assert_rel_err, boundary_sizes, poison_, random_tensor
from optim_family import flat
from optim_op_family import (  # shared tests: pytest collects them here, on this module's op_family
    test_op_found_inf_skips_everything,
    test_op_grad_scale_unscales,
    test_op_low_precision_is_rounded_fp32,
    test_op_lr_tensor_equals_host_lr,
    test_op_mixed_dtypes_in_one_call,
    test_op_non_finite_grads_stay_element_wise,
)
from optim_op_family import clone, noncontiguous, set_item, set_kw
from test_adagrad import OP, reference_step  # the float64 reference


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


def op_reference(t, *, step, **hyper):
    """float64 result (weights, sums) of one step over `t`, concatenated (element-wise update)."""
    return reference_step(flat(t["master_params"] or t["params"]), flat(t["grads"]), flat(t["state_sums"]),
                          step=step, **hyper)


def check_op_result(t, ref, tol, what):
    assert_rel_err(flat(t["master_params"] or t["params"]), ref[0], tol, f"{what}: weights")
    assert_rel_err(flat(t["state_sums"]), ref[1], tol, f"{what}: state_sums")
    for i, (p, m) in enumerate(zip(t["params"], t["master_params"])):
        assert_bitwise_equal(p, m.to(p.dtype), f"{what}: params[{i}] != rounded master")


ADAGRAD = opf.OpFamily(OP, OP_KEYS, OP_HYPER, op_lists, op_call, op_reference, check_op_result,
                       rounding=(dict(adagrad_w_mode=True), (3, 4)))


@pytest.fixture
def op_family():
    return ADAGRAD


@pytest.mark.parametrize("config", list(OP_CONFIGS))
def test_op_steps_match_reference(device, config, gen):
    """Three steps from a mid-run state (host step 1, 5, 6) against float64 math, fp32 throughout."""
    t = op_lists([17, 1, 300, 5], device, gen)
    opf.steps_match_reference(ADAGRAD, t, dict(OP_HYPER, **OP_CONFIGS[config]), (1, 5, 6), config, device, gen)


def test_op_without_lr_decay_needs_no_step(device, gen):
    """Without lr_decay the step count is unused: step=0 and no step_tensor are fine."""
    hyper = dict(OP_HYPER, lr_decay=0.0)
    t = op_lists([9, 4], device, gen)
    ref = op_reference(t, step=1, **hyper)
    op_call(t, **hyper)
    check_op_result(t, ref, 1e-5, "no lr_decay, no step")


def test_op_chunk_boundaries_and_unaligned_views(device, gen, rng):
    """Sizes straddling 64 Ki-element chunks plus views at odd offsets (no vector loads): the
    poisoned model copies (masters kept) are all written, every master and every sum changes,
    nothing outside a view is touched."""
    sizes = boundary_sizes(rng)
    t = op_lists(sizes, device, gen, dtype=torch.bfloat16, grad_dtype=torch.float16, master=True)
    hyper = dict(OP_HYPER, weight_decay=0.0)  # no decay: the step never cancels to zero
    # A master and a sum become unaligned views.
    edges, bases = opf.make_unaligned(t, sizes, {0: "master_params", 3: "state_sums"}, device, gen)
    # Sums no larger than g^2, so each one grows by a visible fraction and each weight moves.
    for s, g in zip(t["state_sums"], t["grads"]):
        s.copy_(g.float().square() * 0.5)
    for x in t["params"]:
        poison_(x)
    start = clone(t)
    opf.checked_step(ADAGRAD, t, hyper, 3, "chunk boundaries")
    opf.assert_all_updated(t, start, ("master_params", "state_sums"), edges, bases)


def test_op_more_tensors_than_one_launch(device, gen, rng):
    """1500 tiny tensors with all four lists live: more than two launch tables (~640 entries for
    four lists); each tensor is checked on its own."""
    sizes = [rng.randint(1, 40) for _ in range(1500)]
    t = op_lists(sizes, device, gen, dtype=torch.float16, grad_dtype=torch.bfloat16, master=True)
    ref = opf.checked_step(ADAGRAD, t, OP_HYPER, 7, "many tensors")
    offsets = opf.offsets_of(sizes)
    for i, (m, s) in enumerate(zip(t["master_params"], t["state_sums"])):
        assert_rel_err(m, ref[0][offsets[i]:offsets[i + 1]], 1e-5, f"master_params[{i}]")
        assert_rel_err(s, ref[1][offsets[i]:offsets[i + 1]], 1e-5, f"state_sums[{i}]")


def test_op_zero_size_and_empty_lists(device, gen):
    """Zero-size tensors are fine anywhere in the lists; all-zero-size lists still count the step;
    empty lists are a no-op."""
    opf.zero_size_lists(ADAGRAD, device, gen)
    mixprec.adagrad_([], [], [], step=1, **OP_HYPER)


def test_op_step_tensor_equals_host_step(device, gen):
    """Through lr_decay."""
    opf.step_tensor_equals_host_step(ADAGRAD, OP_HYPER, torch.float16, 3, device, gen)


# ---- bad inputs ---------------------------------------------------------------------------------


# name: (edit of the operands, exception, argument, list index or None); the common cases and this op's.
BAD_INPUTS = opf.COMMON_BAD_INPUTS | {
    "state_sums_longer": (lambda t, kw: t["state_sums"].append(t["state_sums"][0].clone()), ValueError,
                          "state_sums", None),
    "state_sums_missing": (lambda t, kw: t.update(state_sums=[]), ValueError, "state_sums", None),
    "state_sums_shape": (set_item("state_sums", 2, lambda x: x[:-1].clone()), ValueError, "state_sums", 2),
    "state_sums_noncontiguous": (set_item("state_sums", 1, noncontiguous), RuntimeError, "state_sums", 1),
    "state_sums_fp16": (set_item("state_sums", 2, lambda x: x.half()), TypeError, "state_sums", 2),
    "state_sums_bf16": (set_item("state_sums", 0, lambda x: x.bfloat16()), TypeError, "state_sums", 0),
    "master_params_bf16": (set_item("master_params", 1, lambda x: x.bfloat16()), TypeError, "master_params", 1),
    "lr_inf": (set_kw(lr=math.inf), ValueError, "lr", None),
    "eps_negative": (set_kw(eps=-1e-10), ValueError, "eps", None),
    "weight_decay_nan": (set_kw(weight_decay=math.nan), ValueError, "weight_decay", None),
    "lr_decay_negative": (set_kw(lr_decay=-0.1), ValueError, "lr_decay", None),
}


# The error names the op, the argument and the list index, and nothing is modified.
# Cases of optim_op_family.bad_scalar_cases that apply, and operands to put on the wrong device.
SCALAR_CASES = ["step_tensor_fp64", "lr_tensor_two_elements", "grad_scale_int", "found_inf_empty"]
WRONG_DEVICE = ["grads", "state_sums", "master_params", "step_tensor", "found_inf", "grad_scale"]
(test_op_rejects_bad_inputs, test_op_rejects_bad_device_scalars,
 test_op_rejects_wrong_device) = opf.bad_input_tests(ADAGRAD, BAD_INPUTS, SCALAR_CASES, WRONG_DEVICE)


# ---- opcheck ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["fp32_host_scalars", "bf16_master_device_scalars"])
def test_opcheck(device, variant, gen):
    full = variant != "fp32_host_scalars"
    t = op_lists([5, (3, 4), 70], device, gen, dtype=torch.bfloat16 if full else torch.float32, master=full)
    opf.opcheck(ADAGRAD, t, dict(OP_HYPER), device, full)
