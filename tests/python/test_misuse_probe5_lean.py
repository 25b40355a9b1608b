# The fifth misuse probe (issue 20), part 1: the lean weight and state options of the fused
# optimizers (remainder masters, stochastic rounding, bf16 and 8-bit Adam moments) changed between
# steps, through param_groups, attributes and checkpoints, on the held (cached) step path too.
from __future__ import annotations

import copy
import io

import pytest
import torch

import test_optimizer_step_cache as cache
from conftest import assert_bitwise_equal, random_tensor
from test_misuse_probe4 import make as make_opt
from test_misuse_probe4 import refused
from mixprec import GradScaler
from mixprec.optimizers import FusedAdam, FusedLAMB, FusedSGD, _held, _lean

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


# ---- FusedAdam's state_dtype and amsgrad set in param_groups between steps -----------------------

def resumed_as(opt, ps, state_dtype):
    """The reference: opt's checkpoint loaded with its groups' state_dtype replaced, into a fresh
    FusedAdam over copies of `ps` (the loader puts the moments into the group's dtype)."""
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group["state_dtype"] = state_dtype
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = FusedAdam(twins, lr=0.1)
    ref.load_state_dict(saved)
    return twins, ref


MOMENT_SWITCHES = [(torch.float32, torch.int8), (torch.int8, torch.float32), (torch.float32, torch.bfloat16),
                   (torch.bfloat16, torch.float32), (torch.bfloat16, torch.int8), (torch.int8, torch.bfloat16)]


@pytest.mark.parametrize("how", ["param_groups", "attribute"])
@pytest.mark.parametrize("old, new", MOMENT_SWITCHES, ids=lambda d: str(d)[6:])
def test_moments_follow_a_state_dtype_changed_between_steps(old, new, how, gen):
    """Set in param_groups, an int8 switch raised KeyError 'exp_avg_scale', int8 back to float
    "exp_avgs[0] has dtype Char", and float32 <-> bfloat16 kept the old moments silently (the
    attribute too, for float moments), so a resumed checkpoint trained differently."""
    ps, opt = make_opt(FusedAdam, gen, shapes=((300,), (5, 3)), state_dtype=old)
    opt.step()
    twins, ref = resumed_as(opt, ps, new)
    if how == "param_groups":
        opt.param_groups[0]["state_dtype"] = new
    else:
        opt.state_dtype = new
        assert opt.state[ps[0]]["exp_avg"].dtype == new  # at once
    for step in range(2):
        for p, t in zip(ps, twins):
            p.grad = random_tensor(p.shape, torch.float32, "cpu", gen)
            t.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, t in zip(ps, twins):
            assert_bitwise_equal(p.detach(), t.detach(), f"step {step}")
            assert sorted(opt.state[p]) == sorted(ref.state[t])
            for key, value in opt.state[p].items():
                assert_bitwise_equal(value, ref.state[t][key], f"step {step}: {key}")


