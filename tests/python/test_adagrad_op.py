# Tests of the fused Adagrad op mixprec.adagrad_ on CPU and CUDA: one step against float64, low
# precision and master weights, skipped steps, chunk and launch boundaries, bad inputs, opcheck.
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
    boundary_sizes,
    check_rejected,
    inject_non_finite,
    poison_,
    random_tensor,
    snapshot,
    sync,
    unaligned_view,
)
from test_adagrad import LOW, OP, flat, reference_step, scalar  # the float64 reference and shared helpers


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


def op_clone(t):
    return {k: [x.clone() for x in v] for k, v in t.items()}


def op_all(t):
    return [x for k in OP_KEYS for x in t[k]]


def op_reference(t, *, step, **hyper):
    """float64 result (weights, sums) of one step over `t`, concatenated (element-wise update)."""
    return reference_step(flat(t["master_params"] or t["params"]), flat(t["grads"]), flat(t["state_sums"]),
                          step=step, **hyper)


def check_op_result(t, ref, tol, what):
    assert_rel_err(flat(t["master_params"] or t["params"]), ref[0], tol, f"{what}: weights")
    assert_rel_err(flat(t["state_sums"]), ref[1], tol, f"{what}: state_sums")
    for i, (p, m) in enumerate(zip(t["params"], t["master_params"])):
        assert_bitwise_equal(p, m.to(p.dtype), f"{what}: params[{i}] != rounded master")


@pytest.mark.parametrize("config", list(OP_CONFIGS))
def test_op_steps_match_reference(device, config, gen):
    """Three steps from a mid-run state (host step 1, 5, 6) against float64 math, fp32 throughout."""
    hyper = dict(OP_HYPER, **OP_CONFIGS[config])
    t = op_lists([17, 1, 300, 5], device, gen)
    for step in (1, 5, 6):
        t["grads"] = [random_tensor(g.shape, g.dtype, device, gen) for g in t["grads"]]
        ref = op_reference(t, step=step, **hyper)
        op_call(t, step=step, **hyper)
        check_op_result(t, ref, 1e-5, f"{config} step {step}")


def test_op_without_lr_decay_needs_no_step(device, gen):
    """Without lr_decay the step count is unused: step=0 and no step_tensor are fine."""
    hyper = dict(OP_HYPER, lr_decay=0.0)
    t = op_lists([9, 4], device, gen)
    ref = op_reference(t, step=1, **hyper)
    op_call(t, **hyper)
    check_op_result(t, ref, 1e-5, "no lr_decay, no step")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("master", [False, True], ids=["no_master", "master"])
def test_op_low_precision_is_rounded_fp32(device, dtype, grad_dtype, master, gen):
    """The fp16/bf16 step is the fp32 step, rounded once: without masters, fp32 params holding
    the upcast model copy; with masters, fp32 params holding the masters. Bit for bit."""
    hyper = dict(OP_HYPER, adagrad_w_mode=True)
    t = op_lists([33, 7, 130], device, gen, dtype=dtype, grad_dtype=grad_dtype, master=master)
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
        for i, (a, b) in enumerate(zip(t["state_sums"], f["state_sums"])):
            assert_bitwise_equal(a, b, f"state_sums[{i}]")


