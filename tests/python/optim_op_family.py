# Op-level test logic shared by the adam_, sgd_ and adagrad_ op test files, parametrized by an OpFamily.
# Each test_<family>_op.py calls these from its own tests, or imports the test_* ones whole.
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from conftest import (
    CHUNK,
    NON_FINITE,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    check_rejected,
    inject_non_finite,
    random_tensor,
    scalar,
    snapshot,
    sync,
    unaligned_view,
)
from optim_family import LOW, flat

WHERE_VALUE = list(zip(("first", "last", "random"), NON_FINITE))


@dataclass(frozen=True)
class OpFamily:
    """What the shared op tests need to know of one fused op."""
    name: str  # the op's name in error messages ("adam_")
    keys: tuple  # the operand lists, in the op's positional order
    hyper: dict  # host scalars of a valid call
    lists: Callable  # (sizes, device, gen, *, dtype, grad_dtype, master, ...) -> operands in mid-run state
    call: Callable  # (t, **kw) -> runs the op on operands t
    reference: Callable  # (t, *, step, **hyper) -> float64 result of one step, concatenated
    check: Callable  # (t, ref, tol, what) -> asserts t is the reference result
    rounding: tuple  # (changes to `hyper`, host steps) of test_op_low_precision_is_rounded_fp32
    full: dict = field(default_factory=dict)  # `lists` options that make every list live
    skip_counts: tuple = (5.0,)  # step_tensor values at which found_inf must skip everything

    @property
    def state_keys(self):
        return tuple(k for k in self.keys if k not in ("params", "grads", "master_params"))

    def all(self, t):
        return [x for k in self.keys for x in t[k]]


def clone(t):
    return {k: [x.clone() for x in v] for k, v in t.items()}


def fresh_grads(t, device, gen):
    return [random_tensor(g.shape, g.dtype, device, gen) for g in t["grads"]]


def assert_same_lists(a, b, what, keys):
    for key in keys:
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert_bitwise_equal(x, y, f"{what}: {key}[{i}]")


def checked_step(op, t, hyper, step, what):
    """One op step over `t` at host step `step`, checked against float64 math (1e-5); returns
    the reference result."""
    ref = op.reference(t, step=step, **hyper)
    op.call(t, step=step, **hyper)
    op.check(t, ref, 1e-5, what)
    return ref


def steps_match_reference(op, t, hyper, steps, what, device, gen):
    """Steps of fresh grads over `t` at the given host steps, each against float64 math."""
    for step in steps:
        t["grads"] = fresh_grads(t, device, gen)
        checked_step(op, t, hyper, step, f"{what} step {step}")


def make_unaligned(t, sizes, where, device, gen):
    """Makes t[key][i] an fp32 view at an odd offset of a larger buffer for each i: key of `where`
    (no vector loads); returns the buffers' edge elements, which no step may touch, and the buffers."""
    bases = []
    for i, key in where.items():
        view, base = unaligned_view(sizes[i], torch.float32, device, gen)
        view.copy_(t[key][i])
        t[key][i] = view
        bases.append(base)
    return snapshot([b[0] for b in bases] + [b[-1] for b in bases]), bases


def assert_all_updated(t, start, keys, edges, bases):
    """Every element of the `keys` lists changed since `start`; nothing outside the views did."""
    for key in keys:
        for i, (a, b) in enumerate(zip(t[key], start[key])):
            assert bool((a != b).all()), f"{key}[{i}] (size {a.numel()}) has elements that were not updated"
    assert_unchanged(edges, [b[0] for b in bases] + [b[-1] for b in bases], "outside the unaligned views")


def offsets_of(sizes):
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return offsets


def zero_size_lists(op, device, gen):
    """Zero-size tensors are fine anywhere in the lists; all-zero-size lists still count the step."""
    t = op.lists([0, 5, 0, 9], device, gen, master=True, **op.full)
    t["params"][1] = t["params"][1].half()
    for k in op.keys:
        t[k][0] = torch.empty(3, 0, device=device)
    checked_step(op, t, op.hyper, 3, "zero-size among others")

    z = op.lists([0, 0], device, gen)
    step = scalar(4.0, device)
    op.call(z, step_tensor=step, **op.hyper)
    assert step.item() == 5.0 and all(x.numel() == 0 for x in op.all(z))


