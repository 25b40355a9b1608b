# The fourth misuse probe (issue 20), part 1: the five fused optimizers between steps (state and
# .data swapped, master_weights switched, params cast), their options and checkpoints. Every refused
# call must name the call and argument and change nothing; everything else must train as its peer.
from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from amp_support import _tree, assert_same_world
from conftest import assert_bitwise_equal, random_tensor
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

FAMILIES = {"FusedAdam": FusedAdam, "FusedSGD": FusedSGD, "FusedLAMB": FusedLAMB, "FusedAdagrad": FusedAdagrad,
            "FusedNovoGrad": FusedNovoGrad}
# A state tensor shaped like the param, per family (SGD's needs momentum).
STATE_KEY = {"FusedAdam": "exp_avg", "FusedSGD": "momentum_buffer", "FusedLAMB": "exp_avg", "FusedAdagrad": "sum",
             "FusedNovoGrad": "exp_avg"}


def family_kw(name: str) -> dict:
    return dict(lr=0.1, momentum=0.9) if name == "FusedSGD" else dict(lr=0.01)


def make(cls, gen, dtype=torch.float32, shapes=((5, 3), (7,)), **kw):
    """Params with fresh random values and gradients, and an optimizer of `cls` over them."""
    ps = [torch.nn.Parameter(random_tensor(s, torch.float32, "cpu", gen).to(dtype)) for s in shapes]
    for p in ps:
        p.grad = random_tensor(p.shape, torch.float32, "cpu", gen).to(dtype)
    kw.setdefault("lr", 0.1)
    return ps, cls(ps, **kw)


def _dense(t):
    return t.to_dense() if isinstance(t, torch.Tensor) and t.is_sparse else t


def world(*objs) -> list:
    """A deep copy of everything a refused call must leave alone: each optimizer's groups, state,
    params (with version counters) and grads; each tensor; each dict."""
    out = []
    for o in objs:
        if isinstance(o, torch.optim.Optimizer):
            params = [p for g in o.param_groups for p in g["params"]]
            out.append(_tree([o.state_dict(), [g.get("step") for g in o.param_groups], params,
                              [_dense(p.grad) for p in params], [p._version for p in params],
                              sorted(k for k in vars(o) if not k.startswith("_"))]))
        else:
            out.append(_tree(o))
    return out


def refused(call, objs, exc, *patterns) -> None:
    """`call()` raises `exc` whose message has every pattern (regexes), and `objs` stay as they were."""
    before = world(*objs)
    with pytest.raises(exc) as info:
        call()
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in {str(info.value)!r}"
    assert_same_world(before, world(*objs))


# ---- between steps: tensors swapped under the optimizer ------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_state_tensor_cast_in_place_is_refused_by_name(name, gen):
    ps, opt = make(FAMILIES[name], gen, **family_kw(name))
    opt.step()
    key = STATE_KEY[name]
    opt.state[ps[1]][key].data = opt.state[ps[1]][key].data.double()
    refused(opt.step, [opt], TypeError, r"mixprec::\w+_: \w+\[1\] has dtype Double")


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedAdagrad"])
def test_a_state_tensor_replaced_by_a_flat_one_is_refused_by_name(name, gen):
    ps, opt = make(FAMILIES[name], gen, **family_kw(name))
    opt.step()
    opt.state[ps[0]][STATE_KEY[name]] = torch.zeros(15)
    refused(opt.step, [opt], ValueError, r"\w+\[0\] has shape \[15\] but mixprec::\w+_: params\[0\] has shape \[5, 3\]")


def test_a_deleted_state_tensor_raises_keyerror_as_torch_and_changes_nothing(gen):
    # PEER-SAME: torch.optim.Adam raises KeyError 'exp_avg_sq' too.
    ps, opt = make(FusedAdam, gen)
    opt.step()
    del opt.state[ps[1]]["exp_avg_sq"]
    refused(opt.step, [opt], KeyError, "exp_avg_sq")


@pytest.mark.parametrize("change, exc, pattern", [
    (lambda p: (setattr(p, "data", torch.randn(7, 2)), setattr(p, "grad", torch.randn(7, 2))), ValueError,
     r"exp_avgs\[0\] has shape \[5, 3\] but .*params\[0\]"),
    (lambda p: setattr(p.grad, "data", p.grad.data.double()), TypeError, r"adam_: grads\[0\] has dtype Double"),
    (lambda p: setattr(p.grad, "data", p.grad.data.flatten()), ValueError, r"adam_: grads\[0\] has shape \[15\]"),
    (lambda p: setattr(p, "grad", p.grad.to_sparse()), RuntimeError, "FusedAdam does not support sparse gradients"),
], ids=["param_reshaped", "grad_float64", "grad_flattened", "grad_sparse"])
def test_a_param_or_grad_swapped_through_data_is_refused(change, exc, pattern, gen):
    ps, opt = make(FusedAdam, gen)
    opt.step()
    change(ps[0])
    refused(opt.step, [opt], exc, pattern)


