# Misuse of the five fused optimizers and their ops, table-driven plus hypothesis: bad
# hyper-parameters, corrupt checkpoints, copies, memory layouts and aliasing. A refused call must
# raise a clear error and leave every param, grad, state tensor and group option bit-identical.
from __future__ import annotations

import copy
import io
import math
import pickle
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_bitwise_equal, assert_rel_err, assert_unchanged, random_tensor, snapshot
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

# name: (class, options of a valid optimizer). SGD with dampening exercises its split first step.
CLASSES = {
    "FusedAdam": (FusedAdam, dict(lr=1e-2, weight_decay=0.01, amsgrad=True)),
    "FusedSGD": (FusedSGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "FusedLAMB": (FusedLAMB, dict(lr=1e-2)),
    "FusedAdagrad": (FusedAdagrad, dict(lr=0.1, lr_decay=0.01)),
    "FusedNovoGrad": (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
}
NAMES = list(CLASSES)
# name: (a moment, the per-parameter state every param with state has, the sums of squares),
# written out here rather than read from the classes, so the tests check the classes' rules.
# (SGD makes its buffers lazily: a state without one is valid.)
STATE = {
    "FusedAdam": ("exp_avg", ("exp_avg", "exp_avg_sq"), ("exp_avg_sq",)),
    "FusedSGD": ("momentum_buffer", (), ()),
    "FusedLAMB": ("exp_avg", ("exp_avg", "exp_avg_sq"), ("exp_avg_sq",)),
    "FusedAdagrad": ("sum", ("sum",), ("sum",)),
    "FusedNovoGrad": ("exp_avg", ("exp_avg",), ()),
}
# name: options by kind, for the random bad values
OPTIONS = {
    "FusedAdam": dict(LR=["lr"], BETAS=["betas"], NON_NEGATIVE=["eps", "weight_decay"]),
    "FusedSGD": dict(LR=["lr"], NON_NEGATIVE=["momentum", "weight_decay"]),
    "FusedLAMB": dict(LR=["lr"], BETAS=["betas"], NON_NEGATIVE=["eps", "weight_decay"]),
    "FusedAdagrad": dict(LR=["lr"], NON_NEGATIVE=["eps", "weight_decay", "lr_decay", "initial_accumulator_value"]),
    "FusedNovoGrad": dict(LR=["lr"], BETAS=["betas"], NON_NEGATIVE=["eps", "weight_decay"]),
}
SHAPES = [(4, 3, 3, 3), (5, 7), (9,), (2, 6, 1, 3)]  # two groups: SHAPES[:2] and SHAPES[2:]
NAN, INF = math.nan, math.inf

_COMMON = [dict(lr=-1e-3), dict(lr=NAN), dict(lr=INF), dict(lr="0.1"), dict(lr=torch.ones(2))]
_ADAMLIKE = [dict(betas=(0.9, 1.0)), dict(betas=(0.9,)), dict(betas=(NAN, 0.9)), dict(eps=-1e-8),
             dict(eps=NAN), dict(weight_decay=-0.1), dict(weight_decay=INF)]
# name: changes to one group that make it invalid, with the option the error must name
BAD_HYPER = [(n, c) for n in NAMES for c in _COMMON] + [
    (n, c) for n in ("FusedAdam", "FusedLAMB", "FusedNovoGrad") for c in _ADAMLIKE] + [
    ("FusedAdam", dict(amsgrad="yes")),
    ("FusedSGD", dict(momentum=-1.0)), ("FusedSGD", dict(momentum=NAN)), ("FusedSGD", dict(dampening=INF)),
    ("FusedSGD", dict(weight_decay=-1.0)), ("FusedSGD", dict(nesterov=True)),
    ("FusedLAMB", dict(max_grad_norm=-1.0)), ("FusedLAMB", dict(max_grad_norm=NAN)),
    ("FusedAdagrad", dict(lr_decay=-1.0)), ("FusedAdagrad", dict(initial_accumulator_value=-0.5)),
    ("FusedAdagrad", dict(eps=NAN)),
    ("FusedNovoGrad", dict(norm_type=1)), ("FusedNovoGrad", dict(norm_type=3.0)),
]


def _id(case):
    name, changes = case
    return name + "-" + ",".join(f"{k}={v!r}" if not isinstance(v, torch.Tensor) else f"{k}=tensor"
                                 for k, v in changes.items())


def make(name, gen, *, dtype=torch.float32, master_weights=False, memory_format=torch.contiguous_format,
         values=None):
    cls, kw = CLASSES[name]
    values = values or [random_tensor(s, torch.float32, "cpu", gen) for s in SHAPES]
    layout = lambda v: memory_format if v.dim() == 4 else torch.contiguous_format
    params = [torch.nn.Parameter(v.to(dtype).clone(memory_format=layout(v))) for v in values]  # never shared
    opt = cls([dict(params=params[:2]), dict(params=params[2:])], master_weights=master_weights, **kw)
    return params, opt


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = torch.empty_like(p).copy_(g)  # the param's layout, as autograd makes it


def train(params, opt, gen, steps=2, twin=None):
    """`steps` steps with fresh grads; `twin` (params, optimizer) gets the same grads and steps."""
    for _ in range(steps):
        grads = [random_tensor(p.shape, p.dtype, "cpu", gen) for p in params]
        for ps, o in [(params, opt)] + ([twin] if twin else []):
            set_grads(ps, grads)
            o.step()


def capture(opt, params):
    """Every tensor (params, grads, state, group tensors) cloned, and every other group option."""
    tensors, options = [], []
    for p in params:
        tensors += [p.detach(), p.grad]
        tensors += [opt.state[p][k] for k in sorted(opt.state.get(p, {})) if isinstance(opt.state[p][k], torch.Tensor)]
    for g in opt.param_groups:
        tensors += [g[k] for k in sorted(g) if isinstance(g[k], torch.Tensor)]
        options.append(repr({k: v for k, v in sorted(g.items()) if k != "params" and not isinstance(v, torch.Tensor)}))
    keys = [sorted(opt.state.get(p, {})) for p in params]
    return snapshot(tensors), options, keys, [len(g["params"]) for g in opt.param_groups]


def assert_same_capture(opt, params, before, what):
    now = capture(opt, params)
    assert now[1:] == before[1:], f"{what}: group options or state keys changed"
    assert_unchanged(before[0], now[0], what)


# ---- hyper-parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", BAD_HYPER, ids=_id)
def test_bad_hyper_parameter_in_a_later_group_refused_before_any_group_steps(case, gen):
    """Found by step() in group 1 after the groups were built: no group steps, nothing changes."""
    name, changes = case
    params, opt = make(name, gen)
    train(params, opt, gen)
    set_grads(params, [random_tensor(p.shape, p.dtype, "cpu", gen) for p in params])
    opt.param_groups[1].update(changes)
    before = capture(opt, params)
    with pytest.raises(ValueError, match=re.escape(f"{name}: param group 1: invalid ") + ".*" + list(changes)[-1]):
        opt.step()
    assert_same_capture(opt, params, before, "after a refused step")


@pytest.mark.parametrize("case", BAD_HYPER, ids=_id)
def test_bad_hyper_parameter_refused_at_construction_and_add_param_group(case, gen):
    name, changes = case
    cls, kw = CLASSES[name]
    key = list(changes)[-1]
    with pytest.raises(ValueError, match=re.escape(f"{name}: defaults: invalid ") + ".*" + key):
        cls([torch.nn.Parameter(torch.ones(3))], **dict(kw, **changes))
    params, opt = make(name, gen)
    extra = torch.nn.Parameter(torch.ones(3))
    before = capture(opt, params)
    with pytest.raises(ValueError, match=re.escape(f"{name}: param group 2: invalid ") + ".*" + key):
        opt.add_param_group(dict(params=[extra], **changes))
    assert_same_capture(opt, params, before, "after a refused add_param_group")


@pytest.mark.parametrize("case", BAD_HYPER, ids=_id)
def test_load_state_dict_refuses_bad_hyper_parameters(case, gen):
    name, changes = case
    params, opt = make(name, gen)
    train(params, opt, gen)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][1].update(changes)
    twin_params, twin = make(name, gen)
    train(twin_params, twin, gen, steps=1)
    before = capture(twin, twin_params)
    with pytest.raises(ValueError, match=re.escape(f"{name}.load_state_dict: param group 1: invalid ")):
        twin.load_state_dict(sd)
    assert_same_capture(twin, twin_params, before, "after a refused load")


def _bad_values(rule_name):
    """Values a rule must refuse: hypothesis draws among them."""
    neg = st.floats(max_value=-1e-30, allow_nan=False, allow_infinity=True)
    junk = st.sampled_from(["1e-3", None, [0.1], object()])
    return {
        "NON_NEGATIVE": st.one_of(neg, st.just(NAN), st.just(INF), junk),
        "BETAS": st.one_of(st.tuples(st.floats(min_value=1.0), st.floats(0, 0.99)),
                           st.tuples(st.floats(0, 0.99), st.one_of(neg, st.just(NAN))), junk),
        "LR": st.one_of(neg, st.just(NAN), st.just(INF), junk),
    }[rule_name]


@given(data=st.data())
def test_random_bad_hyper_parameters_refused_everywhere(data):
    name = data.draw(st.sampled_from(NAMES))
    cls, kw = CLASSES[name]
    key, kind = data.draw(st.sampled_from([(k, kind) for kind, ks in OPTIONS[name].items() for k in ks]))
    value = data.draw(_bad_values(kind))
    with pytest.raises(ValueError, match=re.escape(f"{name}: defaults: invalid {key} ")):
        cls([torch.nn.Parameter(torch.ones(2))], **dict(kw, **{key: value}))


def test_a_parameter_twice_in_one_group_or_two_groups_is_refused():
    """torch only warns for a duplicate within a group; stepping it twice per step is wrong."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    for name in NAMES:
        cls, kw = CLASSES[name]
        with pytest.raises(ValueError, match=re.escape(f"{name}.add_param_group: param group 0: params[1] is params[0]")):
            cls([p, p], **kw)
        opt = cls([p], **kw)
        with pytest.raises(ValueError, match="more than one parameter group"):
            opt.add_param_group(dict(params=[q, p]))
        assert len(opt.param_groups) == 1


# ---- checkpoints -------------------------------------------------------------------------------


def _state_of(sd, key):
    """(param id, state dict) of the first saved param that has `key`."""
    return next((pid, s) for pid, s in sd["state"].items() if key in s)


def _corruptions(name):
    """name: (edit of a state_dict, text the error must contain) for `name`'s checkpoints."""
    moment, required, squares = STATE[name]
    out = {
        "nan_moment": (lambda sd: _state_of(sd, moment)[1][moment].view(-1).__setitem__(0, NAN), moment),
        "inf_master": (lambda sd: _state_of(sd, "master_param")[1]["master_param"].view(-1).__setitem__(-1, INF),
                       "master_param"),
        "moment_truncated": (lambda sd: _state_of(sd, moment)[1].__setitem__(moment, _state_of(sd, moment)[1][moment]
                                                                              .flatten()[:-1]), moment),
        "moment_int": (lambda sd: _state_of(sd, moment)[1].__setitem__(moment, _state_of(sd, moment)[1][moment]
                                                                        .int()), moment),
        "step_nan": (lambda sd: sd["param_groups"][0].__setitem__("step", torch.tensor([NAN])), "step"),
        "step_negative": (lambda sd: sd["param_groups"][1].__setitem__("step", -2.0), "step"),
        "group_truncated": (lambda sd: sd["param_groups"][1]["params"].pop(), "param group 1"),
    }
    for key in squares:
        out[f"negative_{key}"] = (lambda sd, k=key: _state_of(sd, k)[1][k].view(-1).__setitem__(1, -1.0), key)
    for key in required:
        out[f"missing_{key}"] = (lambda sd, k=key: _state_of(sd, k)[1].pop(k), key)
    if name == "FusedNovoGrad":
        out["negative_norms"] = (lambda sd: sd["param_groups"][0]["exp_avg_sq"].__setitem__(0, -1.0), "exp_avg_sq")
    if name == "FusedAdagrad":
        out["per_param_step_nan"] = (lambda sd: _state_of(sd, "sum")[1].__setitem__("step", torch.tensor(NAN)), "step")
    return out


CORRUPT_CASES = [(n, c) for n in NAMES for c in _corruptions(n)]


def _trained_pair(name, gen):
    """A trained fp16 optimizer with masters, and an independently trained twin to load into."""
    params, opt = make(name, gen, dtype=torch.float16, master_weights=True)
    train(params, opt, gen)
    twin_params, twin = make(name, gen, dtype=torch.float16, master_weights=True)
    train(twin_params, twin, gen, steps=1)
    return opt, twin_params, twin


@pytest.mark.parametrize("name,corruption", CORRUPT_CASES)
def test_load_state_dict_refuses_corrupt_state(name, corruption, gen):
    opt, twin_params, twin = _trained_pair(name, gen)
    sd = copy.deepcopy(opt.state_dict())
    edit, named = _corruptions(name)[corruption]
    edit(sd)
    before = capture(twin, twin_params)
    with pytest.raises(ValueError, match=re.escape(f"{name}.load_state_dict") + ".*" + re.escape(named)):
        twin.load_state_dict(sd)
    assert_same_capture(twin, twin_params, before, "after a refused load")


@given(data=st.data())
def test_random_checkpoint_corruption_is_refused(data):
    """Random state entries truncated, dropped (required ones), retyped or given inf/NaN."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    name = data.draw(st.sampled_from(NAMES))
    opt, twin_params, twin = _trained_pair(name, gen)
    sd = copy.deepcopy(opt.state_dict())
    pid = data.draw(st.sampled_from(sorted(k for k, s in sd["state"].items() if s)))
    state = sd["state"][pid]
    key = data.draw(st.sampled_from(sorted(k for k in state if isinstance(state[k], torch.Tensor))))
    how = data.draw(st.sampled_from(["truncate", "drop", "int", "bool", "non_finite", "transpose"]))
    t = state[key]
    if how == "drop" and key not in STATE[name][1] + ("master_param",):
        how = "truncate"
    if how == "truncate":
        state[key] = t.flatten()[:data.draw(st.integers(0, t.numel() - 1))]
    elif how == "drop":
        del state[key]
    elif how in ("int", "bool"):
        state[key] = t.to(torch.int32 if how == "int" else torch.bool)
    elif how == "non_finite":
        t.view(-1)[data.draw(st.integers(0, t.numel() - 1))] = data.draw(st.sampled_from([NAN, INF, -INF]))
    else:
        state[key] = t.flatten().unsqueeze(0)  # same elements, another shape
    before = capture(twin, twin_params)
    with pytest.raises(ValueError, match=re.escape(f"{name}.load_state_dict: state[{pid}]")):
        twin.load_state_dict(sd)
    assert_same_capture(twin, twin_params, before, f"after refusing {how} of {key}")


# ---- copies ------------------------------------------------------------------------------------


def _copy(obj, how):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("name", NAMES)
def test_a_copied_optimizer_trains_bit_identically(name, how, gen):
    params, opt = make(name, gen, dtype=torch.bfloat16, master_weights=True)
    train(params, opt, gen)
    params2, opt2 = _copy((params, opt), how)
    for attr in ("master_weights", "set_grad_none", "capturable", "state_dtype", "materialize_master_grads"):
        assert getattr(opt2, attr, None) == getattr(opt, attr, None), attr
    train(params, opt, gen, steps=3, twin=(params2, opt2))
    for p, q in zip(params, params2):
        assert_bitwise_equal(q.detach(), p.detach(), "param")
        assert sorted(opt.state[p]) == sorted(opt2.state[q])
        for k in opt.state[p]:
            assert_bitwise_equal(opt2.state[q][k], opt.state[p][k], k)
    opt2.zero_grad()
    assert all(q.grad is None for q in params2) == opt.set_grad_none


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_a_fused_adam_checkpoint_converted_as_documented_resumes_in_torch(adam_w_mode, gen):
    """torch.optim.Adam(W) counts steps per parameter: with the group's count copied there (the
    FusedAdam docstring's recipe) torch resumes where FusedAdam stopped."""
    params, opt = make("FusedAdam", gen)
    for g in opt.param_groups:
        g.update(adam_w_mode=adam_w_mode, amsgrad=False)
    train(params, opt, gen, steps=3)
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        for pid in g["params"]:
            sd["state"][pid]["step"] = g["step"].reshape(()).clone()  # torch adds to it in place
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    peer = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
        [dict(params=twins[:2]), dict(params=twins[2:])], foreach=False)
    peer.load_state_dict(sd)
    train(params, opt, gen, steps=3, twin=(twins, peer))
    for p, q in zip(params, twins):
        assert_rel_err(q.detach(), p.detach(), 1e-6, "torch after loading the converted checkpoint")


