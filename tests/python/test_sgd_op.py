# Tests of the fused SGD op mixprec.sgd_ on CPU and CUDA: one step against float64, low precision
# rounded once, master weights, skipped steps, chunk and launch boundaries, bad inputs, opcheck.
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
from test_sgd import OP, reference_step  # the float64 reference


# ---- the op: mixprec.sgd_ -----------------------------------------------------------------------

OP_KEYS = ("params", "grads", "momentum_buffers", "master_params")
OP_HYPER = dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.05, nesterov=False, wd_after_momentum=False,
                maximize=False)
OP_CONFIGS = {
    "momentum_dampening": {},
    "no_momentum": dict(momentum=0.0),
    "nesterov_maximize": dict(nesterov=True, dampening=0.0, maximize=True),
    "wd_after_momentum": dict(wd_after_momentum=True),
    "no_decay": dict(weight_decay=0.0, momentum=0.5),
}


def op_lists(sizes, device, gen, *, dtype=torch.float32, grad_dtype=None, master=False, momentum=True):
    """Operands of one sgd_ call in mid-run state: random weights, grads and buffers, never zeros."""
    dtypes = [dtype] if isinstance(dtype, torch.dtype) else dtype
    grad_dtypes = [grad_dtype or dtypes[0]] if isinstance(grad_dtype or dtypes[0], torch.dtype) else grad_dtype
    t = {k: [] for k in OP_KEYS}
    for i, n in enumerate(sizes):
        w = random_tensor(n, torch.float32, "cpu", gen)
        t["params"].append(w.to(dtypes[i % len(dtypes)]).to(device))
        t["grads"].append(random_tensor(n, grad_dtypes[i % len(grad_dtypes)], device, gen))
        if momentum:
            t["momentum_buffers"].append(random_tensor(n, torch.float32, device, gen))
        if master:
            t["master_params"].append(w.to(device))  # the unrounded weight the model copy came from
    return t


def op_call(t, **kw):
    mixprec.sgd_(t["params"], t["grads"], t["momentum_buffers"], master_params=t["master_params"], **kw)


def op_reference(t, *, step, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum, maximize):
    """float64 result (weights, buffers) of one step over `t`, concatenated (element-wise update)."""
    w = flat(t["master_params"] or t["params"])
    buf = flat(t["momentum_buffers"]) if t["momentum_buffers"] else torch.zeros_like(w)
    return reference_step(w, flat(t["grads"]), buf, first=step == 1, lr=lr, momentum=momentum, dampening=dampening,
                          weight_decay=weight_decay, nesterov=nesterov, wd_after_momentum=wd_after_momentum,
                          maximize=maximize)


def check_op_result(t, ref, tol, what):
    assert_rel_err(flat(t["master_params"] or t["params"]), ref[0], tol, f"{what}: weights")
    if t["momentum_buffers"]:
        assert_rel_err(flat(t["momentum_buffers"]), ref[1], tol, f"{what}: momentum_buffers")
    for i, (p, m) in enumerate(zip(t["params"], t["master_params"])):
        assert_bitwise_equal(p, m.to(p.dtype), f"{what}: params[{i}] != rounded master")


SGD = opf.OpFamily(OP, OP_KEYS, OP_HYPER, op_lists, op_call, op_reference, check_op_result,
                   rounding=(dict(nesterov=True, dampening=0.0), (1, 2)), skip_counts=(0.0, 5.0))


@pytest.fixture
def op_family():
    return SGD


@pytest.mark.parametrize("config", list(OP_CONFIGS))
def test_op_steps_match_reference(device, config, gen):
    """A first step (buffers poisoned: they must be written, not read) and two more against
    float64 math, fp32 throughout; the host step picks the first step."""
    hyper = dict(OP_HYPER, **OP_CONFIGS[config])
    t = op_lists([17, 1, 300, 5], device, gen, momentum=hyper["momentum"] != 0)
    for b in t["momentum_buffers"]:
        poison_(b)
    opf.steps_match_reference(SGD, t, hyper, (1, 2, 3), config, device, gen)


def test_op_without_momentum_needs_no_step(device, gen):
    """Without momentum the step count is unused: step=0 and no step_tensor are fine."""
    hyper = dict(OP_HYPER, momentum=0.0)
    t = op_lists([9, 4], device, gen, momentum=False)
    ref = op_reference(t, step=0, **hyper)
    op_call(t, **hyper)
    check_op_result(t, ref, 1e-5, "no momentum, no step")


def test_op_chunk_boundaries_and_unaligned_views(device, gen, rng):
    """Sizes straddling 64 Ki-element chunks plus views at odd offsets (no vector loads). First
    step: poisoned model copies (masters kept) and buffers must all be written. Second step: every
    buffer element and every master changes. Nothing outside a view is touched."""
    sizes = boundary_sizes(rng)
    t = op_lists(sizes, device, gen, dtype=torch.float16, grad_dtype=torch.bfloat16, master=True)
    hyper = dict(OP_HYPER, weight_decay=0.0)  # no decay: the step never cancels to zero
    # A master and a buffer become unaligned views.
    edges, bases = opf.make_unaligned(t, sizes, {0: "master_params", 3: "momentum_buffers"}, device, gen)
    for x in t["params"] + t["momentum_buffers"]:
        poison_(x)
    opf.checked_step(SGD, t, hyper, 1, "first step")
    # Buffers of the gradient's sign and half its size: the blended buffer differs everywhere.
    t["momentum_buffers"] = [b.copy_(0.5 * g.float()) for b, g in zip(t["momentum_buffers"], t["grads"])]
    start = clone(t)
    opf.checked_step(SGD, t, hyper, 2, "second step")
    opf.assert_all_updated(t, start, ("master_params", "momentum_buffers"), edges, bases)