def step_tensor_equals_host_step(op, hyper, dtype, steps, device, gen, host_step=lambda k: k):
    """step_tensor (the count before this step, incremented on the device) gives exactly the
    host step's (host_step(k) at step k) results."""
    a = op.lists([20, 3], device, gen, dtype=dtype, master=True, **op.full)
    b = clone(a)
    count = scalar(0.0, device)
    for k in range(1, steps + 1):
        a["grads"] = b["grads"] = fresh_grads(a, device, gen)
        op.call(a, step=host_step(k), **hyper)
        op.call(b, step_tensor=count, **hyper)
        assert count.item() == k
        assert_same_lists(a, b, f"step {k}", op.keys)


# ---- tests shared whole: each op test module imports them (pytest collects them there) and
# defines the op_family fixture, its OpFamily, that they run on.


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("master", [False, True], ids=["no_master", "master"])
def test_op_low_precision_is_rounded_fp32(op_family, device, dtype, grad_dtype, master, gen):
    """The fp16/bf16 step is the fp32 step, rounded once: without masters, fp32 params holding
    the upcast model copy; with masters, fp32 params holding the masters. Bit for bit."""
    op = op_family
    hyper, steps = dict(op.hyper, **op.rounding[0]), op.rounding[1]
    t = op.lists([33, 7, 130], device, gen, dtype=dtype, grad_dtype=grad_dtype, master=master, **op.full)
    f = clone(t)
    f["master_params"] = []
    for step in steps:
        f["params"] = [x.float().clone() for x in (t["master_params"] if master else t["params"])]
        op.call(t, step=step, **hyper)
        op.call(f, step=step, **hyper)
        for i, (lo, hi) in enumerate(zip(t["params"], f["params"])):
            assert_bitwise_equal(lo, hi.to(dtype), f"params[{i}]")
            if master:
                assert_bitwise_equal(t["master_params"][i], hi, f"master_params[{i}]")
        assert_same_lists(t, f, "state", op.state_keys)


def test_op_mixed_dtypes_in_one_call(op_family, device, gen):
    """Params and grads of different dtypes side by side (one kernel per combination)."""
    op = op_family
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    t = op.lists(list(range(1, 19)), device, gen, dtype=dtypes, grad_dtype=dtypes[::-1] + dtypes[:1], master=True)
    before = clone(t)
    op.call(t, step=2, **op.hyper)
    for i in range(18):
        ref = op.reference({k: v[i:i + 1] for k, v in before.items()}, step=2, **op.hyper)
        op.check({k: v[i:i + 1] for k, v in t.items()}, ref, 1e-5, f"tensor {i}")


def test_op_lr_tensor_equals_host_lr(op_family, device, gen):
    """lr_tensor wins over the host lr (given a different value here) and matches it bit for bit."""
    op = op_family
    a = op.lists([20, 3], device, gen, **op.full)
    b = clone(a)
    op.call(a, step=2, **op.hyper)
    op.call(b, step=2, lr_tensor=scalar(op.hyper["lr"], device), **dict(op.hyper, lr=0.5))
    assert_same_lists(a, b, "lr_tensor", op.keys)


@pytest.mark.parametrize("scale,grad_dtype", [(2.0**13, torch.float16), (2.0**-3, torch.bfloat16),
                                              (3.7, torch.float32)])
def test_op_grad_scale_unscales(op_family, device, scale, grad_dtype, gen):
    """grad_scale divides the grads in the kernel: equal to a step on pre-divided grads, bit for
    bit when the scale is a power of two, to fp32 rounding (it multiplies by 1/scale) otherwise.
    The kernel leaves each grad unscaled, g * (1/scale) in fp32 rounded to the grad's dtype
    (torch's fused-optimizer contract); without grad_scale grads are only read."""
    op = op_family
    scaled = op.lists([CHUNK + 1, 9], device, gen, dtype=torch.float16, grad_dtype=grad_dtype, master=True, **op.full)
    plain = clone(scaled)
    true_grads = scaled["grads"]
    scaled["grads"] = [(g.double() * scale).to(grad_dtype) for g in true_grads]
    plain["grads"] = [(g.double() / scale).to(grad_dtype) for g in scaled["grads"]]
    exact = math.log2(scale).is_integer()
    if exact:
        assert_unchanged(true_grads, plain["grads"], "power-of-two scaling is exact")
    inv = 1 / scalar(scale, "cpu")  # the kernel's float32 reciprocal
    unscaled = [(g.cpu().float() * inv).to(grad_dtype) for g in scaled["grads"]]
    plain_grads = snapshot(plain["grads"])
    op.call(scaled, step=3, grad_scale=scalar(scale, device), **op.hyper)
    op.call(plain, step=3, **op.hyper)
    for i, (g, want) in enumerate(zip(scaled["grads"], unscaled)):
        assert_bitwise_equal(g, want, f"grad {i} left unscaled")
    assert_unchanged(plain_grads, plain["grads"], "grads without grad_scale (read-only)")
    if exact:
        assert_same_lists(scaled, plain, f"grad_scale={scale}", [k for k in op.keys if k != "grads"])
    else:
        for key in ("master_params",) + op.state_keys:
            assert_rel_err(flat(scaled[key]), flat(plain[key]), 1e-6, key)