def test_a_param_appended_twice_to_its_group_by_hand_is_refused(gen):
    ps, opt = make(FusedAdam, gen)
    opt.param_groups[0]["params"].append(ps[0])
    refused(opt.step, [opt], ValueError, r"adam_: (\w+)\[0\] shares memory with \1\[2\]")


@pytest.mark.parametrize("cls", [FusedSGD, torch.optim.SGD])
def test_a_param_appended_to_a_second_group_by_hand_steps_twice_as_in_torch(cls, gen):
    # PEER-SAME: add_param_group refuses it; a hand edit of param_groups steps it once per group in
    # torch.optim.SGD as in FusedSGD.
    ps, _ = make(FusedSGD, gen)
    opt = cls([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.1)
    opt.param_groups[1]["params"].append(ps[0])
    w, g = ps[0].detach().clone(), ps[0].grad.clone()
    opt.step()
    torch.testing.assert_close(ps[0].detach(), w - 0.2 * g, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("what", ["requires_grad_off", "zero_grad_keep", "fp16_grad"])
def test_odd_but_valid_params_step_as_torch_does(what, gen):
    """A param with requires_grad=False but a grad, zeroed (not None) grads, an fp16 grad under an
    fp32 param: torch.optim.AdamW steps them; FusedAdam matches (fp32, 1e-6)."""
    ps, opt = make(FusedAdam, gen, weight_decay=0.01)
    ref_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for r, p in zip(ref_ps, ps):
        r.grad = p.grad.clone()
    ref = torch.optim.AdamW(ref_ps, lr=0.1, weight_decay=0.01)
    opt.step()
    ref.step()
    if what == "requires_grad_off":
        ps[0].requires_grad_(False)
    elif what == "zero_grad_keep":
        opt.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    else:
        ps[0].grad.data = ps[0].grad.data.half()
        ref_ps[0].grad = ps[0].grad.float()
    opt.step()
    ref.step()
    for p, r in zip(ps, ref_ps):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-6)


# ---- master weights switched or outgrown -------------------------------------------------------

@pytest.mark.parametrize("mode", [True, "remainder"])
@pytest.mark.parametrize("how", ["attribute", "group"])
def test_masters_switched_off_and_on_again_continue_from_the_params(mode, how, gen):
    """A group stepped without its masters updates the params alone: the old masters are stale,
    and switched on again they would bring back weights from before (they did). Now they are
    dropped, and made anew from the params."""
    ps, opt = make(FusedSGD, gen, dtype=torch.bfloat16, master_weights=mode)

    def switch(value):
        if how == "attribute":
            opt.master_weights = value
        else:
            opt.param_groups[0]["master_weights"] = value

    opt.step()
    switch(False)
    for p in ps:
        p.grad = random_tensor(p.shape, torch.float32, "cpu", gen).bfloat16()
    opt.step()
    assert all(not ({"master_param", "master_remainder"} & set(opt.state[p])) for p in ps)
    switch(mode)
    weights = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()  # no momentum, zero grads: the weights must stay put
    for p, w in zip(ps, weights):
        assert_bitwise_equal(p.detach(), w)
    assert {"master_param", "master_remainder"} & set(opt.state[ps[0]])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_param_cast_to_bf16_after_steps_gets_a_master(name, gen):
    """model.bfloat16() after steps of an fp32 model, master_weights=True: the op was handed the
    bf16 param as its own master (a TypeError naming master_params, which the user never passed).
    Now the param gets an fp32 master from its value, as at a first step (the C++ front's
    ensure_state), and steps like a param that had one from the start."""
    kw = dict(family_kw(name), master_weights=True)
    ps, opt = make(FAMILIES[name], gen, **kw)
    opt.step()
    for p in ps:
        p.data = p.data.bfloat16()
        p.grad = random_tensor(p.shape, torch.float32, "cpu", gen).bfloat16()
    twin = copy.deepcopy(opt)  # stepped from masters made by hand: the reference
    twin_ps = [p for g in twin.param_groups for p in g["params"]]
    for q, p in zip(twin_ps, ps):
        q.grad = p.grad.clone()  # (a deepcopy of a Parameter leaves its grad behind)
        twin.state[q]["master_param"] = q.detach().float()
    opt.step()
    twin.step()
    for p, q in zip(ps, twin_ps):
        assert opt.state[p]["master_param"].dtype == torch.float32
        assert_bitwise_equal(opt.state[p]["master_param"], twin.state[q]["master_param"])
        assert_bitwise_equal(p.detach(), q.detach())


def test_a_param_cast_to_bf16_without_masters_keeps_its_fp32_state(gen):
    ps, opt = make(FusedAdam, gen)
    opt.step()
    ps[0].data = ps[0].data.bfloat16()
    ps[0].grad = random_tensor(ps[0].shape, torch.float32, "cpu", gen).bfloat16()
    opt.step()
    assert opt.state[ps[0]]["exp_avg"].dtype == torch.float32 and "master_param" not in opt.state[ps[0]]
    assert bool(torch.isfinite(ps[0]).all())


def test_a_param_overwritten_under_masters_is_rewritten_from_its_master(gen):
    # PEER-SAME (Apex's O2): the master is the weight; a write to the model copy is lost at the step.
    ps, opt = make(FusedSGD, gen, dtype=torch.bfloat16, master_weights=True)
    opt.step()
    ps[0].data = torch.zeros_like(ps[0].data)
    opt.step()
    assert_bitwise_equal(ps[0].detach(), opt.state[ps[0]]["master_param"].bfloat16())


# ---- options: refused at construction, naming them -------------------------------------------

BAD_OPTIONS = [
    (FusedAdam, dict(seed=-1), "seed"), (FusedAdam, dict(seed=2**63), "seed"), (FusedAdam, dict(seed=1.0), "seed"),
    (FusedAdam, dict(seed=True), "seed"),
    (FusedSGD, dict(master_weights=2), "master_weights"), (FusedSGD, dict(master_weights="True"), "master_weights"),
    (FusedSGD, dict(master_weights=None), "master_weights"), (FusedSGD, dict(master_weights=1.0), "master_weights"),
    (FusedAdam, dict(state_dtype=torch.float16), "state_dtype"), (FusedAdam, dict(state_dtype="float32"), "state_dtype"),
    (FusedAdam, dict(state_dtype="param"), "state_dtype"), (FusedSGD, dict(state_dtype=torch.float16), "state_dtype"),
    (FusedSGD, dict(state_dtype="float32"), "state_dtype"), (FusedSGD, dict(state_dtype=torch.bfloat16), "state_dtype"),
]


@pytest.mark.parametrize("cls, kw, option", BAD_OPTIONS, ids=lambda v: repr(v)[:30])
def test_bad_options_are_named(cls, kw, option):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=rf"{cls.__name__}: defaults: invalid {option} "):
        cls([p], lr=0.1, **kw)


