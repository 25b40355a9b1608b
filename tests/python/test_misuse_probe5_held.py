# The fifth misuse probe (issue 20), part 2: held (cached) steps under the lean options. Every change
# between steps reaches the next step, as on a fresh copy; skipped steps change no bit; FusedLAMB's held
# global norm follows every group; random option sequences agree on the held and checked paths.
from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import test_optimizer_step_cache as cache
from conftest import assert_bitwise_equal, random_tensor
from test_misuse_probe5_lean import resumed_weights_only, step_pair
from mixprec import GradScaler
from mixprec.optimizers import FusedAdam, FusedLAMB, FusedSGD, _held

# ---- held steps: every change between steps reaches the next one ----------------------------------
# Each configuration trains STEPS steps (the last ones held), then one change is made; the next
# two steps must equal those of a fresh deepcopy (no held steps, no caches), error for error.
LEAN = {
    "adam-remainder": ("adam", torch.bfloat16, dict(master_weights="remainder")),
    "adam-stochastic": ("adam", torch.bfloat16, dict(master_weights=False, rounding="stochastic", seed=11)),
    "adam-int8": ("adam", torch.float32, dict(state_dtype=torch.int8)),
    "adam-remainder-int8": ("adam", torch.bfloat16, dict(master_weights="remainder", state_dtype=torch.int8)),
    "adam-fp16-bf16-moments": ("adam", torch.float16, dict(master_weights=True, state_dtype=torch.bfloat16)),
    "sgd-remainder": ("sgd", torch.bfloat16, dict(master_weights="remainder")),
    "lamb-stochastic": ("lamb", torch.bfloat16, dict(master_weights=False, rounding="stochastic", seed=3)),
    "novograd-remainder": ("novograd", torch.bfloat16, dict(master_weights="remainder")),
}


def seed_changed(opt, gen):
    opt.param_groups[0]["seed"] = opt.param_groups[0]["seed"] + 5


def state_dtype_in_group(opt, gen):
    group = opt.param_groups[0]
    if "state_dtype" in group and isinstance(opt, FusedAdam):
        group["state_dtype"] = torch.float32 if group["state_dtype"] is not torch.float32 else torch.int8


def state_dtype_attribute(opt, gen):
    if isinstance(opt, FusedAdam):
        opt.state_dtype = torch.bfloat16 if opt.param_groups[0]["state_dtype"] is not torch.bfloat16 else torch.int8


def masters_fp32(opt, gen):
    if opt.param_groups[0]["rounding"] != "stochastic":
        opt.master_weights = True


def remainder_in_group(opt, gen):
    if opt.param_groups[0]["rounding"] != "stochastic" and opt.param_groups[0]["params"][0].dtype == torch.bfloat16:
        opt.param_groups[0]["master_weights"] = "remainder"


def rounding_flipped(opt, gen):
    group = opt.param_groups[0]
    if not group["master_weights"]:
        group["rounding"] = "nearest" if group["rounding"] == "stochastic" else "stochastic"


def amsgrad_on(opt, gen):
    group = opt.param_groups[0]
    if "amsgrad" in group and group.get("state_dtype") is not torch.int8:
        group["amsgrad"] = True


def reloaded_weights_only(opt, gen):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))


LEAN_CHANGES = [seed_changed, state_dtype_in_group, state_dtype_attribute, masters_fp32, remainder_in_group,
                rounding_flipped, amsgrad_on, reloaded_weights_only, cache.replace_data, cache.grad_dtype,
                cache.freeze, cache.add_group, cache.lr_tensor, cache.lr_tensor_in_place, cache.state_dict_replaced,
                cache.reorder]