def test_op_more_tensors_than_one_launch(device, gen, rng):
    """1500 tiny tensors with all four lists live: more than two launch tables (~640 entries for
    four lists); each tensor is checked on its own."""
    sizes = [rng.randint(1, 40) for _ in range(1500)]
    t = op_lists(sizes, device, gen, dtype=torch.bfloat16, grad_dtype=torch.float16, master=True)
    before = {k: [x.double().cpu() for x in t[k]] for k in ("master_params", "grads", "momentum_buffers")}
    ref = opf.checked_step(SGD, t, OP_HYPER, 7, "many tensors")
    offsets = opf.offsets_of(sizes)
    # Per tensor, the error is judged against the size of the terms that were summed, not of the
    # result: a 1-element buffer whose terms nearly cancel has a tiny result, and fp32 rounding of
    # the terms (a few ulps of each) is then a large share of it, with the kernel still right.
    for i, (m, b) in enumerate(zip(t["master_params"], t["momentum_buffers"])):
        terms = torch.stack([before[k][i].abs() for k in before]).sum(0).norm()
        for name, got, want in (("master_params", m, ref[0]), ("momentum_buffers", b, ref[1])):
            want = want[offsets[i]:offsets[i + 1]]
            err = (got.double().cpu() - want.cpu()).norm()
            assert err <= 1e-5 * max(want.norm(), terms), f"{name}[{i}]: error {err:.3e}, terms {terms:.3e}"


def test_op_zero_size_and_empty_lists(device, gen):
    """Zero-size tensors are fine anywhere in the lists; all-zero-size lists still count the step;
    empty lists are a no-op."""
    opf.zero_size_lists(SGD, device, gen)
    mixprec.sgd_([], [], [], step=1, **OP_HYPER)
    mixprec.sgd_([], [], [], **dict(OP_HYPER, momentum=0.0))


def test_op_step_tensor_equals_host_step(device, gen):
    """The first step included."""
    opf.step_tensor_equals_host_step(SGD, OP_HYPER, torch.bfloat16, 3, device, gen)


# ---- bad inputs ---------------------------------------------------------------------------------


def _drop(key):
    def edit(t, kw):
        t[key] = []
    return edit


# name: (edit of the operands, exception, argument, list index or None); the common cases and this op's.
BAD_INPUTS = opf.COMMON_BAD_INPUTS | {
    "momentum_buffers_longer": (lambda t, kw: t["momentum_buffers"].append(t["momentum_buffers"][0].clone()),
                                ValueError, "momentum_buffers", None),
    "momentum_buffers_missing": (_drop("momentum_buffers"), ValueError, "momentum_buffers", None),
    "momentum_buffers_without_momentum": (set_kw(momentum=0.0), ValueError, "momentum_buffers", None),
    "momentum_buffers_shape": (set_item("momentum_buffers", 2, lambda x: x[:-1].clone()), ValueError,
                               "momentum_buffers", 2),
    "grads_noncontiguous": (set_item("grads", 1, noncontiguous), RuntimeError, "grads", 1),
    "momentum_buffers_noncontiguous": (set_item("momentum_buffers", 1, noncontiguous), RuntimeError,
                                       "momentum_buffers", 1),
    # (fp16 buffers of these fp16 params are valid: float32 or the param's dtype)
    "momentum_buffers_fp64": (set_item("momentum_buffers", 2, lambda x: x.double()), TypeError, "momentum_buffers", 2),
    "momentum_buffers_bf16": (set_item("momentum_buffers", 0, lambda x: x.bfloat16()), TypeError,
                              "momentum_buffers", 0),
    "master_params_fp16": (set_item("master_params", 0, lambda x: x.half()), TypeError, "master_params", 0),
    "step_negative": (set_kw(step=-3), ValueError, "step", None),
    "lr_nan": (set_kw(lr=math.nan), ValueError, "lr", None),
    "momentum_negative": (set_kw(momentum=-0.9), ValueError, "momentum", None),
    "momentum_inf": (set_kw(momentum=math.inf), ValueError, "momentum", None),
    "dampening_nan": (set_kw(dampening=math.nan), ValueError, "dampening", None),
    "weight_decay_negative": (set_kw(weight_decay=-0.1), ValueError, "weight_decay", None),
    "nesterov_with_dampening": (set_kw(nesterov=True), ValueError, "nesterov", None),
}


# The error names the op, the argument and the list index, and nothing is modified.
# Cases of optim_op_family.bad_scalar_cases that apply, and operands to put on the wrong device.
SCALAR_CASES = ["step_tensor_fp64", "step_tensor_two_elements", "lr_tensor_int", "grad_scale_empty", "found_inf_fp16"]
WRONG_DEVICE = ["grads", "momentum_buffers", "master_params", "step_tensor", "found_inf", "lr_tensor", "grad_scale"]
(test_op_rejects_bad_inputs, test_op_rejects_bad_device_scalars,
 test_op_rejects_wrong_device) = opf.bad_input_tests(SGD, BAD_INPUTS, SCALAR_CASES, WRONG_DEVICE)


# ---- opcheck ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["fp32_host_scalars_no_momentum", "fp16_master_momentum_device_scalars"])
def test_opcheck(device, variant, gen):
    full = variant != "fp32_host_scalars_no_momentum"
    t = op_lists([5, (3, 4), 70], device, gen, dtype=torch.float16 if full else torch.float32, master=full,
                 momentum=full)
    opf.opcheck(SGD, t, dict(OP_HYPER, momentum=0.9 if full else 0.0), device, full, host_step=None)
