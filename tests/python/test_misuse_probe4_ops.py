# The fourth misuse probe (issue 20), part 2: mixprec's ops called directly (device scalars as 0-dim
# or wrong tensors, lists of the wrong length or layout, memory shared between what an op writes and
# reads, meta tensors beside real ones) and Apex's amp_C / multi_tensor_applier through the alias.
from __future__ import annotations

import pytest
import torch

from conftest import assert_bitwise_equal, random_tensor
from mixprec import _ops
from mixprec.apex_compat import amp_c as amp_C
from mixprec.apex_compat.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
from test_misuse_probe4 import refused

HYPER = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)


def tensors(gen, n=2, shape=(5, 3), device="cpu", positive=False):
    out = [random_tensor(shape, torch.float32, device, gen) for _ in range(n)]
    return [t.abs() for t in out] if positive else out


def adam_lists(gen, device="cpu"):
    """params, grads, exp_avgs, exp_avg_sqs of two entries, fresh random values."""
    return (tensors(gen, device=device), tensors(gen, device=device), tensors(gen, device=device),
            tensors(gen, device=device, positive=True))


# name: (call on adam_lists' (p, g, m, v), exception, the argument the message names)
ADAM_REFUSED = {
    "step_0": (lambda p, g, m, v: _ops.adam_(p, g, m, v, **HYPER), ValueError, "step"),
    "step_negative": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=-3, **HYPER), ValueError, "step"),
    "step_tensor_int32": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step_tensor=torch.zeros(1, dtype=torch.int32),
                                                       **HYPER), TypeError, "step_tensor"),
    "step_tensor_2": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step_tensor=torch.zeros(2), **HYPER), ValueError,
                      "step_tensor"),
    "grad_scale_float64": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, grad_scale=torch.ones(1, dtype=torch.float64),
                                                        **HYPER), TypeError, "grad_scale"),
    "grad_scale_2": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, grad_scale=torch.ones(2), **HYPER), ValueError,
                     "grad_scale"),
    "found_inf_int32": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, found_inf=torch.zeros(1, dtype=torch.int32),
                                                     **HYPER), TypeError, "found_inf"),
    "lr_nan": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, **dict(HYPER, lr=float("nan"))), ValueError, "lr"),
    "beta1_1": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, **dict(HYPER, beta1=1.0)), ValueError, "beta1"),
    "eps_negative": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, **dict(HYPER, eps=-1.0)), ValueError, "eps"),
    "grads_short": (lambda p, g, m, v: _ops.adam_(p, g[:1], m, v, step=1, **HYPER), ValueError, "grads"),
    "max_exp_avg_sqs_short": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, max_exp_avg_sqs=[v[0].clone()], **HYPER),
                              ValueError, "max_exp_avg_sqs"),
    "master_params_short": (lambda p, g, m, v: _ops.adam_(p, g, m, v, step=1, master_params=[p[0].clone()], **HYPER),
                            ValueError, "master_params"),
    "param_sliced": (lambda p, g, m, v: _ops.adam_([p[0][:, :2]], [g[0][:, :2]], [m[0][:, :2]], [v[0][:, :2]], step=1,
                                                   **HYPER), RuntimeError, r"params\[0\] has strides \[3, 1\]"),
    "param_expanded": (lambda p, g, m, v: _ops.adam_([p[0][:1].expand(5, 3)], g[:1], m[:1], v[:1], step=1, **HYPER),
                       RuntimeError, r"params\[0\] has strides \[0, 1\]"),
    "grad_expanded": (lambda p, g, m, v: _ops.adam_(p[:1], [g[0][:1].expand(5, 3)], m[:1], v[:1], step=1, **HYPER),
                      RuntimeError, r"grads\[0\] has strides \[0, 1\]"),
    # Fixed: a Meta kernel answered any call with a meta tensor in it, so a meta grad beside CPU
    # params was a step silently not taken.
    "grad_on_meta": (lambda p, g, m, v: _ops.adam_(p, [g[0].to("meta"), g[1]], m, v, step=1, **HYPER), RuntimeError,
                     r"params\[0\] is on cpu but other tensors of the call are on the meta device"),
    "sgd_momentum_no_buffers": (lambda p, g, m, v: _ops.sgd_(p, g, [], lr=0.1, momentum=0.9), ValueError,
                                "momentum_buffers"),
    "sgd_buffers_no_momentum": (lambda p, g, m, v: _ops.sgd_(p, g, m, lr=0.1, momentum=0.0), ValueError,
                                "momentum_buffers"),
    "sgd_grad_on_meta": (lambda p, g, m, v: _ops.sgd_(p, [g[0], g[1].to("meta")], [], lr=0.1), RuntimeError,
                         r"params\[0\] is on cpu but other tensors"),
}