@pytest.mark.parametrize("where,value", WHERE_VALUE)
def test_op_found_inf_skips_everything(op_family, device, where, value, gen):
    """found_inf != 0 (GradScaler's flag; 2 when summed over devices): params, masters, state and
    step_tensor (at each of the family's skip_counts, SGD's first step included) stay
    bit-identical, whatever the grads hold. found_inf == 0 steps as if absent."""
    op = op_family
    t = op.lists([CHUNK + 3, 4, 9], device, gen, dtype=torch.float16, master=True, **op.full)
    lr, grad_scale = scalar(op.hyper["lr"], device), scalar(256.0, device)
    clean = clone(t)
    inject_non_finite(t["grads"][int(torch.randint(0, 3, (1,), generator=gen))], where, value, gen)
    for count0 in op.skip_counts:
        count = scalar(count0, device)
        kw = dict(op.hyper, step_tensor=count, lr_tensor=lr, grad_scale=grad_scale)
        for flag in (1.0, 2.0):
            before = snapshot(op.all(t) + [count, lr, grad_scale])
            op.call(t, found_inf=scalar(flag, device), **kw)
            sync(device)
            assert_unchanged(before, op.all(t) + [count, lr, grad_scale], f"found_inf={flag}, step {count0}")

    count, other_count = scalar(5.0, device), scalar(5.0, device)
    kw = dict(op.hyper, lr_tensor=lr, grad_scale=grad_scale)
    other = clone(clean)
    op.call(clean, found_inf=scalar(0.0, device), step_tensor=count, **kw)
    op.call(other, step_tensor=other_count, **kw)
    assert count.item() == other_count.item() == 6.0
    assert_same_lists(clean, other, "found_inf=0", op.keys)


def test_op_non_finite_grads_stay_element_wise(op_family, device, gen):
    """Without found_inf an inf/NaN gradient reaches only its own elements (torch's behaviour)."""
    op = op_family
    t = op.lists([CHUNK + 7, 40], device, gen, master=True)
    positions = [inject_non_finite(t["grads"][0], w, v, gen) for w, v in WHERE_VALUE]
    finite = clone(t)
    for p in positions:
        finite["grads"][0].view(-1)[p] = 1.0
    op.call(t, step=2, **op.hyper)
    op.call(finite, step=2, **op.hyper)
    mask = torch.ones(t["grads"][0].numel(), dtype=torch.bool)
    mask[positions] = False
    for key in ("master_params",) + op.state_keys:
        if not t[key]:
            continue
        got, want = t[key][0].cpu().view(-1), finite[key][0].cpu().view(-1)
        assert_bitwise_equal(got[mask], want[mask], f"{key}[0] away from the non-finite grads")
        assert not bool(got[~mask].isfinite().any()), f"{key}[0] hides a non-finite gradient"
        assert_bitwise_equal(t[key][1], finite[key][1], f"{key}[1]")


# ---- bad inputs ---------------------------------------------------------------------------------


def set_item(key, i, fn):
    def edit(t, kw):
        t[key][i] = fn(t[key][i])
    return edit


def set_kw(**changes):
    def edit(t, kw):
        kw.update(changes)
    return edit


def noncontiguous(x):
    """Same shape and values, every other element of a buffer twice its size: not dense, so no
    linear walk of the storage reads it (column-major, channels_last and the like are fine)."""
    return torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]


def column_major(x):
    return x.t().contiguous().t()  # same shape and values, dense, a layout unlike its entry's


# Bad operands every op has: name: (edit of the operands, exception, argument, list index or None).
COMMON_BAD_INPUTS = {
    "grads_shorter": (lambda t, kw: t["grads"].pop(), ValueError, "grads", None),
    "master_params_shorter": (lambda t, kw: t["master_params"].pop(), ValueError, "master_params", None),
    "grads_shape": (set_item("grads", 1, lambda x: x.reshape(4, 3)), ValueError, "grads", 1),
    "params_noncontiguous": (set_item("params", 1, noncontiguous), RuntimeError, "params", 1),
    "master_params_noncontiguous": (set_item("master_params", 1, noncontiguous), RuntimeError, "master_params", 1),
    "grads_other_layout": (set_item("grads", 1, column_major), ValueError, "grads", 1),
    "master_params_other_layout": (set_item("master_params", 1, column_major), ValueError, "master_params", 1),
    "params_fp64": (set_item("params", 2, lambda x: x.double()), TypeError, "params", 2),
    "grads_int": (set_item("grads", 0, lambda x: x.int()), TypeError, "grads", 0),
    "step_zero": (set_kw(step=0), ValueError, "step", None),
    "lr_negative": (set_kw(lr=-1e-3), ValueError, "lr", None),
}


