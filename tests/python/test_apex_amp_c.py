# Tests of mixprec's amp_C stand-in (mixprec.apex_compat.amp_c) and multi_tensor_applier: Apex's
# call shapes, float64 references, the noop_flag rules of each Apex kernel, bad input refused.
from __future__ import annotations

import math

import pytest
import torch

from conftest import (
    CHUNK, FLOAT_DTYPES, NON_FINITE, assert_bitwise_equal, assert_rel_err, assert_unchanged, inject_non_finite,
    peer_bound, poison_, random_tensor, snapshot, sync,
)
from mixprec.apex_compat import amp_c
from mixprec.apex_compat.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

SIZES = (0, 1, 7, CHUNK - 1, CHUNK + 1)


def flag(device, value=0) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int32, device=device)


def tensors(gen, device, dtypes, sizes=SIZES, scale=1.0):
    return [random_tensor(n, dtypes[i % len(dtypes)], device, gen, scale) for i, n in enumerate(sizes)]


# ---- multi_tensor_applier ------------------------------------------------------------------------

def test_applier_calls_op_with_chunk_size_first():
    seen = []

    def op(*args):
        seen.append(args)
        return "result"

    lists = [[torch.ones(2)]]
    noop = flag("cpu")
    assert multi_tensor_applier.available and MultiTensorApply.available
    assert multi_tensor_applier.chunk_size == 2048 * 32
    assert multi_tensor_applier(op, noop, lists, 0.5, True) == "result"
    assert MultiTensorApply(123)(op, noop, lists) == "result"
    assert seen[0][0] == 2048 * 32 and seen[0][1] is noop and seen[0][2] is lists and seen[0][3:] == (0.5, True)
    assert seen[1] == (123, noop, lists)


# ---- multi_tensor_scale --------------------------------------------------------------------------

@pytest.mark.parametrize("src_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dst_dtype", FLOAT_DTYPES)
def test_scale_rounds_fp32_product_once(device, gen, src_dtype, dst_dtype):
    src = tensors(gen, device, [src_dtype])
    dst = [poison_(torch.empty_like(t, dtype=dst_dtype)) for t in src]
    before = snapshot(src)
    noop = flag(device)
    multi_tensor_applier(amp_c.multi_tensor_scale, noop, [src, dst], 0.3)
    sync(device)
    for s, d in zip(src, dst):  # fp32 multiply is exactly rounded: one answer, bit for bit
        assert_bitwise_equal(d, (s.float() * torch.tensor(0.3, dtype=torch.float32)).to(dst_dtype), "dst")
        assert_rel_err(d, s.double() * 0.3, {torch.float32: 1e-6}.get(dst_dtype, 1e-2), "vs float64")
    assert_unchanged(before, src, "src")
    assert noop.item() == 0


def test_scale_in_place(device, gen):
    src = tensors(gen, device, [torch.float16, torch.float32])
    expected = [(t.float() * 0.5).to(t.dtype) for t in src]
    multi_tensor_applier(amp_c.multi_tensor_scale, flag(device), [src, src], 0.5)
    for t, e in zip(src, expected):
        assert_bitwise_equal(t, e, "in place")


@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("value", NON_FINITE)
def test_scale_non_finite_sets_flag_and_still_scales(device, gen, where, value):
    src = tensors(gen, device, [torch.float16], sizes=(5, CHUNK + 3, 9))
    inject_non_finite(src[1], where, value, gen)
    dst = [poison_(torch.empty_like(t, dtype=torch.float32)) for t in src]
    noop = flag(device)
    multi_tensor_applier(amp_c.multi_tensor_scale, noop, [src, dst], 2.0)
    assert noop.item() == 1
    for s, d in zip(src, dst):  # Apex's kernel propagates inf/NaN rather than skipping
        assert_bitwise_equal(d, s.float() * 2.0, "dst", nan_equal=True)


def test_scale_with_flag_already_set_scales_and_keeps_it(device, gen):
    src = tensors(gen, device, [torch.float32], sizes=(4, 5))
    dst = [poison_(torch.empty_like(t)) for t in src]
    noop = flag(device, 1)
    multi_tensor_applier(amp_c.multi_tensor_scale, noop, [src, dst], 4.0)
    assert noop.item() == 1
    for s, d in zip(src, dst):
        assert_bitwise_equal(d, s * 4.0, "dst")