@pytest.mark.parametrize("case", list(ADAM_REFUSED))
def test_optimizer_op_misuse_is_refused_by_name_and_changes_nothing(case, gen):
    call, exc, arg = ADAM_REFUSED[case]
    p, g, m, v = adam_lists(gen)
    op = "sgd_" if case.startswith("sgd") else "adam_"
    refused(lambda: call(p, g, m, v), [p, g, m, v], exc, rf"mixprec::{op}: {arg}")


@pytest.mark.parametrize("form", ["0-dim", "[1]"])
def test_device_scalars_may_be_0_dim_or_one_element(form, gen):
    """step_tensor, lr_tensor, grad_scale and found_inf: a 0-dim tensor counts as one element."""
    shape = () if form == "0-dim" else (1,)
    p, g, m, v = adam_lists(gen)
    q, h, n, w = [[t.clone() for t in lst] for lst in (p, g, m, v)]
    step = torch.zeros(shape)
    _ops.adam_(p, g, m, v, step_tensor=step, lr_tensor=torch.full(shape, 0.1), grad_scale=torch.full(shape, 4.0),
               found_inf=torch.zeros(shape), **dict(HYPER, lr=0.0))
    _ops.adam_(q, [t / 4.0 for t in h], n, w, step=1, **HYPER)
    assert step.item() == 1.0
    for a, b in zip(p + m + v, q + n + w):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flag", [float("nan"), 0.5, -1.0])
def test_any_non_zero_found_inf_skips_the_step(flag, gen):
    """torch's fused Adam skips only on found_inf == 1 and steps on these; mixprec skips on any
    non-zero flag, so a malformed one cannot apply an overflowing step."""
    p, g, m, v = adam_lists(gen)
    before = [t.clone() for t in p + m + v]
    _ops.adam_(p, g, m, v, step=1, found_inf=torch.full((1,), flag), **HYPER)
    for a, b in zip(p + m + v, before):
        assert_bitwise_equal(a, b)


def test_transposed_lists_step_like_contiguous_ones(gen):
    p, g, m, v = adam_lists(gen)
    q, h, n, w = [[t.t().contiguous() for t in lst] for lst in (p, g, m, v)]
    _ops.adam_([t.t() for t in p], [t.t() for t in g], [t.t() for t in m], [t.t() for t in v], step=1, **HYPER)
    _ops.adam_(q, h, n, w, step=1, **HYPER)
    for a, b in zip(p + m + v, q + n + w):
        assert_bitwise_equal(a.t().contiguous(), b)


def test_zero_size_tensors_and_all_meta_calls_do_nothing():
    z = [torch.zeros(0)]
    _ops.adam_(z, [torch.zeros(0)], [torch.zeros(0)], [torch.zeros(0)], step=1, **HYPER)
    # torch.compile's fake tensors reach the Meta kernel as meta tensors: every one, then.
    _ops.adam_(*[[torch.empty(3, device="meta")] for _ in range(4)], step=1, **HYPER)