def test_remainder_masters_name_an_fp16_param(gen):
    ps, _ = make(FusedSGD, gen, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"master_weights='remainder' needs bfloat16 params; param group 0 param 0"):
        FusedAdam(ps, master_weights="remainder")


def test_stochastic_rounding_leaves_fp32_params_exact(gen):
    ps, opt = make(FusedAdam, gen, rounding="stochastic", seed=5)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for t, p in zip(twins, ps):
        t.grad = p.grad.clone()
    ref = FusedAdam(twins, lr=0.1)
    opt.step()
    ref.step()
    for p, t in zip(ps, twins):
        assert_bitwise_equal(p.detach(), t.detach())


def test_an_8bit_group_added_after_steps_makes_8bit_state(gen):
    ps, opt = make(FusedAdam, gen, state_dtype=torch.int8)
    opt.step()
    q = torch.nn.Parameter(random_tensor((300,), torch.float32, "cpu", gen).bfloat16())
    q.grad = random_tensor((300,), torch.float32, "cpu", gen).bfloat16()
    opt.add_param_group({"params": [q]})
    opt.step()
    state = opt.state[q]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype, tuple(state["exp_avg_scale"].shape)) == \
        (torch.int8, torch.uint8, (2,))
    assert bool(torch.isfinite(q).all())


# ---- checkpoints -------------------------------------------------------------------------------