# ---- multi_tensor_l2norm / multi_tensor_unscale_l2norm --------------------------------------------

@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_vs_float64(device, gen, per_tensor):
    ts = tensors(gen, device, FLOAT_DTYPES)
    noop = flag(device)
    total, per = multi_tensor_applier(amp_c.multi_tensor_l2norm, noop, [ts], per_tensor)
    ref = torch.stack([t.double().norm() for t in ts])
    assert total.dtype == torch.float32 and total.shape == (1,) and total.device.type == torch.device(device).type
    assert_rel_err(total, ref.norm().reshape(1), 1e-5, "total")
    if per_tensor:
        assert per.dtype == torch.float32 and per.shape == (len(ts),)
        assert_rel_err(per, ref, 1e-5, "per tensor")
        assert per[0].item() == 0.0  # the 0-size tensor
    else:
        assert per.numel() == 0
    assert noop.item() == 0


@pytest.mark.parametrize("value", NON_FINITE)
def test_l2norm_non_finite_sets_flag(device, gen, value):
    ts = tensors(gen, device, [torch.bfloat16], sizes=(3, CHUNK + 1))
    inject_non_finite(ts[1], "random", value, gen)
    noop = flag(device)
    total, per = amp_c.multi_tensor_l2norm(65536, noop, [ts], True)
    assert noop.item() == 1 and not math.isfinite(total.item()) and not math.isfinite(per[1].item())
    assert math.isfinite(per[0].item())
    # An already-set flag does not stop the norm (Apex's kernel computes and propagates).
    total2, _ = amp_c.multi_tensor_l2norm(65536, noop, [ts[:1]], False)
    assert noop.item() == 1 and total2.item() == pytest.approx(ts[0].double().norm().item(), rel=1e-5)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_unscale_l2norm_scales_the_norm_not_the_tensors(device, gen, per_tensor):
    ts = tensors(gen, device, [torch.float16, torch.float32], scale=1024.0)
    before = snapshot(ts)
    inv = torch.full((1,), 1 / 1024, device=device)
    noop = flag(device)
    total, per = amp_c.multi_tensor_unscale_l2norm(65536, noop, [ts], inv, per_tensor)
    ref = torch.stack([(t.double() / 1024).norm() for t in ts])
    assert_rel_err(total, ref.norm().reshape(1), 1e-5, "total")
    if per_tensor:
        assert_rel_err(per, ref, 1e-5, "per tensor")
    assert_unchanged(before, ts, "tensors")
    assert noop.item() == 0
    inject_non_finite(ts[-1], "last", math.inf, gen)
    amp_c.multi_tensor_unscale_l2norm(65536, noop, [ts], inv, per_tensor)
    assert noop.item() == 1


def test_empty_lists_are_no_ops(device):
    noop = flag(device)
    amp_c.multi_tensor_scale(65536, noop, [[], []], 2.0)
    amp_c.multi_tensor_axpby(65536, noop, [[], [], []], 1.0, 1.0, -1)
    total, per = amp_c.multi_tensor_l2norm(65536, noop, [[]], True)
    assert total.tolist() == [0.0] and per.numel() == 0 and noop.item() == 0


# ---- multi_tensor_axpby --------------------------------------------------------------------------

@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.float16, torch.float32, torch.float16),
                                    (torch.bfloat16, torch.float16, torch.float32)])
def test_axpby_vs_float64(device, gen, dtypes):
    x = tensors(gen, device, [dtypes[0]])
    y = tensors(gen, device, [dtypes[1]])
    out = [poison_(torch.empty_like(t, dtype=dtypes[2])) for t in x]
    before = snapshot(x + y)
    noop = flag(device)
    multi_tensor_applier(amp_c.multi_tensor_axpby, noop, [x, y, out], 0.75, -1.5, -1)
    for xi, yi, oi in zip(x, y, out):
        ref = 0.75 * xi.double() - 1.5 * yi.double()
        peer = (0.75 * xi.to(dtypes[2]) - 1.5 * yi.to(dtypes[2])).to(dtypes[2])
        assert_rel_err(oi, ref, peer_bound(dtypes[2], peer, ref, floor=1e-6), "out")
    assert_unchanged(before, x + y, "inputs")
    assert noop.item() == 0