@pytest.mark.parametrize("scale", [0.0, float("nan")])
def test_a_zero_or_nan_grad_scale_given_to_the_op_breaks_weights_as_torchs_fused_adam(scale, gen):
    # PEER-SAME: the op reads device scalars on the device (no sync), as torch's fused kernels do;
    # mixprec.GradScaler and amp never hand it such a scale (they refuse one).
    p, g, m, v = adam_lists(gen)
    q, h, n, w = [[t.clone() for t in lst] for lst in (p, g, m, v)]
    _ops.adam_(p, g, m, v, step=1, grad_scale=torch.full((1,), scale), **HYPER)
    torch._fused_adam_(q, h, n, w, [], [torch.ones(()) for _ in q], lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0,
                       eps=1e-8, amsgrad=False, maximize=False, grad_scale=torch.full((), scale))
    for a, b in zip(p, q):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)) and not bool(torch.isfinite(a).all())


# ---- the loss-scaling ops ----------------------------------------------------------------------

def unscale(grads, found, inv=0.5, **kw):
    return lambda: _ops.non_finite_check_and_unscale_(grads, found, torch.full((1,), inv, device=grads[0].device), **kw)


def test_unscale_misuse_is_refused_by_name_and_changes_nothing(gen):
    t, f = tensors(gen), torch.zeros(1)
    cases = [
        (unscale(t, f, out=[torch.empty(5, 3)]), ValueError, "out"),
        (lambda: _ops.non_finite_check_and_unscale_(t, torch.zeros(1, dtype=torch.float64), torch.ones(1)), TypeError,
         "found_inf"),
        (lambda: _ops.non_finite_check_and_unscale_(t, f, torch.ones(1, dtype=torch.int32)), TypeError, "inv_scale"),
        (unscale(t, f, per_tensor_found=torch.zeros(5)), ValueError, "per_tensor_found"),
        (lambda: _ops.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int64), f), TypeError, "growth_tracker"),
        (lambda: _ops.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int32), f, growth_interval=0), ValueError,
         "growth_interval"),
        (lambda: _ops.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int32), f, min_scale=8.0, max_scale=2.0),
         ValueError, "max_scale"),
        (lambda: _ops.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int32), f, hysteresis=2), ValueError,
         "hysteresis_tracker"),
    ]
    for call, exc, arg in cases:
        op = "update_scale_" if arg in ("growth_tracker", "growth_interval", "max_scale", "hysteresis_tracker") \
            else "non_finite_check_and_unscale_"
        refused(call, [t, f], exc, rf"mixprec::{op}: {arg}")


def _swapped_out(t, f):
    return unscale(t, f, out=[t[1], t[0]])


def _twice_in_place(t, f):
    return unscale([t[0], t[0]], f)


def _found_inf_in_a_grad(t, f):
    return unscale(t, t[0].view(-1)[:1])


@pytest.mark.parametrize("make_call, pattern", [
    (_swapped_out, r"non_finite_check_and_unscale_: out\[([01])\] shares memory with grads\[(?!\1)[01]\]"),
    (_twice_in_place, r"non_finite_check_and_unscale_: grads\[[01]\] shares memory with grads\[[01]\]"),
    (_found_inf_in_a_grad, r"non_finite_check_and_unscale_: found_inf shares memory with grads\[0\]"),
], ids=["out_swapped", "grad_twice_in_place", "found_inf_in_a_grad"])
def test_unscale_refuses_memory_it_would_write_twice(make_call, pattern, device, gen):
    """out[0] = grads[1] wrote grads[0]'s values over grads[1] before reading it; a grad listed
    twice was unscaled twice; a found_inf inside a grad was written into it. All ran silently."""
    t, f = tensors(gen, device=device), torch.zeros(1, device=device)
    refused(make_call(t, f), [t, f], ValueError, pattern)