def test_op_mixed_dtypes_in_one_call(device, gen):
    """Params and grads of different dtypes side by side (one kernel per combination)."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    t = op_lists(list(range(1, 19)), device, gen, dtype=dtypes, grad_dtype=dtypes[::-1] + dtypes[:1], master=True)
    before = op_clone(t)
    op_call(t, step=2, **OP_HYPER)
    for i in range(18):
        ref = op_reference({k: v[i:i + 1] for k, v in before.items()}, step=2, **OP_HYPER)
        check_op_result({k: v[i:i + 1] for k, v in t.items()}, ref, 1e-5, f"tensor {i}")


def test_op_chunk_boundaries_and_unaligned_views(device, gen, rng):
    """Sizes straddling 64 Ki-element chunks plus views at odd offsets (no vector loads): the
    poisoned model copies (masters kept) are all written, every master and every sum changes,
    nothing outside a view is touched."""
    sizes = boundary_sizes(rng)
    t = op_lists(sizes, device, gen, dtype=torch.bfloat16, grad_dtype=torch.float16, master=True)
    hyper = dict(OP_HYPER, weight_decay=0.0)  # no decay: the step never cancels to zero
    bases = []
    for i in (0, 3):  # a master and a sum become unaligned views of larger buffers
        key = "master_params" if i == 0 else "state_sums"
        view, base = unaligned_view(sizes[i], torch.float32, device, gen)
        view.copy_(t[key][i])
        t[key][i] = view
        bases.append(base)
    edges = snapshot([b[0] for b in bases] + [b[-1] for b in bases])
    # Sums no larger than g^2, so each one grows by a visible fraction and each weight moves.
    for s, g in zip(t["state_sums"], t["grads"]):
        s.copy_(g.float().square() * 0.5)
    for x in t["params"]:
        poison_(x)
    start = op_clone(t)
    ref = op_reference(t, step=3, **hyper)
    op_call(t, step=3, **hyper)
    check_op_result(t, ref, 1e-5, "chunk boundaries")
    for key in ("master_params", "state_sums"):
        for i, (a, b) in enumerate(zip(t[key], start[key])):
            assert bool((a != b).all()), f"{key}[{i}] (size {a.numel()}) has elements that were not updated"
    assert_unchanged(edges, [b[0] for b in bases] + [b[-1] for b in bases], "outside the unaligned views")


def test_op_more_tensors_than_one_launch(device, gen, rng):
    """1500 tiny tensors with all four lists live: more than two launch tables (~640 entries for
    four lists); each tensor is checked on its own."""
    sizes = [rng.randint(1, 40) for _ in range(1500)]
    t = op_lists(sizes, device, gen, dtype=torch.float16, grad_dtype=torch.bfloat16, master=True)
    ref = op_reference(t, step=7, **OP_HYPER)
    op_call(t, step=7, **OP_HYPER)
    check_op_result(t, ref, 1e-5, "many tensors")
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    for i, (m, s) in enumerate(zip(t["master_params"], t["state_sums"])):
        assert_rel_err(m, ref[0][offsets[i]:offsets[i + 1]], 1e-5, f"master_params[{i}]")
        assert_rel_err(s, ref[1][offsets[i]:offsets[i + 1]], 1e-5, f"state_sums[{i}]")


def test_op_zero_size_and_empty_lists(device, gen):
    """Zero-size tensors are fine anywhere in the lists; all-zero-size lists still count the step;
    empty lists are a no-op."""
    t = op_lists([0, 5, 0, 9], device, gen, master=True)
    t["params"][1] = t["params"][1].half()
    for k in OP_KEYS:
        t[k][0] = torch.empty(3, 0, device=device)
    ref = op_reference(t, step=3, **OP_HYPER)
    op_call(t, step=3, **OP_HYPER)
    check_op_result(t, ref, 1e-5, "zero-size among others")

    z = op_lists([0, 0], device, gen)
    step = scalar(4.0, device)
    op_call(z, step_tensor=step, **OP_HYPER)
    assert step.item() == 5.0 and all(x.numel() == 0 for x in op_all(z))
    mixprec.adagrad_([], [], [], step=1, **OP_HYPER)


def test_op_step_tensor_equals_host_step(device, gen):
    """step_tensor (the count before this step, incremented on the device) gives exactly the host
    step's results through lr_decay."""
    a = op_lists([20, 3], device, gen, dtype=torch.float16, master=True)
    b = op_clone(a)
    count = scalar(0.0, device)
    for k in range(1, 4):
        a["grads"] = b["grads"] = [random_tensor(g.shape, g.dtype, device, gen) for g in a["grads"]]
        op_call(a, step=k, **OP_HYPER)
        op_call(b, step_tensor=count, **OP_HYPER)
        assert count.item() == k
        for key in OP_KEYS:
            for i, (x, y) in enumerate(zip(a[key], b[key])):
                assert_bitwise_equal(x, y, f"step {k}: {key}[{i}]")


def test_op_lr_tensor_equals_host_lr(device, gen):
    """lr_tensor wins over the host lr (given a different value here) and matches it bit for bit."""
    a = op_lists([20, 3], device, gen)
    b = op_clone(a)
    op_call(a, step=2, **OP_HYPER)
    op_call(b, step=2, lr_tensor=scalar(OP_HYPER["lr"], device), **dict(OP_HYPER, lr=0.5))
    for key in OP_KEYS:
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert_bitwise_equal(x, y, f"lr_tensor: {key}[{i}]")


