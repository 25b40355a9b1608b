# The fifth misuse probe (issue 20), part 1: the lean weight and state options of the fused
# optimizers (remainder masters, stochastic rounding, bf16 and 8-bit Adam moments) changed between
# steps, through param_groups, attributes and checkpoints (held steps: test_misuse_probe5_held.py).
from __future__ import annotations

import copy
import io

import pytest
import torch

from conftest import assert_bitwise_equal, random_tensor
from test_misuse_probe4 import make as make_opt
from test_misuse_probe4 import refused
from mixprec.optimizers import FusedAdam, FusedSGD, _held, _lean

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


def resumed_weights_only(opt, ps, cls=FusedAdam, **kw):
    """A new `cls` over copies of `ps`, loaded with opt's state_dict through torch.save and
    torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = cls(twins, **kw)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    return twins, resumed


def step_pair(a, ps, b, twins, gen, steps, state_keys=()):
    """`steps` steps of both optimizers on the same fresh bf16 gradients; after each their params
    (and the state named) are equal bit for bit."""
    for step in range(steps):
        for p, t in zip(ps, twins):
            p.grad = random_tensor(p.shape, torch.float32, "cpu", gen).to(p.dtype)
            t.grad = p.grad.clone()
        a.step()
        b.step()
        for p, t in zip(ps, twins):
            assert_bitwise_equal(p.detach(), t.detach(), f"step {step}")
            for key in state_keys:
                assert_bitwise_equal(a.state[p][key], b.state[t][key], f"step {step}: {key}")


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
    twins, resumed = resumed_weights_only(opt, ps)
    assert resumed.master_weights == "remainder" and resumed.state_dtype is torch.int8
    step_pair(opt, ps, resumed, twins, gen, 2, state_keys=(_lean.REMAINDER, "exp_avg", "exp_avg_scale"))


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


# ---- a checkpoint of any lean mode loaded into an optimizer built for any other ------------------
ADAM_MODES = {"plain": {}, "bf16-moments": dict(state_dtype=torch.bfloat16), "int8": dict(state_dtype=torch.int8),
              "remainder": dict(master_weights="remainder"), "stochastic": dict(rounding="stochastic", seed=5),
              "masters": dict(master_weights=True), "amsgrad": dict(amsgrad=True)}
SGD_MODES = {"plain": dict(momentum=0.9), "param-momentum": dict(momentum=0.9, state_dtype="param"),
             "remainder": dict(momentum=0.9, master_weights="remainder"), "masters": dict(momentum=0.9, master_weights=True),
             "stochastic": dict(momentum=0.9, rounding="stochastic"), "no-momentum": {}}
MODE_PAIRS = [(FusedAdam, a, b) for a in ADAM_MODES for b in ADAM_MODES] + [
    (FusedSGD, a, b) for a in SGD_MODES for b in SGD_MODES]


@pytest.mark.parametrize("cls, source, target", MODE_PAIRS,
                         ids=[f"{c.__name__}-{a}-into-{b}" for c, a, b in MODE_PAIRS])
def test_a_checkpoint_loaded_weights_only_into_another_mode_continues_the_run(cls, source, target, gen):
    """The checkpoint's options win over the constructor's (as for every option), its state comes
    in its own form, and the resumed steps are the saved run's, bit for bit."""
    modes = ADAM_MODES if cls is FusedAdam else SGD_MODES
    ps, opt = make_opt(cls, gen, dtype=torch.bfloat16, shapes=((300,), (5, 3)), **modes[source])
    opt.step()
    twins, resumed = resumed_weights_only(opt, ps, cls, lr=0.1, **modes[target])
    step_pair(opt, ps, resumed, twins, gen, 2)