CHECKPOINT_KINDS = {
    "adam-int8": (FusedAdam, torch.bfloat16, dict(state_dtype=torch.int8)),
    "adam-bf16-moments": (FusedAdam, torch.float32, dict(state_dtype=torch.bfloat16)),
    "adam-stochastic": (FusedAdam, torch.bfloat16, dict(rounding="stochastic", seed=7)),
    "sgd-param-dtype": (FusedSGD, torch.bfloat16, dict(state_dtype="param", momentum=0.9)),
    "sgd-remainder": (FusedSGD, torch.bfloat16, dict(master_weights="remainder", momentum=0.9)),
    "adagrad-masters": (FusedAdagrad, torch.float16, dict(master_weights=True)),
    "novograd": (FusedNovoGrad, torch.float32, {}),
    "lamb-remainder": (FusedLAMB, torch.bfloat16, dict(master_weights="remainder")),
}


@pytest.mark.parametrize("kind", list(CHECKPOINT_KINDS))
def test_every_checkpoint_kind_loads_weights_only_and_resumes_bit_identically(kind, gen):
    cls, dtype, kw = CHECKPOINT_KINDS[kind]
    ps, opt = make(cls, gen, dtype=dtype, **kw)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for t, p in zip(twins, ps):
        t.grad = p.grad.clone()
    resumed = cls(twins, **dict(kw, lr=0.1))
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    opt.step()
    resumed.step()
    for p, t in zip(ps, twins):
        assert_bitwise_equal(p.detach(), t.detach())


@pytest.mark.parametrize("source, target", [(FusedAdam, FusedLAMB), (FusedAdam, FusedNovoGrad), (FusedAdam, FusedAdagrad),
                                            (FusedAdam, FusedSGD), (FusedLAMB, FusedAdam)], ids=lambda c: c.__name__)
def test_a_checkpoint_of_another_family_is_refused_by_name(source, target, gen):
    _, src = make(source, gen)
    src.step()
    _, opt = make(target, gen)
    refused(lambda: opt.load_state_dict(src.state_dict()), [opt], ValueError,
            rf"{target.__name__}.load_state_dict: param group 0 lacks \[.+\]; not a {target.__name__} checkpoint")


@pytest.mark.parametrize("ids", [[[0, 0], [2]], [[0, 1], [1]]], ids=["twice_in_a_group", "in_two_groups"])
def test_a_checkpoint_giving_one_id_to_two_params_is_refused(ids, gen):
    """torch's loader (and mixprec's before) maps ids to params with a dict: the later param took
    the state, the earlier none; with equal shapes nothing even failed."""
    shapes = ((5, 3), (5, 3), (5, 3))
    ps, src = make(FusedAdam, gen, shapes=shapes)
    src = FusedAdam([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.1)
    src.step()
    sd = src.state_dict()
    for group, group_ids in zip(sd["param_groups"], ids):
        group["params"] = group_ids
    qs, _ = make(FusedAdam, gen, shapes=shapes)
    opt = FusedAdam([{"params": qs[:2]}, {"params": qs[2:]}], lr=0.1)
    refused(lambda: opt.load_state_dict(sd), [opt], ValueError,
            r"FusedAdam.load_state_dict: param group \d lists parameter id \d, which the checkpoint gives to another "
            "parameter too")


def test_a_contiguous_checkpoint_loads_into_a_channels_last_param(gen):
    p = torch.nn.Parameter(random_tensor((2, 3, 4, 5), torch.float32, "cpu", gen))
    p.grad = random_tensor(p.shape, torch.float32, "cpu", gen)
    src = FusedAdam([p], lr=0.1)
    src.step()
    q = torch.nn.Parameter(p.detach().clone().to(memory_format=torch.channels_last))
    q.grad = p.grad.clone().to(memory_format=torch.channels_last)
    opt = FusedAdam([q], lr=0.1)
    opt.load_state_dict(src.state_dict())
    assert opt.state[q]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    src.step()
    opt.step()
    assert_bitwise_equal(q.detach().contiguous(), p.detach())


# ---- in-place writes that autograd must see ---------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_step_between_forward_and_backward_is_refused_by_autograd_as_torchs(name, device, gen):
    """torch.optim's in-place updates move the params' version counters, so a backward through a
    graph that saved a weight before the step raises; mixprec's ops did not, and the backward
    computed gradients from the new weights without a word. Every step counts: the first (fully
    checked) one and the held ones after it."""
    model = torch.nn.Linear(8, 8).to(device)
    opt = FAMILIES[name](model.parameters(), **family_kw(name))
    x = random_tensor((4, 8), torch.float32, device, gen).requires_grad_()
    for _ in range(3):
        opt.zero_grad()
        (model(x) ** 2).sum().backward()
        saved = (model(x) ** 2).sum()  # saves the weight for its backward
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()