@pytest.mark.parametrize("scale,grad_dtype", [(2.0**13, torch.float16), (2.0**-3, torch.bfloat16),
                                              (3.7, torch.float32)])
def test_op_grad_scale_unscales(device, scale, grad_dtype, gen):
    """grad_scale divides the grads in the kernel: equal to a step on pre-divided grads, bit for
    bit when the scale is a power of two, to fp32 rounding otherwise; grads are only read."""
    scaled = op_lists([CHUNK + 1, 9], device, gen, dtype=torch.float16, grad_dtype=grad_dtype, master=True)
    plain = op_clone(scaled)
    scaled["grads"] = [(g.double() * scale).to(grad_dtype) for g in scaled["grads"]]
    plain["grads"] = [(g.double() / scale).to(grad_dtype) for g in scaled["grads"]]
    exact = math.log2(scale).is_integer()
    scaled_grads = snapshot(scaled["grads"])
    op_call(scaled, step=3, grad_scale=scalar(scale, device), **OP_HYPER)
    op_call(plain, step=3, **OP_HYPER)
    assert_unchanged(scaled_grads, scaled["grads"], "grads (read-only)")
    for key in ("params", "master_params", "state_sums"):
        if exact:
            for i, (x, y) in enumerate(zip(scaled[key], plain[key])):
                assert_bitwise_equal(x, y, f"grad_scale={scale}: {key}[{i}]")
        elif key != "params":
            assert_rel_err(flat(scaled[key]), flat(plain[key]), 1e-6, key)


@pytest.mark.parametrize("where,value", list(zip(("first", "last", "random"), NON_FINITE)))
def test_op_found_inf_skips_everything(device, where, value, gen):
    """found_inf != 0 (GradScaler's flag; 2 when summed over devices): params, masters, sums and
    step_tensor stay bit-identical, whatever the grads hold. found_inf == 0 steps as if absent."""
    t = op_lists([CHUNK + 3, 4, 9], device, gen, dtype=torch.float16, master=True)
    count, lr, grad_scale = scalar(5.0, device), scalar(0.1, device), scalar(256.0, device)
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
    for key in OP_KEYS:
        for i, (x, y) in enumerate(zip(clean[key], other[key])):
            assert_bitwise_equal(x, y, f"found_inf=0: {key}[{i}]")


def test_op_non_finite_grads_stay_element_wise(device, gen):
    """Without found_inf an inf/NaN gradient reaches only its own elements (torch's behaviour)."""
    t = op_lists([CHUNK + 7, 40], device, gen, master=True)
    positions = [inject_non_finite(t["grads"][0], w, v, gen) for w, v in zip(("first", "last", "random"), NON_FINITE)]
    finite = op_clone(t)
    for p in positions:
        finite["grads"][0].view(-1)[p] = 1.0
    op_call(t, step=2, **OP_HYPER)
    op_call(finite, step=2, **OP_HYPER)
    mask = torch.ones(t["grads"][0].numel(), dtype=torch.bool)
    mask[positions] = False
    for key in ("master_params", "state_sums"):
        got, want = t[key][0].cpu().view(-1), finite[key][0].cpu().view(-1)
        assert_bitwise_equal(got[mask], want[mask], f"{key}[0] away from the non-finite grads")
        assert not bool(got[~mask].isfinite().any()), f"{key}[0] hides a non-finite gradient"
        assert_bitwise_equal(t[key][1], finite[key][1], f"{key}[1]")


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
    "state_sums_longer": (lambda t, kw: t["state_sums"].append(t["state_sums"][0].clone()), ValueError,
                          "state_sums", None),
    "state_sums_missing": (lambda t, kw: t.update(state_sums=[]), ValueError, "state_sums", None),
    "master_params_shorter": (lambda t, kw: t["master_params"].pop(), ValueError, "master_params", None),
    "grads_shape": (_set("grads", 1, lambda x: x.reshape(4, 3)), ValueError, "grads", 1),
    "state_sums_shape": (_set("state_sums", 2, lambda x: x[:-1].clone()), ValueError, "state_sums", 2),
    "params_noncontiguous": (_set("params", 1, _noncontiguous), RuntimeError, "params", 1),
    "state_sums_noncontiguous": (_set("state_sums", 1, _noncontiguous), RuntimeError, "state_sums", 1),
    "master_params_noncontiguous": (_set("master_params", 1, _noncontiguous), RuntimeError, "master_params", 1),
    "state_sums_fp16": (_set("state_sums", 2, lambda x: x.half()), TypeError, "state_sums", 2),
    "state_sums_bf16": (_set("state_sums", 0, lambda x: x.bfloat16()), TypeError, "state_sums", 0),
    "master_params_bf16": (_set("master_params", 1, lambda x: x.bfloat16()), TypeError, "master_params", 1),
    "params_fp64": (_set("params", 2, lambda x: x.double()), TypeError, "params", 2),
    "grads_int": (_set("grads", 0, lambda x: x.int()), TypeError, "grads", 0),
    "step_zero": (_kw(step=0), ValueError, "step", None),
    "lr_negative": (_kw(lr=-1e-3), ValueError, "lr", None),
    "lr_inf": (_kw(lr=math.inf), ValueError, "lr", None),
    "eps_negative": (_kw(eps=-1e-10), ValueError, "eps", None),
    "weight_decay_nan": (_kw(weight_decay=math.nan), ValueError, "weight_decay", None),
    "lr_decay_negative": (_kw(lr_decay=-0.1), ValueError, "lr_decay", None),
}


