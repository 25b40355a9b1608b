# Per-group master_weights (every fused optimizer) and state_dtype (FusedAdam): a group with its own
# value steps as a separate optimizer would, checkpoints keep it, and a bad value is refused unchanged.
from __future__ import annotations

import copy
import io

import pytest
import torch

from amp_support import make_model
from conftest import assert_bitwise_equal, assert_unchanged, random_tensor
from mixprec import amp
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

# Hyper-parameters away from the defaults where it matters (momentum, decay), so every option is used.
FAMILIES = {
    "FusedAdam": (FusedAdam, dict(lr=1e-2, weight_decay=0.05)),
    "FusedSGD": (FusedSGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "FusedAdagrad": (FusedAdagrad, dict(lr=0.05, weight_decay=0.01, initial_accumulator_value=0.1)),
    "FusedLAMB": (FusedLAMB, dict(lr=1e-2, max_grad_norm=1.0)),
    "FusedNovoGrad": (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
}
NAMES = list(FAMILIES)
SHAPES = [(7,), (3, 5)]


def make_params(gen, dtype, n=2):
    return [torch.nn.Parameter(random_tensor(s, torch.float64, "cpu", gen).to(dtype)) for s in SHAPES[:n]]


def clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def feed(groups, grads):
    for ps, gs in zip(groups, grads):
        for p, g in zip(ps, gs):
            p.grad = g.to(p.dtype).clone()


def random_grads(groups, gen, steps):
    return [[[random_tensor(p.shape, torch.float64, "cpu", gen) for p in ps] for ps in groups] for _ in range(steps)]


def state_tensors(opt, params):
    out = []
    for p in params:
        out += [opt.state[p][k] for k in sorted(opt.state[p]) if isinstance(opt.state[p][k], torch.Tensor)]
    return out


def everything(opt, groups):
    """Every tensor an optimizer step may write: params, state, step counts, group tensors."""
    ps = [p for g in groups for p in g]
    out = [p.detach() for p in ps] + state_tensors(opt, ps)
    for g in opt.param_groups:
        out += [v for k, v in g.items() if k != "params" and isinstance(v, torch.Tensor)]
    return out


def group_options(opt):
    return [{k: v for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)}
            for g in opt.param_groups]


# ---- two groups step like two optimizers -----------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_group_master_weights_step_like_separate_optimizers(name, dtype, gen):
    """Group 0 with masters, group 1 without (the constructor says True, group 1 says False) in
    one optimizer, bit for bit what two optimizers with master_weights=True and False compute.
    (LAMB's global norm spans every group, so its twins are checked with clipping off.)"""
    cls, hyper = FAMILIES[name]
    if name == "FusedLAMB":
        hyper = dict(hyper, max_grad_norm=0.0)
    a, b = make_params(gen, dtype), make_params(gen, dtype)
    a2, b2 = clones(a), clones(b)
    opt = cls([dict(params=a), dict(params=b, master_weights=False)], master_weights=True, **hyper)
    with_m = cls(a2, master_weights=True, **hyper)
    without = cls(b2, master_weights=False, **hyper)
    assert [g["master_weights"] for g in opt.param_groups] == [True, False]
    for grads in random_grads([a, b], gen, 4):
        feed([a, b], grads)
        feed([a2, b2], grads)
        opt.step()
        with_m.step()
        without.step()
    assert all("master_param" in opt.state[p] for p in a)
    assert not any("master_param" in opt.state[p] for p in b)
    for mine, theirs in ((a, a2), (b, b2)):
        twin = with_m if mine is a else without
        for p, q in zip(mine, theirs):
            assert_bitwise_equal(p.detach(), q.detach(), f"{name} param")
            assert sorted(opt.state[p]) == sorted(twin.state[q])
            for k in opt.state[p]:
                assert_bitwise_equal(opt.state[p][k], twin.state[q][k], f"{name} state {k}")


def test_adam_group_state_dtype_steps_like_separate_optimizers(gen):
    """FusedAdam's state_dtype per group: bf16 moments in group 1 only, as a separate optimizer."""
    a, b = make_params(gen, torch.bfloat16), make_params(gen, torch.float32)
    a2, b2 = clones(a), clones(b)
    opt = FusedAdam([dict(params=a), dict(params=b, state_dtype=torch.bfloat16)], master_weights=True, lr=1e-2)
    one = FusedAdam(a2, master_weights=True, lr=1e-2)
    two = FusedAdam(b2, master_weights=True, lr=1e-2, state_dtype=torch.bfloat16)
    for grads in random_grads([a, b], gen, 3):
        feed([a, b], grads)
        feed([a2, b2], grads)
        for o in (opt, one, two):
            o.step()
    assert {opt.state[p]["exp_avg"].dtype for p in a} == {torch.float32}
    assert {opt.state[p]["exp_avg"].dtype for p in b} == {torch.bfloat16}
    for (p, q, twin) in [(p, q, one) for p, q in zip(a, a2)] + [(p, q, two) for p, q in zip(b, b2)]:
        assert_bitwise_equal(p.detach(), q.detach(), "param")
        for k in opt.state[p]:
            assert_bitwise_equal(opt.state[p][k], twin.state[q][k], k)


# ---- the optimizer attribute, add_param_group, checkpoints -------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_attribute_reads_agreeing_groups_and_sets_all(name, gen):
    cls, hyper = FAMILIES[name]
    opt = cls([dict(params=make_params(gen, torch.float16, 1))], master_weights=True, **hyper)
    assert opt.master_weights is True
    opt.add_param_group(dict(params=make_params(gen, torch.float16, 1), master_weights=False))
    opt.add_param_group(dict(params=make_params(gen, torch.float16, 1)))  # takes the constructor's
    assert [g["master_weights"] for g in opt.param_groups] == [True, False, True]
    assert opt.master_weights is True  # groups differ: the constructor's value, what new groups get
    opt.master_weights = False
    assert opt.master_weights is False and opt.defaults["master_weights"] is False
    assert [g["master_weights"] for g in opt.param_groups] == [False, False, False]


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_keeps_group_values_and_resumes_bit_identically(name, gen):
    """state_dict's param_groups hold each group's master_weights (and state_dtype): a fresh
    optimizer built with other constructor values takes them from the checkpoint and continues
    bit for bit as the original."""
    cls, hyper = FAMILIES[name]
    extra = {"state_dtype": torch.bfloat16} if cls is FusedAdam else {}
    a, b = make_params(gen, torch.bfloat16), make_params(gen, torch.float16)
    opt = cls([dict(params=a, master_weights=False), dict(params=b, **extra)], master_weights=True, **hyper)
    grads = random_grads([a, b], gen, 5)
    for g in grads[:2]:
        feed([a, b], g)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    a2, b2 = clones(a), clones(b)
    fresh = cls([dict(params=a2), dict(params=b2)], master_weights=False, **hyper)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert group_options(fresh) == group_options(opt)
    assert [g["master_weights"] for g in fresh.param_groups] == [False, True]
    for g in grads[2:]:
        feed([a, b], g)
        feed([a2, b2], g)
        opt.step()
        fresh.step()
    for x, y in zip(everything(opt, [a, b]), everything(fresh, [a2, b2])):
        assert_bitwise_equal(y, x, f"{name} after resuming")


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_from_before_groups_had_it_takes_this_optimizers_value(name, gen):
    """A checkpoint whose groups lack master_weights (made when it was per optimizer) loads, its
    groups keeping the loading optimizer's value."""
    cls, hyper = FAMILIES[name]
    ps = make_params(gen, torch.float16)
    opt = cls(ps, master_weights=True, **hyper)
    feed([ps], random_grads([ps], gen, 1)[0])
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        del g["master_weights"]
        g.pop("state_dtype", None)
    twin = cls(clones(ps), master_weights=True, **hyper)
    twin.load_state_dict(sd)
    assert twin.param_groups[0]["master_weights"] is True
    assert group_options(twin) == group_options(opt)


@pytest.mark.parametrize("saved,named", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_adam_loads_moments_into_the_groups_state_dtype(saved, named, gen):
    """Loaded moments take the loaded group's state_dtype (the C++ front's rule); a checkpoint
    whose groups lack it (made when it was per optimizer) keeps the dtype its moments have."""
    ps = make_params(gen, torch.float16)
    opt = FusedAdam(ps, master_weights=True, state_dtype=saved, amsgrad=True)
    feed([ps], random_grads([ps], gen, 1)[0])
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["state_dtype"] = named
    twins = clones(ps)
    new = FusedAdam(twins, master_weights=True, amsgrad=True)
    new.load_state_dict(sd)
    assert new.param_groups[0]["state_dtype"] is named
    for p, q in zip(ps, twins):
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_bitwise_equal(new.state[q][k], opt.state[p][k].to(named), k)
    del sd["param_groups"][0]["state_dtype"]
    legacy = FusedAdam(clones(ps), master_weights=True, amsgrad=True, state_dtype=named)
    legacy.load_state_dict(sd)
    assert legacy.param_groups[0]["state_dtype"] is saved
    assert {v.dtype for s in legacy.state.values() for k, v in s.items() if k != "master_param"} == {saved}


def test_pickle_from_when_it_was_an_attribute_restores_it_in_every_group(gen):
    """An optimizer pickled when master_weights and state_dtype were attributes (its groups and
    defaults lack them) comes back with them in the defaults and every group, and steps."""
    ps = make_params(gen, torch.float16)
    opt = FusedAdam(ps, master_weights=True, state_dtype=torch.bfloat16)
    state = opt.__getstate__()
    for d in [state["defaults"]] + state["param_groups"]:
        del d["master_weights"], d["state_dtype"]
    state.update(master_weights=True, state_dtype=torch.bfloat16)
    old = FusedAdam.__new__(FusedAdam)
    old.__setstate__(state)
    assert old.master_weights is True and old.state_dtype is torch.bfloat16
    assert all(g["master_weights"] is True and g["state_dtype"] is torch.bfloat16 for g in old.param_groups)
    assert "master_weights" not in vars(old) and "state_dtype" not in vars(old)
    feed([ps], random_grads([ps], gen, 1)[0])
    old.step()
    assert all(old.state[p]["master_param"].dtype == torch.float32 for p in ps)
    assert all(old.state[p]["exp_avg"].dtype == torch.bfloat16 for p in ps)


# ---- refused values change nothing --------------------------------------------------------------


BAD = [("master_weights", 2), ("master_weights", "yes"), ("master_weights", None)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("key,value", BAD + [("state_dtype", torch.float16), ("state_dtype", "bf16")])
@pytest.mark.parametrize("how", ["constructor", "add_param_group", "group_then_step", "load_state_dict",
                                 "attribute"])
def test_bad_group_value_is_refused_and_changes_nothing(name, key, value, how, gen):
    cls, hyper = FAMILIES[name]
    if key == "state_dtype" and cls is not FusedAdam:
        pytest.skip("state_dtype is FusedAdam's alone")
    message = f"{name}: .*invalid {key} {value!r}; expected"
    a, b = make_params(gen, torch.float16), make_params(gen, torch.float16)
    if how == "constructor":
        with pytest.raises(ValueError, match=f"{name}: param group 1: invalid {key}"):
            cls([dict(params=a), dict(params=b, **{key: value})], master_weights=True, **hyper)
        return
    opt = cls([dict(params=a), dict(params=b)], master_weights=True, **hyper)
    grads = random_grads([a, b], gen, 2)
    feed([a, b], grads[0])
    opt.step()
    feed([a, b], grads[1])
    before, options = [t.clone() for t in everything(opt, [a, b])], group_options(opt)
    defaults = dict(opt.defaults)
    if how == "add_param_group":
        with pytest.raises(ValueError, match=f"{name}.add_param_group: param group 2: invalid {key}|"
                                             f"{name}: param group 2: invalid {key}"):
            opt.add_param_group(dict(params=make_params(gen, torch.float16, 1), **{key: value}))
    elif how == "group_then_step":
        opt.param_groups[1][key] = value
        with pytest.raises(ValueError, match=f"{name}: param group 1: invalid {key}"):
            opt.step()
        opt.param_groups[1][key] = options[1][key]
    elif how == "load_state_dict":
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][1][key] = value
        with pytest.raises(ValueError, match=f"{name}.load_state_dict: param group 1: invalid {key}"):
            opt.load_state_dict(sd)
    else:
        with pytest.raises(ValueError, match=message):
            setattr(opt, key, value)
    assert len(opt.param_groups) == 2 and opt.defaults == defaults
    assert group_options(opt) == options
    assert_unchanged(before, everything(opt, [a, b]), f"{name} after refusing {key}={value!r} ({how})")


# ---- amp's O2 keeps masters for every group ------------------------------------------------------


def test_amp_o2_gives_every_group_masters_and_refuses_a_group_without(gen):
    """O2 turns master_weights on in every group, one that named False included (Apex's O2: every
    fp16 param has an fp32 master), and refuses a group added without them, changing nothing."""
    model = make_model(gen, "cpu")
    first = list(model[0].parameters()) + list(model[1].parameters())
    opt = FusedAdam([dict(params=first), dict(params=list(model[3].parameters()), master_weights=False)], lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert opt.master_weights is True and [g["master_weights"] for g in opt.param_groups] == [True, True]
    low = [p for g in opt.param_groups for p in g["params"] if p.dtype == torch.float16]
    assert {id(p) for p in low} >= {id(p) for p in model[3].parameters()}
    masters = [opt.state[p]["master_param"].clone() for p in low]
    opt.zero_grad()
    loss = model(random_tensor((16, 8), torch.float32, "cpu", gen)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    for p, old in zip(low, masters):
        master = opt.state[p]["master_param"]
        assert not torch.equal(master, old), "the master is what steps"
        assert_bitwise_equal(p.detach(), master.half(), "the model copy is the rounded master")
    before, options = [t.clone() for t in everything(opt, [list(g["params"]) for g in opt.param_groups])], \
        group_options(opt)
    extra = torch.nn.Parameter(random_tensor((3,), torch.float16, "cpu", gen))
    with pytest.raises(ValueError, match="FusedAdam.add_param_group: param group 2: invalid master_weights "
                                         "False; expected True under amp's O2"):
        opt.add_param_group(dict(params=[extra], master_weights=False))
    assert len(opt.param_groups) == 2 and group_options(opt) == options and extra not in opt.state
    assert_unchanged(before, everything(opt, [list(g["params"]) for g in opt.param_groups]), "after refusing")
