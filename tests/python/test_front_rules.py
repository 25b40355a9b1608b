# The rules both fronts apply before an op, as the Python front applies them: its answers and errors
# must be the library ops' (fp8_linear_ineligibility, master_remainder_check), which the C++ front
# calls too (tests/cpp/test_front_rules.cpp holds the C++ half, over the same cases and texts).
from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_unchanged, random_tensor, snapshot

import mixprec
from mixprec import fp8
from mixprec.fp8 import linear as fp8_linear_module
from mixprec.optimizers import _lean

OPS = torch.ops.mixprec
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _op_refuses(x, w, state) -> bool:
    try:
        OPS.fp8_linear(x, w, None, state.scale, state.amax, state.amax_history, E4M3, E5M2)
    except (ValueError, TypeError, RuntimeError):
        return True
    return False


# Every (out, in, input shape, dtypes) around the boundaries, as in the C++ half: features 0, 8,
# 16, 24 and 32, token counts 0, 8, 16, 24 and 32 in 1-D, 2-D and 3-D inputs, a mismatched last
# dimension, non-float dtypes.
GRID = list(itertools.product((0, 8, 16, 24, 32), (0, 8, 16, 32), ((), (0,), (8,), (16,), (24,), (2, 16)),
                              (0, 16), ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                        (torch.float64, torch.float32), (torch.float32, torch.float64))))


def test_fp8_linear_falls_back_exactly_where_the_op_refuses(device, gen, monkeypatch):
    cases = fell_back = 0
    for n, k, lead, extra, (x_dtype, w_dtype) in GRID:
        what = f"n {n} k {k} x {lead + (k + extra,)} {x_dtype}/{w_dtype}"
        x = random_tensor(lead + (k + extra,), x_dtype, device, gen)
        w = random_tensor((n, k), w_dtype, device, gen, 0.1)
        why = OPS.fp8_linear_ineligibility(w, x)  # the C++ front's fp8::linear asks the same function
        state = fp8.Fp8ScalingState(fp8.Fp8Recipe(), device=device)
        assert (why == "") != _op_refuses(x, w, state), f"{what}: rule {why!r}"
        # The twin torch.compile traces (it cannot call an op returning a str) answers alike.
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            assert fp8_linear_module._falls_back(x, w) == bool(why), what
        if extra or x_dtype != w_dtype:
            continue  # plain linear raises or mixes dtypes for these
        layer_state = fp8.Fp8ScalingState(fp8.Fp8Recipe(), device=device)
        layer_state.fallbacks = 0
        before = snapshot([layer_state.scale, layer_state.amax, layer_state.amax_history])
        y = fp8.fp8_linear(x, w, None, layer_state)
        assert layer_state.fallbacks == (1 if why else 0), what
        if why:
            assert torch.equal(y, torch.nn.functional.linear(x, w)), what
            assert_unchanged(before, [layer_state.scale, layer_state.amax, layer_state.amax_history])
        cases += 1
        fell_back += layer_state.fallbacks
    assert 0 < fell_back < cases  # both paths taken


@pytest.mark.parametrize("in_features, out_features, dtype, expected", [
    (32, 16, torch.float32, None),
    (0, 16, torch.bfloat16, None),  # 0 is a multiple of 16: plain linear at every call
    (20, 16, torch.float32, "in_features=20 not a multiple of 16"),
    (20, 10, torch.float32, "in_features=20, out_features=10 not a multiple of 16"),
    (16, 16, torch.int32, "weight dtype torch.int32 is not float32, float16 or bfloat16"),
])
def test_ineligibility_is_the_ops_answer_in_the_same_words(in_features, out_features, dtype, expected):
    linear = torch.nn.Linear(in_features, out_features)
    linear.weight = torch.nn.Parameter(linear.weight.detach().to(dtype), requires_grad=dtype.is_floating_point)
    assert fp8.ineligibility(linear) == expected
    assert OPS.fp8_linear_ineligibility(linear.weight, None) == (expected or "")
    assert fp8.ineligibility(torch.nn.Tanh()) == "Tanh is not an nn.Linear"


@pytest.mark.parametrize("bad", [torch.float16, torch.float32])
def test_remainder_rule_and_text_are_the_ops_and_a_refusal_changes_nothing(bad, device, gen):
    shapes = [((5,), torch.bfloat16), ((3, 4), torch.bfloat16), ((7,), bad), ((2,), torch.float16)]
    ps = [random_tensor(s, d, device, gen).requires_grad_() for s, d in shapes]
    with pytest.raises(ValueError) as front:
        mixprec.optimizers.FusedAdam(ps, master_weights="remainder")
    with pytest.raises(ValueError) as rule:
        OPS.master_remainder_check(ps, "FusedAdam", _lean.REMAINDER_OPTION, "param group 0 param {}")
    assert str(front.value) == str(rule.value)
    assert str(front.value).startswith(f"FusedAdam: master_weights='remainder' needs bfloat16 params; param group 0 "
                                       f"param 2 is {bad} (")
    # A step after the param changed dtype: refused before anything is written.
    good = ps[:2]
    opt = mixprec.optimizers.FusedAdam(good, master_weights="remainder")
    for p in good:
        p.grad = random_tensor(p.shape, p.dtype, device, gen)
    opt.step()
    watched = lambda: good + [opt.state[p][_lean.REMAINDER] for p in good] + [opt.param_groups[0]["step"]]  # noqa: E731
    before = snapshot(watched())
    data, grad = good[1].data, good[1].grad
    good[1].data, good[1].grad = data.to(bad), grad.to(bad)
    with pytest.raises(ValueError, match=f"param group 0 param 1 is {bad} "):
        opt.step()
    good[1].data, good[1].grad = data, grad
    assert_unchanged(before, watched())


def test_loaded_remainder_for_a_non_bf16_param_is_the_ops_type_error_and_changes_nothing(device, gen):
    src = [random_tensor(s, torch.bfloat16, device, gen).requires_grad_() for s in ((6,), (2, 3))]
    source = mixprec.optimizers.FusedAdam(src, master_weights="remainder")
    for p in src:
        p.grad = random_tensor(p.shape, p.dtype, device, gen)
    source.step()
    # The same shapes, param 1 float16 under fp32 masters: the checkpoint's remainder cannot fit it.
    dst = [random_tensor((6,), torch.bfloat16, device, gen).requires_grad_(),
           random_tensor((2, 3), torch.float16, device, gen).requires_grad_()]
    target = mixprec.optimizers.FusedAdam(dst, master_weights=True)
    for p in dst:
        p.grad = random_tensor(p.shape, p.dtype, device, gen)
    target.step()
    watched = lambda: dst + [t for p in dst for t in target.state[p].values() if isinstance(t, torch.Tensor)]  # noqa: E731
    before = snapshot(watched())
    saved = source.state_dict()
    saved["param_groups"][0]["master_weights"] = True  # the options fit; only the remainder does not
    with pytest.raises(TypeError) as front:
        target.load_state_dict(saved)
    tail = " is an int16 remainder, which needs a bfloat16 parameter; the parameter is torch.float16"
    message = str(front.value)
    assert message.endswith(tail), message
    with pytest.raises(TypeError) as rule:  # the op's own words for that slot, as C++'s load asks it
        OPS.master_remainder_check([dst[1]], "", _lean.REMAINDER_OPTION, message[:-len(tail)], True)
    assert str(rule.value) == message
    assert_unchanged(before, watched())
    assert target.param_groups[0]["master_weights"] is True