def test_unscale_still_takes_what_shares_nothing_it_writes(gen):
    t = tensors(gen)
    before = [x.clone() for x in t]
    _ops.non_finite_check_and_unscale_([t[0], t[0]], torch.zeros(1))  # a check only: nothing written
    out = torch.empty(5, 3)
    _ops.non_finite_check_and_unscale_(t, torch.zeros(1), torch.full((1,), 0.5), out=[t[0], out])  # entry 0 in place
    assert_bitwise_equal(t[0], before[0] * 0.5)
    assert_bitwise_equal(out, before[1] * 0.5)
    assert_bitwise_equal(t[1], before[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_update_scale_refuses_a_scale_that_is_its_found_inf(device):
    s = torch.full((1,), 4.0, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    refused(lambda: _ops.update_scale_(s, tracker, s), [s, tracker], ValueError,
            r"mixprec::update_scale_: scale shares memory with found_inf")


@pytest.mark.parametrize("op", ["unscale", "update_scale"])
def test_loss_scale_ops_refuse_meta_beside_real_tensors(op):
    g, f = [torch.randn(3)], torch.zeros(1, device="meta")
    if op == "unscale":
        call = lambda: _ops.non_finite_check_and_unscale_(g, f, torch.ones(1, device="meta"))  # noqa: E731
        pattern = r"non_finite_check_and_unscale_: grads\[0\] is on cpu but other tensors"
    else:
        call = lambda: _ops.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int32), f)  # noqa: E731
        pattern = r"update_scale_: scale is on cpu but other tensors"
    refused(call, [g], RuntimeError, pattern)


@pytest.mark.parametrize("tensors_, ord_, exc, pattern", [
    ([torch.ones(3, dtype=torch.int32)], 2.0, TypeError, r"tensors\[0\] has dtype Int"),
    ([torch.ones(3)], 1.0, ValueError, "ord must be 2 or inf, got 1"),
    ([torch.ones(3)], float("nan"), ValueError, "ord must be 2 or inf, got nan"),
    ([torch.ones(3)], -float("inf"), ValueError, "ord must be 2 or inf, got -inf"),
    ([torch.ones(1, 3).expand(5, 3)], 2.0, RuntimeError, r"tensors\[0\] has strides \[0, 1\]"),
], ids=["int", "ord_1", "ord_nan", "ord_minus_inf", "expanded"])
def test_multi_tensor_norm_refuses_by_name(tensors_, ord_, exc, pattern):
    with pytest.raises(exc, match="mixprec::multi_tensor_norm: " + pattern):
        _ops.multi_tensor_norm(tensors_, ord=ord_)


def test_multi_tensor_norm_of_a_transposed_tensor_is_torchs(gen):
    t = random_tensor((5, 3), torch.float32, "cpu", gen).t()
    total, _ = _ops.multi_tensor_norm([t])
    torch.testing.assert_close(total.double(), torch.linalg.vector_norm(t.double()), rtol=1e-6, atol=0)


# ---- Apex's amp_C and multi_tensor_applier through the alias ---------------------------------

NOOP = torch.zeros(1, dtype=torch.int32)


def _adam_c(step=1, mode=1, lists=4):
    def call(g, p, m, v):
        return multi_tensor_applier(amp_C.multi_tensor_adam, NOOP, [g, p, m, v][:lists], 0.1, 0.9, 0.999, 1e-8, step,
                                    mode, 1, 0.0)
    return call


AMP_C_REFUSED = {
    "scale_lengths": (lambda g, p, m, v: multi_tensor_applier(amp_C.multi_tensor_scale, NOOP, [g, p[:1]], 2.0),
                      ValueError, r"multi_tensor_scale: tensor_lists\[1\] has 1 tensors"),
    "noop_int64": (lambda g, p, m, v: multi_tensor_applier(amp_C.multi_tensor_scale, NOOP.long(), [g, p], 2.0),
                   TypeError, "multi_tensor_scale: invalid noop_flag"),
    "float64": (lambda g, p, m, v: multi_tensor_applier(amp_C.multi_tensor_scale, NOOP, [[t.double() for t in g], p],
                                                        2.0), NotImplementedError, r"multi_tensor_scale: tensor_lists\[0\]\[0\] is float64"),
    "scale_swapped_dst": (lambda g, p, m, v: multi_tensor_applier(amp_C.multi_tensor_scale, NOOP, [g, [g[1], g[0]]], 2.0),
                          ValueError, r"multi_tensor_scale: .*out\[[01]\] shares memory with grads\[[01]\]"),
    "axpby_arg_to_check": (lambda g, p, m, v: multi_tensor_applier(amp_C.multi_tensor_axpby, NOOP, [g, p, m], 1.0, 1.0,
                                                                   2), ValueError, "multi_tensor_axpby: invalid arg_to_check 2"),
    "adam_step_0": (_adam_c(step=0), ValueError, "multi_tensor_adam: .*step must be >= 1"),
    # Fixed: int(1.7) made it step 1's bias correction; Apex's binding refuses a float.
    "adam_step_fraction": (_adam_c(step=1.7), TypeError, "multi_tensor_adam: invalid step 1.7"),
    "adam_step_nan": (_adam_c(step=float("nan")), TypeError, "multi_tensor_adam: invalid step nan"),
    "adam_mode_2": (_adam_c(mode=2), ValueError, "multi_tensor_adam: invalid mode 2"),
    "adam_3_lists": (_adam_c(lists=3), ValueError, "multi_tensor_adam: tensor_lists has 3 lists; expected 4"),
    "chunk_0": (lambda g, p, m, v: MultiTensorApply(0)(amp_C.multi_tensor_scale, NOOP, [g, p], 2.0), ValueError,
                "multi_tensor_scale: invalid chunk_size 0"),
}


@pytest.mark.parametrize("case", list(AMP_C_REFUSED))
def test_amp_c_misuse_is_refused_by_name_and_changes_nothing(case, gen):
    call, exc, pattern = AMP_C_REFUSED[case]
    g, p, m, v = adam_lists(gen)
    refused(lambda: call(g, p, m, v), [g, p, m, v, NOOP], exc, "amp_C." + pattern)


def test_amp_c_takes_an_integral_float_step_as_apex_counters_hold_it(gen):
    g, p, m, v = adam_lists(gen)
    q, n, w = [t.clone() for t in p], [t.clone() for t in m], [t.clone() for t in v]
    _adam_c(step=3.0)(g, p, m, v)
    _adam_c(step=3)(g, q, n, w)
    for a, b in zip(p + m + v, q + n + w):
        assert_bitwise_equal(a, b)


def test_amp_c_partly_in_place_scale_and_aliased_axpby_are_computed_right(gen):
    x, y = tensors(gen), tensors(gen)
    x0, y0, out = [t.clone() for t in x], [t.clone() for t in y], torch.empty(5, 3)
    multi_tensor_applier(amp_C.multi_tensor_scale, NOOP, [x, [x[0], out]], 2.0)
    assert_bitwise_equal(x[0], x0[0] * 2.0)
    assert_bitwise_equal(out, x0[1] * 2.0)
    x = [t.clone() for t in x0]
    multi_tensor_applier(amp_C.multi_tensor_axpby, NOOP, [x, y, x], 2.0, 3.0, -1)  # out is x
    for a, b, c in zip(x, x0, y0):
        torch.testing.assert_close(a, 2.0 * b + 3.0 * c, rtol=1e-6, atol=1e-6)
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, NOOP, [[]])
    assert total.tolist() == [0.0] and per.numel() == 0 and NOOP.item() == 0


def test_an_amp_c_name_mixprec_lacks_says_what_to_use():
    with pytest.raises(AttributeError, match="multi_tensor_lamb_mp is not provided .* use mixprec.optimizers.FusedLAMB"):
        amp_C.multi_tensor_lamb_mp  # noqa: B018