@pytest.mark.parametrize("change", LEAN_CHANGES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("config", list(LEAN))
def test_a_change_between_held_lean_steps_acts_as_on_a_fresh_copy(config, change, gen, seed):
    family, dtype, kw = LEAN[config]
    opt = cache.make(family, dtype, gen, **kw)
    for i in range(cache.STEPS):
        assert cache.outcome(opt, seed + i)[0] == "ok"
    assert _held.HeldSteps.current(opt) is not None  # the next step would be held but for the change
    opt._saved = copy.deepcopy(opt.state_dict())
    change(opt, gen)
    fresh = copy.deepcopy(opt)
    dtypes = getattr(opt, "_next_grad_dtypes", None)
    for i in range(2):
        a, b = cache.outcome(opt, seed + 100 + i, dtypes), cache.outcome(fresh, seed + 100 + i, dtypes)
        cache.assert_same_outcome(a, b)
        if a[0] == "error":
            break


# ---- skipped steps and FusedLAMB's held norm ----------------------------------------------------

@pytest.mark.parametrize("cls, kw", [
    (FusedAdam, dict(master_weights="remainder", state_dtype=torch.int8)),
    (FusedSGD, dict(rounding="stochastic", momentum=0.9)),
    (FusedLAMB, dict(master_weights="remainder")),
], ids=["adam-remainder-int8", "sgd-stochastic", "lamb-remainder"])
def test_a_scaler_skipped_held_lean_step_changes_no_bit(cls, kw, gen):
    """Weights, remainders, 8-bit codes and scales, momentum: a step skipped for an inf gradient
    (held by then) leaves every one bit for bit, and the scale backs off."""
    ps = [torch.nn.Parameter(random_tensor(s, torch.float32, "cpu", gen).bfloat16()) for s in ((300,), (5, 3))]
    opt = cls(ps, lr=1e-2, **kw)
    scaler = GradScaler("cpu", init_scale=2.0**4)
    scaler.scale(torch.ones(()))
    for step in range(5):
        for p in ps:
            p.grad = random_tensor(p.shape, torch.float32, "cpu", gen, 2.0**4).bfloat16()
        if step == 3:
            assert _held.HeldSteps.current(opt) is not None
            ps[1].grad[0, 0] = float("inf")
            before = [t.clone() for t in ps] + [v.clone() for p in ps for v in opt.state[p].values()]
        scaler.step(opt)
        scaler.update()
        if step == 3:
            after = [t.clone() for t in ps] + [v.clone() for p in ps for v in opt.state[p].values()]
            for a, b in zip(before, after):
                assert_bitwise_equal(a, b)
            assert scaler.get_scale() == 2.0**3


def lamb_second_group_clip(opt, ps):
    opt.param_groups[1]["max_grad_norm"] = 0.25


def lamb_grad_dropped(opt, ps):
    opt._drop = 3  # the next grads leave param 3 without one


def lamb_frozen(opt, ps):
    ps[0].requires_grad_(False)


def lamb_group_options_swapped(opt, ps):
    a, b = opt.param_groups
    a["max_grad_norm"], b["max_grad_norm"] = b["max_grad_norm"], a["max_grad_norm"]


@pytest.mark.parametrize("change", [lamb_second_group_clip, lamb_grad_dropped, lamb_frozen, lamb_group_options_swapped],
                         ids=lambda f: f.__name__)
def test_lambs_held_global_norm_sees_a_change_in_any_group(change, gen, seed):
    """Two groups, one clipping: the held norm over every group's grads must be the checked one."""
    ps = [torch.nn.Parameter(random_tensor((5,), torch.float32, "cpu", gen)) for _ in range(4)]
    opt = FusedLAMB([{"params": ps[:2]}, {"params": ps[2:], "max_grad_norm": 0.0}], lr=1e-2, max_grad_norm=0.5)

    def grads(params, s, drop=None):
        g = torch.Generator().manual_seed(s)
        for i, p in enumerate(params):
            p.grad = None if i == drop else random_tensor(p.shape, torch.float32, "cpu", g, 3.0)

    for i in range(3):
        grads(ps, seed + i)
        opt.step()
    assert _held.HeldSteps.current(opt) is not None
    change(opt, ps)
    fresh = copy.deepcopy(opt)
    fresh_ps = [p for g in fresh.param_groups for p in g["params"]]
    for i in range(2):
        for o, params in ((opt, ps), (fresh, fresh_ps)):
            grads(params, seed + 10 + i, getattr(opt, "_drop", None))
            o.step()
        for p, q in zip(ps, fresh_ps):
            assert_bitwise_equal(p.detach(), q.detach(), f"step {i}")


# ---- random sequences of option changes: held and checked steps, and a resume, agree bit for bit --

CHANGE_KINDS = st.one_of(
    st.tuples(st.just("state_dtype"), st.sampled_from([torch.float32, torch.bfloat16, torch.int8]), st.booleans()),
    st.tuples(st.just("master_weights"), st.sampled_from([True, False, "remainder"]), st.booleans()),
    st.tuples(st.just("amsgrad"), st.booleans(), st.just(True)),
    st.tuples(st.just("lr"), st.sampled_from([1e-2, 3e-3]), st.booleans()),
)


def apply_change(opt, change) -> None:
    key, value, in_group = change
    group = opt.param_groups[0]
    if key == "lr":
        group["lr"] = torch.tensor(value) if in_group else value  # a tensor lr, then a float
        return
    # Only valid combinations: the refusals have tests of their own above.
    if (key == "state_dtype" and value is torch.int8 and group["amsgrad"]) or (
            key == "amsgrad" and value and group["state_dtype"] is torch.int8):
        return
    if in_group or key == "amsgrad":
        group[key] = value
    else:
        setattr(opt, key, value)


@given(changes=st.lists(st.tuples(CHANGE_KINDS, st.integers(1, 3)), min_size=1, max_size=4),
                  seed=st.integers(0, 2**31 - 1))
def test_random_option_changes_between_steps_agree_on_every_path(changes, seed):
    """One optimizer takes held steps, its twin every step fully checked; after each change both
    must hold the same bits, and a weights_only checkpoint of the end must resume the same step."""
    gen = torch.Generator().manual_seed(seed)
    start = [random_tensor(s, torch.float32, "cpu", gen).bfloat16() for s in ((300,), (5, 3))]
    pair = []
    for _ in range(2):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        pair.append((ps, FusedAdam(ps, lr=1e-2, master_weights=True)))
    step = 0
    for change, n in [((None,), 1)] + changes:
        for ps, opt in pair:
            if change != (None,):
                apply_change(opt, change)
        for _ in range(n):
            grads = [random_tensor(t.shape, torch.float32, "cpu", gen).bfloat16() for t in start]
            for which, (ps, opt) in enumerate(pair):
                if which:
                    opt.__dict__.pop("_held", None)  # the fully checked path, every step
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
                opt.step()
            step += 1
            (a_ps, a), (b_ps, b) = pair
            for p, q in zip(a_ps, b_ps):
                assert_bitwise_equal(p.detach(), q.detach(), f"step {step}")
                assert sorted(a.state[p]) == sorted(b.state[q])
                for key in a.state[p]:
                    assert_bitwise_equal(a.state[p][key], b.state[q][key], f"step {step}: {key}")
    (ps, opt), _ = pair
    twins, resumed = resumed_weights_only(opt, ps)
    step_pair(opt, ps, resumed, twins, gen, 1)