def _bad_scalar_cases(device):
    z = lambda *a, **k: torch.zeros(*a, device=device, **k)
    return {
        "step_tensor_fp64": (_kw(step_tensor=z(1, dtype=torch.float64)), TypeError, "step_tensor", None),
        "lr_tensor_two_elements": (_kw(lr_tensor=z(2)), ValueError, "lr_tensor", None),
        "grad_scale_int": (_kw(grad_scale=z(1, dtype=torch.int32)), TypeError, "grad_scale", None),
        "found_inf_empty": (_kw(found_inf=z(0)), ValueError, "found_inf", None),
    }


def _run_bad_case(device, gen, case):
    edit, exc, arg, index = case
    t = op_lists([6, (3, 4), 5], device, gen, dtype=torch.float16, master=True)
    kw = dict(OP_HYPER, step=3)
    edit(t, kw)
    scalars = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    check_rejected(lambda: op_call(t, **kw), op_all(t) + scalars, exc, OP, arg, index, device)


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_op_rejects_bad_inputs(device, name, gen):
    """The error names the op, the argument and the list index, and nothing is modified."""
    _run_bad_case(device, gen, BAD_INPUTS[name])


@pytest.mark.parametrize("name", ["step_tensor_fp64", "lr_tensor_two_elements", "grad_scale_int", "found_inf_empty"])
def test_op_rejects_bad_device_scalars(device, name, gen):
    _run_bad_case(device, gen, _bad_scalar_cases(device)[name])


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["grads", "state_sums", "master_params", "step_tensor", "found_inf", "grad_scale"])
def test_op_rejects_wrong_device(name, gen):
    """One operand on the CPU while the op runs on CUDA."""
    t = op_lists([6, (3, 4), 5], "cuda", gen, dtype=torch.float16, master=True)
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


@pytest.mark.parametrize("variant", ["fp32_host_scalars", "bf16_master_device_scalars"])
def test_opcheck(device, variant, gen):
    """Schema (mutation annotations), fake-tensor (Meta) and functionalization checks."""
    full = variant != "fp32_host_scalars"
    t = op_lists([5, (3, 4), 70], device, gen, dtype=torch.bfloat16 if full else torch.float32, master=full)
    kwargs = dict(OP_HYPER)
    step_tensor = None
    if full:
        step_tensor = scalar(2.0, device)
        kwargs.update(lr_tensor=scalar(0.1, device), grad_scale=scalar(8.0, device), found_inf=scalar(0.0, device))
    else:
        kwargs["step"] = 3
    args = (t["params"], t["grads"], t["state_sums"], t["master_params"], step_tensor)
    torch.library.opcheck(torch.ops.mixprec.adagrad_.default, args, kwargs)