def test_amsgrad_switched_on_in_a_group_starts_from_the_moments_and_a_refused_step_keeps_none(gen):
    """The maximum was made inside the op call's check, so a step refused by another group's op
    kept it: a refused step changed the state."""
    ps, _ = make_opt(FusedAdam, gen, shapes=((4,), (3,)))
    opt = FusedAdam([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.1)
    opt.step()
    opt.param_groups[1]["amsgrad"] = True
    ps[0].grad.data = ps[0].grad.data.double()
    refused(opt.step, [opt], TypeError, r"grads\[0\] has dtype Double")
    assert "max_exp_avg_sq" not in opt.state[ps[1]]
    ps[0].grad.data = ps[0].grad.data.float()
    v = opt.state[ps[1]]["exp_avg_sq"].clone()
    opt.step()
    # max(v_before, v_now): the first max is taken against the moments so far
    assert torch.equal(opt.state[ps[1]]["max_exp_avg_sq"], torch.maximum(v, opt.state[ps[1]]["exp_avg_sq"]))


def test_a_foreign_moment_dtype_is_still_refused_by_name(gen):
    """Only moments this optimizer makes (float32, bfloat16, int8 codes) follow state_dtype: a
    float64 one, cast by hand, is refused by the op as before, not converted silently."""
    ps, opt = make_opt(FusedAdam, gen)
    opt.step()
    opt.param_groups[0]["state_dtype"] = torch.bfloat16
    opt.state[ps[1]]["exp_avg"].data = opt.state[ps[1]]["exp_avg"].data.double()
    refused(opt.step, [opt], TypeError, r"exp_avgs?\[1\] has dtype Double")


# ---- options accepted by a setter or a load that every step would refuse ---------------------------

def test_master_weights_set_beside_stochastic_rounding_is_refused_at_once(gen):
    ps, opt = make_opt(FusedAdam, gen, dtype=torch.bfloat16, rounding="stochastic")
    opt.step()
    refused(lambda: setattr(opt, "master_weights", True), [opt], ValueError,
            r"FusedAdam: setting master_weights: param group 0: invalid combination master_weights=True, "
            r"rounding='stochastic'")
    assert opt.master_weights is False
    opt.step()  # still steps


def test_remainder_masters_set_on_float16_params_are_refused_at_once(gen):
    ps, opt = make_opt(FusedSGD, gen, dtype=torch.float16, master_weights=True, momentum=0.9)
    opt.step()
    refused(lambda: setattr(opt, "master_weights", "remainder"), [opt], ValueError,
            r"master_weights='remainder' needs bfloat16 params; setting master_weights: param group 0 param 0 is "
            r"torch.float16")
    assert opt.master_weights is True and opt.defaults["master_weights"] is True


@pytest.mark.parametrize("saved_kw, dtype, pattern", [
    (dict(rounding="stochastic"), torch.float16,
     r"FusedAdam.load_state_dict: rounding='stochastic' rounds to bfloat16; param group 0 param 0 is float16"),
    (dict(master_weights="remainder"), torch.float32,
     r"FusedAdam.load_state_dict: master_weights='remainder' needs bfloat16 params; param group 0 param 0"),
], ids=["stochastic_into_fp16", "remainder_into_fp32"])
def test_a_checkpoint_whose_options_the_params_cannot_take_is_refused_at_load(saved_kw, dtype, pattern, gen):
    """It loaded, and every step after refused it."""
    _, source = make_opt(FusedAdam, gen, dtype=torch.bfloat16, **saved_kw)
    saved = source.state_dict()  # before any step: options only, no state to refuse
    ps, opt = make_opt(FusedAdam, gen, dtype=dtype)
    refused(lambda: opt.load_state_dict(saved), [opt, saved], ValueError, pattern)
    opt.step()


# ---- switches and checkpoints that train right ----------------------------------------------------

def test_remainder_to_fp32_masters_and_back_keeps_every_master_bit(gen):
    """The masters of a run switched remainder -> True -> remainder are those of an fp32-master
    run bit for bit (the bf16 weights may differ at exact ties, which the remainder form rounds
    toward zero)."""
    ps, opt = make_opt(FusedAdam, gen, dtype=torch.bfloat16, shapes=((300,), (5, 3)), master_weights="remainder")
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = FusedAdam(twins, lr=0.1, master_weights=True)
    for step in range(6):
        for p, t in zip(ps, twins):
            p.grad = random_tensor(p.shape, torch.float32, "cpu", gen).bfloat16()
            t.grad = p.grad.clone()
        if step in (2, 4):
            opt.master_weights = True if step == 2 else "remainder"
        opt.step()
        ref.step()
        for p, t in zip(ps, twins):
            state = opt.state[p]
            master = state["master_param"] if "master_param" in state else _lean.rebuild(p, state[_lean.REMAINDER])
            assert_bitwise_equal(master, ref.state[t]["master_param"], f"step {step}")


def test_a_remainder_int8_checkpoint_resumes_in_a_default_optimizer_bit_for_bit(gen):
    """Loaded weights_only into FusedAdam(params) with no options: the checkpoint's options win."""
    ps, opt = make_opt(FusedAdam, gen, dtype=torch.bfloat16, shapes=((300,), (5, 3)), master_weights="remainder",
                       state_dtype=torch.int8)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = FusedAdam(twins)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.master_weights == "remainder" and resumed.state_dtype is torch.int8
    for _ in range(2):
        for p, t in zip(ps, twins):
            p.grad = random_tensor(p.shape, torch.float32, "cpu", gen).bfloat16()
            t.grad = p.grad.clone()
        opt.step()
        resumed.step()
        for p, t in zip(ps, twins):
            assert_bitwise_equal(p.detach(), t.detach())
            assert_bitwise_equal(opt.state[p][_lean.REMAINDER], resumed.state[t][_lean.REMAINDER])


@pytest.mark.parametrize("rounding, new_dtype", [("remainder", torch.float32), ("remainder", torch.float16),
                                                 ("stochastic", torch.float16)])
def test_a_param_cast_under_a_lean_option_after_held_steps_is_refused_by_name(rounding, new_dtype, gen):
    kw = dict(master_weights="remainder") if rounding == "remainder" else dict(rounding="stochastic")
    ps, opt = make_opt(FusedAdam, gen, dtype=torch.bfloat16, **kw)
    opt.step()
    opt.step()
    assert _held.HeldSteps.current(opt) is not None
    ps[0].data = ps[0].data.to(new_dtype)
    ps[0].grad.data = ps[0].grad.data.to(new_dtype)
    pattern = "needs bfloat16 params" if rounding == "remainder" else "rounds to bfloat16"
    refused(opt.step, [opt], ValueError, rf"FusedAdam: .*{pattern}.*param group 0 param 0")


def test_a_seed_changed_between_held_steps_rounds_as_a_new_optimizer_with_it(gen):
    ps, opt = make_opt(FusedAdam, gen, dtype=torch.bfloat16, shapes=((300,),), rounding="stochastic", seed=3)
    opt.step()
    opt.step()
    opt.param_groups[0]["seed"] = 7
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = FusedAdam(twins, lr=0.1, rounding="stochastic", seed=7)
    ref.load_state_dict(opt.state_dict())
    for p, t in zip(ps, twins):
        t.grad = p.grad.clone()
    opt.step()
    ref.step()
    assert_bitwise_equal(ps[0].detach(), twins[0].detach())


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