@pytest.mark.parametrize("arg_to_check,bad_in,flagged", [(-1, "x", 1), (-1, "y", 1), (0, "x", 1), (0, "y", 0),
                                                         (1, "x", 0), (1, "y", 1)])
def test_axpby_checks_the_named_argument(device, gen, arg_to_check, bad_in, flagged):
    x = tensors(gen, device, [torch.float32], sizes=(3, CHUNK + 2))
    y = tensors(gen, device, [torch.float16], sizes=(3, CHUNK + 2))
    inject_non_finite((x if bad_in == "x" else y)[1], "random", math.nan, gen)
    out = [torch.empty_like(t) for t in x]
    noop = flag(device)
    amp_c.multi_tensor_axpby(65536, noop, [x, y, out], 2.0, 3.0, arg_to_check)
    assert noop.item() == flagged
    assert_bitwise_equal(out[0], 2.0 * x[0] + 3.0 * y[0].float(), "clean tensor", nan_equal=True)


# ---- bad input: a clear error naming the call and argument, nothing changed -----------------------

def _bad_calls(device):
    f32 = [torch.ones(4, device=device)]
    f16 = [torch.ones(4, device=device, dtype=torch.float16)]
    noop = flag(device)
    return [
        (ValueError, "amp_C.multi_tensor_scale: tensor_lists has 1 lists; expected 2",
         lambda n: amp_c.multi_tensor_scale(65536, n, [f32], 1.0)),
        (TypeError, "amp_C.multi_tensor_scale: invalid noop_flag",
         lambda n: amp_c.multi_tensor_scale(65536, torch.zeros(1, device=device), [f32, f16], 1.0)),
        (ValueError, "amp_C.multi_tensor_l2norm: invalid chunk_size 0",
         lambda n: amp_c.multi_tensor_l2norm(0, n, [f32])),
        (ValueError, r"amp_C.multi_tensor_axpby: tensor_lists\[2\] has 2 tensors but tensor_lists\[0\] has 1",
         lambda n: amp_c.multi_tensor_axpby(65536, n, [f32, f16, f32 * 2], 1.0, 1.0, -1)),
        (ValueError, r"amp_C.multi_tensor_scale: tensor_lists\[1\]\[0\] has 5 elements",
         lambda n: amp_c.multi_tensor_scale(65536, n, [f32, [torch.ones(5, device=device)]], 1.0)),
        (NotImplementedError, r"amp_C.multi_tensor_scale: tensor_lists\[0\]\[0\] is float64",
         lambda n: amp_c.multi_tensor_scale(65536, n, [[torch.ones(4, device=device, dtype=torch.float64)], f32], 1.0)),
        (TypeError, r"amp_C.multi_tensor_l2norm: tensor_lists\[0\]\[0\] has dtype torch.int32",
         lambda n: amp_c.multi_tensor_l2norm(65536, n, [[torch.ones(4, device=device, dtype=torch.int32)]])),
        (ValueError, r"amp_C.multi_tensor_scale: tensor_lists\[0\]\[0\] is not contiguous",
         lambda n: amp_c.multi_tensor_scale(65536, n, [[torch.ones(4, 2, device=device).t()], [torch.ones(2, 4, device=device)]], 1.0)),
        (ValueError, "amp_C.multi_tensor_axpby: invalid arg_to_check 2",
         lambda n: amp_c.multi_tensor_axpby(65536, n, [f32, f32, f16], 1.0, 1.0, 2)),
        (TypeError, "amp_C.multi_tensor_unscale_l2norm: invalid inv_scale",
         lambda n: amp_c.multi_tensor_unscale_l2norm(65536, n, [f32], 0.5)),
    ], f32 + f16, noop


def test_bad_input_is_refused_and_changes_nothing(device):
    calls, tensors_, noop = _bad_calls(device)
    for exc, match, call in calls:
        before = snapshot(tensors_ + [noop])
        with pytest.raises(exc, match=match):
            call(noop)
        assert_unchanged(before, tensors_ + [noop], match)


def test_names_apex_has_and_mixprec_does_not_say_what_to_use():
    with pytest.raises(AttributeError, match="multi_tensor_adam_capturable is not provided.*FusedAdam"):
        getattr(amp_c, "multi_tensor_adam_capturable")
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        getattr(amp_c, "nonsense")
    assert not hasattr(amp_c, "multi_tensor_l2norm_mp")


