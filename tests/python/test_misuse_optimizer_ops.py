# Misuse of the fused optimizer ops and layouts: aliasing among the tensors an op writes and reads,
# dense strided layouts (channels_last) through the optimizers, grads laid out unlike their params,
# and calls with nothing in them. Refused calls leave every tensor bit-identical.
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_bitwise_equal, assert_rel_err, assert_unchanged, random_tensor, snapshot
from mixprec import _ops
from mixprec.optimizers import FusedAdam
from test_misuse_optimizers import NAMES, assert_same_capture, capture, make, set_grads, train

N = 8  # elements of every tensor in the aliasing tests


# op: (its lists, in order; the wrapper; the options of a valid call). "norms" holds NovoGrad's
# per-tensor vector, an operand but not a list.
OPS = {
    "adam_": (("params", "grads", "exp_avgs", "exp_avg_sqs"), _ops.adam_, dict(beta1=0.9, beta2=0.99, eps=1e-8)),
    "sgd_": (("params", "grads", "momentum_buffers"), _ops.sgd_, dict(momentum=0.9)),
    "lamb_": (("params", "grads", "exp_avgs", "exp_avg_sqs"), _ops.lamb_,
              dict(beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01)),
    "adagrad_": (("params", "grads", "state_sums"), _ops.adagrad_, dict(lr_decay=0.01)),
    "novograd_": (("params", "grads", "exp_avgs"), _ops.novograd_, dict(beta1=0.9, beta2=0.99, eps=1e-8)),
}


def call(op, t, **kw):
    keys, fn, options = OPS[op]
    lists = [t[k] for k in keys] + (t["norms"] if op == "novograd_" else [])
    fn(*lists, **dict(dict(options, lr=1e-2, step=2), **kw))


def operands(op, gen, n=3):
    """Fresh, separate, positive-valued (valid for sums of squares) operands of `n` entries."""
    keys = OPS[op][0]
    t = {k: [random_tensor((N,), torch.float32, "cpu", gen).abs() for _ in range(n)] for k in keys}
    t["norms"] = [torch.rand(n, generator=gen) + 0.5]
    return t


def everything(t):
    return [x for v in t.values() for x in v]


# name: (edit making two operands share memory, the two operands the error must name)
def _alias(dst, i, src, j):
    def edit(t):
        t[dst][i] = t[src][j]
    return edit