def bad_scalar_cases(device):
    """name: (edit of the operands, exception, argument, list index or None), for the device scalars."""
    z = lambda *a, **k: torch.zeros(*a, device=device, **k)
    return {
        "step_tensor_fp64": (set_kw(step_tensor=z(1, dtype=torch.float64)), TypeError, "step_tensor", None),
        "step_tensor_two_elements": (set_kw(step_tensor=z(2)), ValueError, "step_tensor", None),
        "lr_tensor_int": (set_kw(lr_tensor=z(1, dtype=torch.int32)), TypeError, "lr_tensor", None),
        "lr_tensor_two_elements": (set_kw(lr_tensor=z(2)), ValueError, "lr_tensor", None),
        "grad_scale_empty": (set_kw(grad_scale=z(0)), ValueError, "grad_scale", None),
        "grad_scale_int": (set_kw(grad_scale=z(1, dtype=torch.int32)), TypeError, "grad_scale", None),
        "found_inf_fp16": (set_kw(found_inf=z(1, dtype=torch.float16)), TypeError, "found_inf", None),
        "found_inf_empty": (set_kw(found_inf=z(0)), ValueError, "found_inf", None),
    }


def run_bad_case(op, device, gen, case):
    """The error names the op, the argument and the list index, and nothing is modified."""
    edit, exc, arg, index = case
    t = op.lists([6, (3, 4), 5], device, gen, dtype=torch.float16, master=True, **op.full)
    kw = dict(op.hyper, step=3)
    edit(t, kw)
    scalars = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    check_rejected(lambda: op.call(t, **kw), op.all(t) + scalars, exc, op.name, arg, index, device)


def _rejects_wrong_device(op, name, gen):
    """One operand (list `name`'s second tensor, or device scalar `name`) on the CPU while the op runs on CUDA."""
    t = op.lists([6, (3, 4), 5], "cuda", gen, dtype=torch.float16, master=True, **op.full)
    kw = dict(op.hyper, step=3)
    if name in t:
        t[name][1] = t[name][1].cpu()
        index = 1
    else:
        kw[name] = scalar(1.0 if name != "found_inf" else 0.0, "cpu")
        index = None
    scalars = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    check_rejected(lambda: op.call(t, **kw), op.all(t) + scalars, RuntimeError, op.name, name, index, "cuda")


def bad_input_tests(op, bad_inputs, scalar_names, wrong_device_names):
    """The three bad-input tests of `op`, parametrized by its own cases: `bad_inputs` (name:
    case, as in bad_scalar_cases), the names of bad_scalar_cases that apply, and the operands
    to put on the wrong device. The op test module binds them to their test_* names."""
    @pytest.mark.parametrize("name", list(bad_inputs))
    def test_op_rejects_bad_inputs(device, name, gen):
        run_bad_case(op, device, gen, bad_inputs[name])

    @pytest.mark.parametrize("name", scalar_names)
    def test_op_rejects_bad_device_scalars(device, name, gen):
        run_bad_case(op, device, gen, bad_scalar_cases(device)[name])

    @pytest.mark.cuda
    @pytest.mark.parametrize("name", wrong_device_names)
    def test_op_rejects_wrong_device(name, gen):
        _rejects_wrong_device(op, name, gen)

    return test_op_rejects_bad_inputs, test_op_rejects_bad_device_scalars, test_op_rejects_wrong_device


def opcheck(op, t, kwargs, device, device_scalars, host_step=3):
    """torch.library.opcheck of one call: schema (mutation annotations), fake-tensor (Meta) and
    functionalization; the counts, lr, scale and flag as device scalars or (host_step) host values."""
    step_tensor = None
    if device_scalars:
        step_tensor = scalar(2.0, device)
        kwargs.update(lr_tensor=scalar(kwargs["lr"], device), grad_scale=scalar(8.0, device),
                      found_inf=scalar(0.0, device))
    elif host_step is not None:
        kwargs["step"] = host_step
    args = tuple(t[k] for k in op.keys) + (step_tensor,)
    torch.library.opcheck(getattr(torch.ops.mixprec, op.name).default, args, kwargs)