@pytest.mark.cuda
def test_ops_never_sync_the_host(gen):
    # Apex's kernels queue work and return; the noop_flag <-> found_inf conversion must too.
    ts = tensors(gen, "cuda", [torch.float16], sizes=(5, CHUNK + 1))
    out = [torch.empty_like(t) for t in ts]
    p, m, v = [t.float() for t in ts], [torch.zeros_like(t, dtype=torch.float32) for t in ts], \
        [torch.zeros_like(t, dtype=torch.float32) for t in ts]
    g = [t.float() for t in ts]
    noop = flag("cuda")
    inv = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        amp_c.multi_tensor_scale(65536, noop, [ts, out], 0.5)
        amp_c.multi_tensor_l2norm(65536, noop, [ts], True)
        amp_c.multi_tensor_unscale_l2norm(65536, noop, [ts], inv, True)
        amp_c.multi_tensor_axpby(65536, noop, [ts, ts, out], 1.0, 2.0, -1)
        amp_c.multi_tensor_sgd(65536, noop, [g, p, m], 0.0, 0.9, 0.0, 0.1, False, True, False, 0.5)
        amp_c.multi_tensor_adam(65536, noop, [g, p, m, v], 1e-3, 0.9, 0.99, 1e-8, 1, 1, 1, 0.0)
        amp_c.multi_tensor_adagrad(65536, noop, [g, p, v], 1e-3, 1e-10, 1, 0.01)
        amp_c.multi_tensor_lamb(65536, noop, [g, p, m, v], 1e-3, 0.9, 0.99, 1e-6, 1, 1, 0.01, 1, 1, inv, 1.0)
        amp_c.multi_tensor_novograd(65536, noop, [g, p, m], torch.ones(2, device="cuda"), 1e-3, 0.9, 0.99, 1e-8,
                                    1, 1, 0.0, 1, 1, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert noop.item() == 0


def test_channels_last_tensors_are_taken_as_apex_takes_them(device):
    # Apex's multi_tensor_apply takes tensors dense in channels_last (its nhwc support): the ops
    # run over their memory, so the results are the contiguous ones, in channels_last.
    gen = torch.Generator(device="cpu").manual_seed(3)
    shapes = [(2, 3, 5, 7), (1, 4, 3, 3)]
    xs = [torch.randn(s, generator=gen).to(device) for s in shapes]
    ys = [torch.randn(s, generator=gen).to(device) for s in shapes]
    cl = [t.to(memory_format=torch.channels_last) for t in xs]
    assert not any(t.is_contiguous() for t in cl)
    noop = flag(device)
    outs = [torch.empty_like(t) for t in cl]  # empty_like keeps channels_last
    amp_c.multi_tensor_axpby(65536, noop, [cl, [t.to(memory_format=torch.channels_last) for t in ys], outs],
                             2.0, 8.0, -1)
    for out, x, y in zip(outs, xs, ys):
        assert out.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(out, 2.0 * x + 8.0 * y)
    halves = [torch.empty_like(t, dtype=torch.float16) for t in cl]
    amp_c.multi_tensor_scale(65536, noop, [cl, halves], 0.5)
    for h, x in zip(halves, xs):
        torch.testing.assert_close(h, (0.5 * x).half())
    norm, per_tensor = amp_c.multi_tensor_l2norm(65536, noop, [cl], True)
    torch.testing.assert_close(norm.reshape(()), torch.cat([x.flatten() for x in xs]).norm())
    torch.testing.assert_close(per_tensor, torch.stack([x.norm() for x in xs]))
    assert noop.item() == 0


def test_a_channels_last_tensor_with_peers_in_another_layout_is_refused(device):
    x = torch.ones(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    out = torch.zeros(2, 3, 4, 5, device=device)  # contiguous: Apex would pair elements by memory order
    noop = flag(device)
    with pytest.raises(ValueError, match=r"multi_tensor_scale: tensor_lists\[1\]\[0\] has shape .* same layout"):
        amp_c.multi_tensor_scale(65536, noop, [[x], [out]], 1.0)
    assert out.eq(0).all() and noop.item() == 0