def _overlap(a, i, b, j):
    def edit(t):
        base = torch.cat([t[a][i], t[b][j]])
        t[a][i], t[b][j] = base[:N], base[N // 2:N // 2 + N]  # sharing N/2 elements
    return edit


def alias_cases(op):
    keys = OPS[op][0]
    state = keys[2]
    cases = {
        "param_twice": (_alias("params", 2, "params", 0), ("params[0]", "params[2]")),
        "grad_is_param": (_alias("grads", 1, "params", 1), ("params[1]", "grads[1]")),
        "state_twice": (_alias(state, 1, state, 0), (f"{state}[0]", f"{state}[1]")),
        "grad_is_other_state": (_alias("grads", 0, state, 2), (f"{state}[2]", "grads[0]")),
        "overlapping_params": (_overlap("params", 0, "params", 1), ("params[0]", "params[1]")),
        "overlapping_param_state": (_overlap("params", 2, state, 1), ("params[2]", f"{state}[1]")),
    }
    if len(keys) > 3:  # exp_avg is exp_avg_sq
        cases["moment_is_other_moment"] = (_alias(keys[3], 0, keys[2], 0), (f"{keys[2]}[0]", f"{keys[3]}[0]"))
    return cases


ALIAS_CASES = [(op, c) for op in OPS for c in alias_cases(op)]


@pytest.mark.parametrize("op,case", ALIAS_CASES)
def test_op_refuses_memory_shared_with_what_it_writes(op, case, gen):
    t = operands(op, gen)
    edit, named = alias_cases(op)[case]
    edit(t)
    before = snapshot(everything(t))
    with pytest.raises(ValueError, match=re.escape(f"mixprec::{op}: ") + r"\w+\[\d\] shares memory with") as err:
        call(op, t)
    assert all(n in str(err.value) for n in named), str(err.value)
    assert_unchanged(before, everything(t), f"{op} after refusing {case}")


@pytest.mark.parametrize("op", OPS)
def test_op_lets_grads_share_memory_and_fp32_params_be_their_own_masters(op, gen):
    """Read-only grads may repeat (nothing is written twice), and an fp32 param passed as its own
    master is the one aliasing the kernels are written for: both give the separate-tensor result."""
    t = operands(op, gen)
    t["grads"][2] = t["grads"][0]
    ref = {k: [x.clone() for x in v] for k, v in t.items()}
    call(op, ref)
    call(op, t, master_params=t["params"])
    for a, b in zip(everything(t), everything(ref)):
        assert_bitwise_equal(a, b, op)


@given(data=st.data())
def test_random_views_of_one_buffer_run_iff_nothing_written_is_shared(data):
    """Every operand a random N-element window of one buffer or a tensor of its own: the op raises
    exactly when a written window meets another (grads may meet grads), modifying nothing; else it
    computes what it computes on separate copies, bit for bit."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    op = data.draw(st.sampled_from(list(OPS)))
    t = operands(op, gen)
    pool = random_tensor((4 * N,), torch.float32, "cpu", gen).abs()
    windows = {}  # (list, index) -> start in the pool
    for key in OPS[op][0]:
        for i in range(3):
            start = data.draw(st.one_of(st.none(), st.integers(0, 3 * N)))
            if start is not None:
                t[key][i], windows[(key, i)] = pool[start:start + N], start
    shared = any(abs(s - r) < N and not (a[0] == b[0] == "grads")
                 for a, s in windows.items() for b, r in windows.items() if a < b)
    separate = {k: [x.clone() for x in v] for k, v in t.items()}
    before = snapshot(everything(t) + [pool])
    if shared:
        with pytest.raises(ValueError, match="shares memory with"):
            call(op, t)
        assert_unchanged(before, everything(t) + [pool], "after refusing aliasing")
        return
    call(op, t)
    call(op, separate)
    for a, b in zip(everything(t), everything(separate)):
        assert_bitwise_equal(a, b, f"{op} on windows vs separate tensors")


# ---- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("master_weights", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_channels_last_params_train_like_contiguous_ones(name, master_weights, gen):
    """4-D params in channels_last (and their grads, states and masters with them) take the same
    steps as contiguous copies: bit for bit for element-wise families, to float32 rounding where
    per-tensor norms sum in another order (LAMB, NovoGrad)."""
    dtype = torch.bfloat16 if master_weights else torch.float32
    values = [random_tensor(s, torch.float32, "cpu", gen) for s in ((4, 3, 3, 3), (5, 7), (9,), (2, 6, 1, 3))]
    pa, opt_a = make(name, gen, dtype=dtype, master_weights=master_weights, values=values,
                     memory_format=torch.channels_last)
    pb, opt_b = make(name, gen, dtype=dtype, master_weights=master_weights, values=values)
    assert pa[0].is_contiguous(memory_format=torch.channels_last) and not pa[0].is_contiguous()
    train(pa, opt_a, gen, steps=4, twin=(pb, opt_b))
    exact = name not in ("FusedLAMB", "FusedNovoGrad")
    for a, b in zip(pa, pb):
        for key in opt_b.state[b]:
            x, y = opt_a.state[a][key], opt_b.state[b][key]
            assert x.stride() == a.stride(), f"state {key} left the param's layout"
            if exact:
                assert_bitwise_equal(x.contiguous(), y, key)
            else:
                assert_rel_err(x, y, 1e-6, key)
        if exact:
            assert_bitwise_equal(a.detach().contiguous(), b.detach(), "param")
        else:
            assert_rel_err(a.detach(), b.detach(), 1e-6 if dtype == torch.float32 else 1e-2, "param")


@pytest.mark.parametrize("name", NAMES)
def test_a_grad_laid_out_unlike_its_param_is_refused(name, gen):
    """torch allows p.grad with other strides than p; the kernels would read it in the wrong order."""
    params, opt = make(name, gen, memory_format=torch.channels_last)
    train(params, opt, gen)
    set_grads(params, [random_tensor(p.shape, p.dtype, "cpu", gen) for p in params])
    params[0].grad = params[0].grad.contiguous()  # row-major grad of a channels_last param
    before = capture(opt, params)
    op = {"FusedAdam": "adam_", "FusedSGD": "sgd_", "FusedLAMB": "lamb_", "FusedAdagrad": "adagrad_",
          "FusedNovoGrad": "novograd_"}[name]
    with pytest.raises(ValueError, match=re.escape(f"mixprec::{op}: grads[0] has strides") + ".*" +
                       re.escape("params[0] has strides") + ".*empty_like"):
        opt.step()
    assert_same_capture(opt, params, before, "after refusing the grad's layout")


def test_loaded_state_takes_the_params_layout(gen):
    params, opt = make("FusedAdam", gen, memory_format=torch.channels_last, dtype=torch.float16, master_weights=True)
    train(params, opt, gen)
    sd = opt.state_dict()
    for s in sd["state"].values():
        for k in s:
            s[k] = s[k].contiguous()
    twin_params, twin = make("FusedAdam", gen, memory_format=torch.channels_last, dtype=torch.float16,
                             master_weights=True)
    twin.load_state_dict(sd)
    for p, q in zip(params, twin_params):
        for k, v in twin.state[q].items():
            assert v.stride() == q.stride(), k
            assert_bitwise_equal(v.contiguous(), opt.state[p][k].contiguous(), k)


# ---- calls with nothing in them, and argument errors ----------------------------------------------


@pytest.mark.parametrize("op", list(OPS) + ["multi_tensor_norm"])
def test_op_with_empty_lists_returns_and_still_checks_its_arguments(op):
    """No tensor for the dispatcher to pick a backend by: every family answers the same way (lamb_
    used to raise NotImplementedError from the dispatcher)."""
    if op == "multi_tensor_norm":
        total, per = _ops.multi_tensor_norm([], 2.0, per_tensor=True)
        assert total.item() == 0 and per.numel() == 0
        with pytest.raises(ValueError, match=re.escape("mixprec::multi_tensor_norm: ord")):
            _ops.multi_tensor_norm([], 3.0)
        return
    t = {k: [] for k in OPS[op][0]}
    t["norms"] = [torch.empty(0)]
    call(op, t)
    key = {"sgd_": "momentum", "adagrad_": "lr_decay"}.get(op, "beta1")
    with pytest.raises(ValueError, match=re.escape(f"mixprec::{op}: {key}")):
        call(op, t, **{key: -1.0})


def test_multi_tensor_norm_takes_fro_as_2_and_names_other_ords(gen):
    ts = [random_tensor((5, 3), torch.float32, "cpu", gen), random_tensor((7,), torch.float32, "cpu", gen)]
    total, per = _ops.multi_tensor_norm(ts, "fro", per_tensor=True)
    ref_total, ref_per = _ops.multi_tensor_norm(ts, 2.0, per_tensor=True)
    assert_bitwise_equal(total, ref_total, "fro")
    assert_bitwise_equal(per, ref_per, "fro")
    expected = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in ts]))
    assert math.isclose(total.item(), expected.item(), rel_tol=1e-6)
    for bad, exc in (("nuc", ValueError), (1.0, ValueError), (None, TypeError), (True, TypeError)):
        with pytest.raises(exc, match=re.escape("mixprec::multi_tensor_norm: ") + "(invalid )?ord"):
            _ops.multi_tensor_norm(ts, bad)


def test_o2_fused_adam_trains_a_channels_last_conv_net(gen):
    """apex.amp O2 with FusedAdam, as torch's fused AdamW takes it: the fp32 masters and moments
    stay channels_last with the model, and the model holds its masters rounded after each step."""
    from mixprec import amp
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, max_loss_scale=2.0**8)
    weights = [p for p in model.parameters() if p.dim() == 4]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
    start = [m.detach().clone() for m in amp.master_params(opt)]
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)
        with amp.scale_loss(model(x.to(weights[0].dtype)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    for p, m, s in zip(model.parameters(), amp.master_params(opt), start):
        assert m.dtype == torch.float32 and m.stride() == p.stride()
        assert all(t.stride() == p.stride() for t in opt.state[p].values())
        assert_bitwise_equal(p.detach().contiguous(), m.to(p.dtype).contiguous(), "model copy != rounded master")
        assert not torch.equal(m, s), "the masters must train"
