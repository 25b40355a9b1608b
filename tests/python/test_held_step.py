# Held steps (optimizers/_held.py, csrc/ops/held_step.cpp, issue 22): after a fully checked step
# the op call is replayed from C++; every change between steps must reach the next step, and the
# results must be those of the fully checked path bit for bit, the GradScaler's included.
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import assert_bitwise_equal, random_tensor
from test_optimizer_step_cache import (FAMILIES, SHAPES, _everything, _assert_nothing_changed, assert_same_outcome,
                                       make, outcome, params_of, set_grads, tensors_of)

import mixprec
from mixprec import _ops
from mixprec.optimizers import _held

PRECISIONS = [torch.float32, torch.float16, torch.bfloat16]


def held_of(opt):
    return _held.HeldSteps.current(opt)


def without_held(opt) -> None:
    """The next step takes the fully checked path (it records new held steps, dropped again here)."""
    opt.__dict__.pop("_held", None)


class OpCalls:
    """Counts the optimizer op calls made through Python (a held step makes none)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = _ops._optim_step

        def counting(family, validate_only, values):
            self.n += 1
            real(family, validate_only, values)
        monkeypatch.setattr(_ops, "_optim_step", counting)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_step_is_held(family, gen, seed, monkeypatch):
    """The path the other tests compare is really taken: no op call through Python after the first step."""
    opt = make(family, torch.float16, gen)
    calls = OpCalls(monkeypatch)
    outcome(opt, seed)  # SGD's first step (new momentum buffers) is two op calls: held from the second
    outcome(opt, seed + 10)
    assert calls.n >= 1 and held_of(opt) is not None
    first = calls.n
    for i in range(3):
        assert outcome(opt, seed + 1 + i)[0] == "ok"
        assert held_of(opt) is not None
    assert calls.n == first, "a held step went through the Python op wrapper"


def new_scaler(device, init_scale: float, held: bool):
    scaler = mixprec.GradScaler(torch.device(device).type, init_scale=init_scale, growth_interval=2, sync_skip=False)
    scaler.scale(torch.ones((), device=device))  # makes the scale, as scaling a loss does
    if not held:  # the scaler's own check before the step, as before held steps
        scaler._check_in_step = lambda *args: False
    return scaler


def next_grads(opt, held: bool, seed: int) -> None:
    if not held:
        without_held(opt)
    set_grads(opt, torch.Generator().manual_seed(seed))


def run_twins(family, dtype, gen, seed, device, steps, scaler_kind=None, bad_steps=(), checkpoint_at=None):
    """The same training with held steps and with every step fully checked; returns both optimizers'
    tensors after each step."""
    logs = []
    for held in (True, False):
        g = torch.Generator().manual_seed(seed)
        opt = make(family, dtype, g, device)
        scaler = new_scaler(device, 2.0**4, held) if scaler_kind is not None else None
        log = []
        for i in range(steps):
            next_grads(opt, held, seed + i)
            if i in bad_steps:
                p = [p for p in params_of(opt) if p.numel() > 0][i % 3]
                p.grad.view(-1)[i % p.numel()] = (math.inf, -math.inf, math.nan)[i % 3]
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            if i == checkpoint_at:  # a round trip through a new optimizer mid-run
                saved = copy.deepcopy(opt.state_dict())
                new = make(family, dtype, torch.Generator().manual_seed(seed), device)
                for p, q in zip(params_of(new), params_of(opt)):
                    p.data.copy_(q.data)
                new.load_state_dict(saved)
                opt = new
            log.append([(n, t.detach().clone()) for n, t in tensors_of(opt) if not n.endswith(".grad")]
                       + ([("scale", scaler._scale.clone())] if scaler is not None else []))
        if held:
            assert held_of(opt) is not None or steps - 1 == checkpoint_at
        logs.append(log)
    return logs


def assert_same_logs(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert [n for n, _ in x] == [n for n, _ in y]
        for (name, s), (_, t) in zip(x, y):
            assert_bitwise_equal(s, t, f"step {i}: {name}", nan_equal=True)


@pytest.mark.parametrize("dtype", PRECISIONS, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_held_steps_equal_checked_steps(family, dtype, device, seed):
    a, b = run_twins(family, dtype, None, seed, device, steps=6, checkpoint_at=2)
    assert_same_logs(a, b)


@pytest.mark.parametrize("dtype", PRECISIONS, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_held_scaler_steps_equal_checked_steps_with_skips(family, dtype, device, seed):
    """mixprec.GradScaler's one-call step (its check in the held call) against its own per-step
    check with every step fully checked: same skips, scales and values, a checkpoint round trip
    included."""
    a, b = run_twins(family, dtype, None, seed, device, steps=7, scaler_kind="mixprec", bad_steps=(1, 4, 5),
                     checkpoint_at=3)
    assert_same_logs(a, b)


# -- changes between steps: the step they happen on acts as a fresh optimizer's ----------------

def _state_key(opt, p) -> str:
    return next(k for k in opt._state_rules if k in opt.state[p])


def resized_param(opt, gen):
    p = params_of(opt)[0]
    p.data = random_tensor((p.numel() + 2,), p.dtype, p.device, gen)


def state_storage_swapped(opt, gen):
    # The same tensor object given new memory: the Python ids are unchanged, the data pointer is not.
    p = params_of(opt)[5]
    t = opt.state[p][_state_key(opt, p)]
    t.set_(t.clone() * 0.5)


def state_restrided(opt, gen):
    p = params_of(opt)[4]  # (3, 5)
    t = opt.state[p][_state_key(opt, p)]
    t.set_(t.t().contiguous().t())  # same shape, column-major: no longer the param's layout


def master_storage_swapped(opt, gen):
    p = params_of(opt)[1]
    t = opt.state[p].get("master_param")
    if t is None:
        p.data = p.data.clone()
        return
    t.set_(t.clone())


def state_key_renamed(opt, gen):
    p = params_of(opt)[5]
    state = opt.state[p]
    last = list(state)[-1]
    state["renamed"] = state.pop(last)  # the same tensors in the same order, another key


def group_tensor_replaced(opt, gen):
    group = opt.param_groups[0]
    if isinstance(group.get("exp_avg_sq"), torch.Tensor):  # NovoGrad's per-tensor moments
        group["exp_avg_sq"] = group["exp_avg_sq"] * 0.5 + 1e-3
    else:
        group["lr"] = torch.tensor(group["lr"] * 4, device=params_of(opt)[0].device)  # a device lr


def option_changed_in_place_of_equal_value(opt, gen):
    group = opt.param_groups[0]
    group["weight_decay"] = float(repr(group["weight_decay"])) + 0.125  # a new float object


def params_list_replaced(opt, gen):
    group = opt.param_groups[0]
    group["params"] = list(reversed(group["params"]))


def grads_set_to_none(opt, gen):
    opt.zero_grad(set_to_none=True)  # then new grads below, of which one stays None
    opt._next_none = 2


HELD_CHANGES = [resized_param, state_storage_swapped, state_restrided, master_storage_swapped, state_key_renamed,
                group_tensor_replaced, option_changed_in_place_of_equal_value, params_list_replaced, grads_set_to_none]


@pytest.mark.parametrize("change", HELD_CHANGES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_change_between_held_steps_is_seen(family, dtype, change, device, gen, seed):
    opt = make(family, dtype, gen, device)
    for i in range(3):
        outcome(opt, seed + i)
    assert held_of(opt) is not None  # the next step would be held but for the change
    change(opt, gen)
    fresh = copy.deepcopy(opt)  # no held steps, no step caches
    for i in range(2):
        none = getattr(opt, "_next_none", None)
        results = []
        for o in (opt, fresh):
            set_grads(o, torch.Generator().manual_seed(seed + 100 + i))
            if none is not None:
                params_of(o)[none].grad = None
            try:
                o.step()
                results.append(("ok", [(n, t.detach().clone()) for n, t in tensors_of(o)]))
            except Exception as e:  # noqa: BLE001 - the error is the outcome compared
                results.append(("error", type(e), str(e)))
        assert_same_outcome(*results)
        if results[0][0] == "error":
            break


def test_refused_held_step_changes_nothing(gen, seed):
    """A step the op refuses on the held path (a float64 grad) raises what a fresh optimizer's
    first step raises and changes nothing."""
    opt = make("adam", torch.float16, gen)
    for i in range(3):
        outcome(opt, seed + i)
    assert held_of(opt) is not None
    fresh = copy.deepcopy(opt)
    for o in (opt, fresh):
        set_grads(o, torch.Generator().manual_seed(seed + 9))
        g = params_of(o)[3].grad
        g.data = g.data.double()
    before = _everything(opt)
    with pytest.raises(Exception) as got:
        opt.step()
    _assert_nothing_changed(before, _everything(opt))
    with pytest.raises(Exception) as want:
        fresh.step()
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


# -- the op's kept packing (pack_lists): a tensor changed in place between calls -----------------

@pytest.mark.parametrize("how", ["storage", "restrided", "resized"])
def test_op_sees_tensor_changed_in_place_between_calls(how, device, gen):
    shapes = [(7,), (3, 5), (33,), (1,)]

    def lists():
        return [[random_tensor(s, torch.float32, device, gen, scale) for s in shapes] for scale in (1.0, 1e-2, 1e-3)]

    def step(params, grads, avgs, sqs):
        _ops.adam_(params, grads, avgs, sqs, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=1)

    params, grads, avgs = lists()
    sqs = [a.abs() for a in avgs]
    for _ in range(2):  # the second call reuses the first's packing
        step(params, grads, avgs, sqs)
    twin = [[t.clone() for t in lst] for lst in (params, grads, avgs, sqs)]  # other memory: packed anew
    t = avgs[1]
    if how == "storage":
        t.set_(t.clone())
        twin[2][1] = twin[2][1].clone()
    elif how == "restrided":
        t.set_(t.t().contiguous().t())
    else:
        t.set_(torch.zeros(2, 5, device=device))
        twin[2][1] = torch.zeros(2, 5, device=device)
    if how == "storage":
        step(params, grads, avgs, sqs)
        step(*twin)
        for got, want in zip(params + avgs + sqs, twin[0] + twin[2] + twin[3]):
            assert_bitwise_equal(got, want, "after the in-place change")
        return
    before = [x.clone() for x in params + avgs + sqs]
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] has (strides|shape)"):
        step(params, grads, avgs, sqs)
    for b, a in zip(before, params + avgs + sqs):
        assert_bitwise_equal(a, b, "a refused call wrote")


# -- mixprec.GradScaler's check in the held call -------------------------------------------------

def two_groups(family, dtype, gen, device):
    params = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in SHAPES]
    opt = FAMILIES[family](params[:3], master_weights=dtype != torch.float32)
    opt.add_param_group({"params": params[3:], "lr": 3e-3})
    return opt


def scaler_twins(build, device, seed, steps, before_step):
    """The same scaler training with the check in the held call and with the scaler's own check
    before fully checked steps; `before_step(i, opt, scaler)` edits both alike. Returns both logs
    and how many times each scaler ran its own check."""
    logs, own_checks = [], []
    for held in (True, False):
        opt = build(torch.Generator().manual_seed(seed))
        scaler = new_scaler(device, 2.0**3, held)
        checks = [0]
        real = scaler._unscale_grads_

        def counting(*args, real=real, checks=checks):
            checks[0] += 1
            return real(*args)
        scaler._unscale_grads_ = counting  # an instance attribute: the class's hooks stay mixprec's
        log = []
        for i in range(steps):
            next_grads(opt, held, seed + i)
            before_step(i, opt, scaler)
            scaler.step(opt)
            scaler.update()
            log.append([(n, t.detach().clone()) for n, t in tensors_of(opt) if not n.endswith(".grad")]
                       + [("scale", scaler._scale.clone()), ("tracker", scaler._growth_tracker.clone())])
        logs.append(log)
        own_checks.append(checks[0])
    return logs, own_checks


@pytest.mark.parametrize("value", [0.0, math.inf, math.nan, 2.0**-140, -1.0], ids=str)
def test_held_scaler_step_flags_an_unusable_scale(value, device, seed):
    def edit(i, opt, scaler):
        if i == 3:
            scaler._scale.fill_(value)  # a hand edit: no unscale can follow

    (a, b), checks = scaler_twins(lambda g: make("adam", torch.float16, g, device), device, seed, 5, edit)
    assert_same_logs(a, b)
    assert checks[0] <= 1 and checks[1] == 5  # the held route checked in C++ after the first step


@pytest.mark.parametrize("family", FAMILIES)
def test_held_scaler_step_two_groups_and_a_missing_grad(family, device, seed):
    def edit(i, opt, scaler):
        ps = params_of(opt)
        if i in (2, 5):
            ps[4].grad.view(-1)[1] = math.inf  # in the second group
        if i == 4:
            ps[1].grad = None  # the held call cannot take it: the scaler's own check, the full path

    (a, b), checks = scaler_twins(lambda g: two_groups(family, torch.float16, g, device), device, seed, 7, edit)
    assert_same_logs(a, b)
    # Every family's check goes with the held call, FusedLAMB's included (its norm is held too).
    assert checks[1] == 7 and checks[0] < 7


def test_held_scaler_step_leaves_the_check_to_the_scaler_around_hooks(seed):
    """A step pre-hook (which may edit the grads) runs after the scaler's check, as with torch."""
    seen = []
    opt = make("adam", torch.float32, torch.Generator().manual_seed(seed))
    scaler = mixprec.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    assert scaler._check_in_step(opt, {"stage": scaler._opt_state(opt)["stage"]}, (), {})
    handle = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(float(o.found_inf)))
    assert not scaler._check_in_step(opt, {"stage": scaler._opt_state(opt)["stage"]}, (), {})
    for i in range(3):
        set_grads(opt, torch.Generator().manual_seed(seed + i))
        if i == 1:
            params_of(opt)[0].grad[0] = math.nan
        scaler.step(opt)
        scaler.update()
    handle.remove()
    assert seen == [0.0, 1.0, 0.0]  # the found_inf the hook saw was already checked


def test_held_steps_return_after_a_changing_spell(gen, seed, monkeypatch):
    """Held steps made and invalidated before use are made less often (their making costs about a
    checked step), and come back once nothing changes; every step's result is a fresh copy's."""
    opt = make("adam", torch.float32, gen)
    made = []
    real = _held.build

    def counting(optimizer, *args):
        held = real(optimizer, *args)
        if optimizer is opt:
            made.append(held is not None)
        return held
    monkeypatch.setattr(_held, "build", counting)
    for i in range(6):  # a state tensor replaced before every step
        p = params_of(opt)[5]
        if p in opt.state:
            opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()
        fresh = copy.deepcopy(opt)
        assert_same_outcome(outcome(opt, seed + i), outcome(fresh, seed + i))
    # Made after steps 0 and 2; unused, so declined after step 1 (wait 1) and 3-5 (wait 3).
    assert made == [True, False, True, False, False, False]
    for i in range(12):  # then nothing changes
        fresh = copy.deepcopy(opt)
        assert_same_outcome(outcome(opt, seed + 10 + i), outcome(fresh, seed + 10 + i))
    assert held_of(opt) is not None and made[6:] == [True]
    assert opt.__dict__.get("_held_backoff") is None  # reset by a used held step