# ---- errors only the op can see, in a later group: refused before any group steps --------------
def _alias_grad(params):  # group 1's first grad is its param itself: the op's overlap rule refuses it
    params[2].grad = params[2].data


def _transposed_grad(params):  # group 1's (2, 6, 1, 3) param gets a grad in another layout
    params[3].grad = params[3].grad.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("first_step", [True, False])
@pytest.mark.parametrize("spoil", [_alias_grad, _transposed_grad], ids=["aliased-grad", "layout"])
@pytest.mark.parametrize("name", NAMES)
def test_an_op_level_error_in_group_1_changes_nothing(name, spoil, first_step, gen):
    # Before: group 0 stepped (params, moments, step count) and then group 1's op raised.
    params, opt = make(name, gen, dtype=torch.float16, master_weights=True)
    for p in params:
        p.grad = random_tensor(p.shape, torch.float16, "cpu", gen)
    if not first_step:
        opt.step()
        for p in params:
            p.grad = random_tensor(p.shape, torch.float16, "cpu", gen)
    spoil(params)
    before_params, before_state = snapshot(params), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"mixprec::\w+_: "):
        opt.step()
    assert_unchanged(before_params, params, "params")
    after_state = opt.state_dict()
    for g_before, g_after in zip(before_state["param_groups"], after_state["param_groups"]):
        assert sorted(g_before) == sorted(g_after)  # no key made for a refused step (a step tensor, norms)
        for key, value in g_before.items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(g_after[key], value, f"param group key {key!r}")
            else:
                assert g_after[key] == value, key
    assert sorted(before_state["state"]) == sorted(after_state["state"])  # no state made for a refused step
    for k, st_ in before_state["state"].items():
        assert sorted(st_) == sorted(after_state["state"][k])
        assert_unchanged([st_[key] for key in sorted(st_)], [after_state["state"][k][key] for key in sorted(st_)],
                         f"state[{k}]")
