# Misuse of mixprec.GradScaler: bad calls of every public entry point (constructor, scale, unscale_,
# step, update, load_state_dict, the setters), tabled and hypothesis-generated. Each must raise an
# error naming the call and the argument, and leave the scaler's fields (scale, trackers, history,
# per-optimizer states), the params, grads and optimizer state bit-identical.
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)
from conftest import random_tensor
from mixprec.grad_scaler import GradScaler
from mixprec.optimizers import FusedAdam
from test_grad_scaler_conformance import assert_same_value

F32_MAX = torch.finfo(torch.float32).max
KWARGS = dict(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=1.0, max_scale=2.0**20, history_size=4)


@dataclass
class Mid:
    """A scaler in the middle of an iteration, after a few real ones (one overflow)."""
    scaler: GradScaler
    params: list
    opt: torch.optim.Optimizer

    def snapshot(self) -> dict:
        s = self.scaler
        clone = (lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
        return {
            "state": {k: clone(v) for k, v in vars(s._state).items()},
            "scaler": {k: v for k, v in vars(s).items() if k not in ("_state", "_guards", "_per_optimizer_states")},
            "per_optimizer": {k: (v["stage"], {str(d): f.clone() for d, f in v["found_inf_per_device"].items()})
                              for k, v in s._per_optimizer_states.items()},
            "params": [p.detach().clone() for p in self.params],
            "grads": [grad_bits(p.grad) for p in self.params],
            "opt": {k: clone(v) for st_ in self.opt.state_dict()["state"].values() for k, v in st_.items()},
        }


def grad_bits(g):
    if g is None or not g.is_sparse:
        return None if g is None else g.clone()
    return g._indices().clone(), g._values().clone(), g.is_coalesced()


def mid_iteration(stage: str = "scaled", fused: bool = False, dtype=torch.float32, seed: int = 0) -> Mid:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(random_tensor((6,), dtype, "cpu", gen)) for _ in range(2)]
    opt = FusedAdam(params, lr=1e-2) if fused else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", **KWARGS)
    for i in range(4 if stage != "fresh" else 0):
        opt.zero_grad()
        scaler.scale(sum((p.float() * (i + 1)).square().sum() for p in params)).backward()
        if i == 1:
            params[0].grad[2] = math.inf
        if i < 3 or stage in ("unscaled", "stepped"):
            (scaler.unscale_ if (i == 3 and stage == "unscaled") else scaler.step)(opt)
        if i < 3:
            scaler.update()
    return Mid(scaler, params, opt)


def check_refused(mid: Mid, call, exc, *names: str) -> None:
    before = mid.snapshot()
    with pytest.raises(exc) as info:
        call(mid.scaler)
    for name in names:
        assert name in str(info.value), f"the error does not name {name!r}: {info.value}"
    assert_same_value(mid.snapshot(), before, "after the refused call")


# ---- constructor --------------------------------------------------------------------------------
BAD_CONSTRUCTOR = [
    *[({"init_scale": v}, "init_scale") for v in ("x", math.nan, math.inf, -1.0, 0.0, True, 1e-40, 1e39,
                                                   torch.tensor([1.0, 2.0]), None)],
    *[({"growth_factor": v}, "growth_factor") for v in (1.0, 0.5, math.inf, math.nan, "2")],
    *[({"backoff_factor": v}, "backoff_factor") for v in (0.0, -0.5, 1.0, 1.5, math.nan)],
    *[({"growth_interval": v}, "growth_interval") for v in (-1, 2.5, "10", 2**31, True, np.float64(3.0))],
    *[({"hysteresis": v}, "hysteresis") for v in (0, -1, 1.5)],
    ({"min_scale": -1.0}, "min_scale"), ({"min_scale": math.nan}, "min_scale"),
    ({"max_scale": 0.0}, "max_scale"), ({"max_scale": math.inf}, "max_scale"),
    ({"max_scale": 1024.0}, "init_scale"),  # the default 2**16 above it
    ({"min_scale": 2.0**17}, "init_scale"), ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 6.0}, "max_scale"),
    ({"history_size": -1}, "history_size"),
    *[({"enabled": v}, "enabled") for v in ("False", "0", "")],  # a config string: "False" is truthy
]


@pytest.mark.parametrize(("kwargs", "arg"), BAD_CONSTRUCTOR, ids=lambda v: repr(v)[:40])
def test_constructor_refuses(kwargs, arg):
    with pytest.raises((ValueError, TypeError)) as info:
        GradScaler("cpu", **kwargs)
    assert "GradScaler" in str(info.value) and arg in str(info.value), str(info.value)


def test_constructor_errors_torch_raises_as_assertion_are_still_assertion_errors():
    for kwargs in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}):
        with pytest.raises(AssertionError):
            GradScaler("cpu", **kwargs)
        with pytest.raises(AssertionError):
            torch.amp.GradScaler("cpu", **kwargs)


def test_constructor_accepts_what_torch_accepts():
    for kwargs in ({"init_scale": 1024}, {"init_scale": np.float32(8.0)}, {"init_scale": torch.tensor(4.0)},
                   {"growth_interval": np.int64(5)}, {"growth_interval": 0}, {"growth_factor": 3},
                   {"backoff_factor": np.float32(0.25)}):
        ours, theirs = GradScaler("cpu", **kwargs), torch.amp.GradScaler("cpu", **kwargs)
        assert ours.state_dict()["scale"] == theirs.state_dict()["scale"]
        assert ours.get_growth_interval() == theirs.get_growth_interval()
    for enabled in (0, 1, np.bool_(True), np.bool_(False)):  # e.g. enabled=args.fp16 from an int flag
        assert GradScaler("cpu", enabled=enabled).is_enabled() == torch.amp.GradScaler("cpu", enabled=enabled).is_enabled()


# ---- scale, unscale_, step ----------------------------------------------------------------------
def add_fp16_grad(mid: Mid, sparse: bool, gen) -> None:
    """A float16 param (group 1) with a scaled gradient; sparse: uncoalesced, which a refused
    unscale_ must not coalesce either."""
    p = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float16))
    if sparse:
        p.grad = torch.sparse_coo_tensor([[1, 1]], torch.ones(2, 2, dtype=torch.float16), (4, 2),
                                         check_invariants=True)
    else:
        p.grad = (random_tensor((4, 2), torch.float32, "cpu", gen, scale=1e-6) * 2.0**10).half()
    mid.opt.add_param_group({"params": [p]})
    mid.params.append(p)


BAD_CALLS = [
    ("scaled", "scale", lambda s, opt: s.scale("loss"), ValueError, ["GradScaler.scale", "outputs"]),
    ("scaled", "scale", lambda s, opt: s.scale(3.0), ValueError, ["GradScaler.scale", "outputs"]),
    ("scaled", "scale", lambda s, opt: s.scale([None]), ValueError, ["GradScaler.scale", "outputs"]),
    ("fresh", "unscale_", lambda s, opt: s.unscale_(opt), AssertionError, ["unscale_", "_scale is None"]),
    ("fresh", "step", lambda s, opt: s.step(opt), AssertionError, ["step", "_scale is None"]),
    ("scaled", "unscale_", lambda s, opt: s.unscale_(None), TypeError, ["GradScaler.unscale_", "optimizer"]),
    ("unscaled", "unscale_", lambda s, opt: s.unscale_(opt), RuntimeError, ["unscale_() has already"]),
    ("stepped", "unscale_", lambda s, opt: s.unscale_(opt), RuntimeError, ["after step()"]),
    ("scaled", "step", lambda s, opt: s.step(None), TypeError, ["GradScaler.step", "optimizer"]),
    ("scaled", "step", lambda s, opt: s.step(opt, closure=lambda: 0.0), RuntimeError, ["Closure"]),
    ("stepped", "step", lambda s, opt: s.step(opt), RuntimeError, ["step() has already"]),
    ("scaled", "update", lambda s, opt: s.update(), AssertionError, ["No inf checks"]),
]


@pytest.mark.parametrize(("stage", "entry", "call", "exc", "names"), BAD_CALLS,
                         ids=[f"{c[1]}-{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
@pytest.mark.parametrize("fused", [False, True])
def test_bad_calls_are_refused_and_change_nothing(stage, entry, call, exc, names, fused):
    mid = mid_iteration(stage, fused)
    check_refused(mid, lambda s: call(s, mid.opt), exc, *names)


@pytest.mark.parametrize("entry", ["unscale_", "step"])
@pytest.mark.parametrize("sparse", [False, True])
def test_fp16_grads_are_refused_as_torch_does_and_keep_every_value(entry, sparse, gen):
    # Unscaling fp16 grads in place flushed small values to zero; now refused (as torch), grads kept.
    mid = mid_iteration("scaled")
    add_fp16_grad(mid, sparse, gen)
    check_refused(mid, lambda s: getattr(s, entry)(mid.opt), ValueError,
                  "GradScaler.unscale_", "Attempting to unscale FP16 gradients.", "param group 1 param 0")
    if sparse:
        assert not mid.params[-1].grad.is_coalesced()


def test_fp16_refusal_of_a_fused_optimizer_says_how_to_clip_and_its_step_works():
    mid = mid_iteration("scaled", fused=True, dtype=torch.float16)
    check_refused(mid, lambda s: s.unscale_(mid.opt), ValueError, "FusedAdam", "without unscale_", "max_norm")
    mid.scaler.step(mid.opt)  # the fused step unscales in float32 inside the kernel: allowed
    mid.scaler.update()


def test_the_documented_fp16_clip_recipe_keeps_small_gradients(gen):
    # The recipe of GradScaler.unscale_'s docstring: clip the scaled fp16 grads, no value flushed.
    import mixprec
    scaler = GradScaler("cpu", init_scale=2.0**16)
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float16))
    scaler.scale(torch.ones(()))  # creates the scale
    true = random_tensor((4096,), torch.float64, "cpu", gen, scale=1e-6)  # many below fp16's range once unscaled
    p.grad = (true * 2.0**16).half()
    grads, max_norm = [p.grad], 1e-5
    norm, _ = mixprec.multi_tensor_norm(grads)
    coef = (max_norm * scaler._get_scale_async() / (norm + 1e-6)).clamp_(max=1.0)
    assert coef.item() < 0.5, "the case must clip"
    naive = (p.grad.float() / 2.0**16).half() * coef.half()  # unscale_ in fp16 then clip: what was lost
    assert bool((naive == 0).any()), "the case must be one where fp16 unscaling flushes values"
    mixprec.scale_(grads, coef)
    assert bool((p.grad != 0).all()), "a clipped gradient was flushed to zero"
    clipped = p.grad.double() / 2.0**16
    assert abs(torch.linalg.vector_norm(clipped).item() - max_norm) < 1e-2 * max_norm


# ---- update(new_scale) --------------------------------------------------------------------------
BAD_NEW_SCALES = [math.nan, math.inf, -math.inf, -1.0, 0.0, "x", True, [1.0], 1e-40, 1e39, 0.5, 2.0**21,
                  torch.tensor([2.0]), torch.tensor([[2.0]]), torch.tensor(2.0, requires_grad=True),
                  torch.tensor(math.nan), torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(math.inf),
                  torch.tensor(True), torch.tensor(2.0, device="meta")]


@pytest.mark.parametrize("new_scale", BAD_NEW_SCALES, ids=lambda v: repr(v)[:30])
@pytest.mark.parametrize("stage", ["scaled", "stepped"])
def test_update_refuses_a_bad_new_scale(new_scale, stage):
    mid = mid_iteration(stage)
    check_refused(mid, lambda s: s.update(new_scale), (ValueError, AssertionError), "GradScaler.update", "new_scale")
    if stage == "stepped":  # the iteration can still finish
        mid.scaler.update(2.0**9)
        assert mid.scaler.get_scale() == 2.0**9 and mid.scaler.skipped_steps == 1


# ---- load_state_dict ----------------------------------------------------------------------------
def other_valid_state() -> dict:
    """Valid values all different from mid_iteration's: a partial write would show."""
    return {"scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7, "_growth_tracker": 5,
            "hysteresis": 3, "_hysteresis_tracker": 1, "min_scale": 2.0, "max_scale": 2.0**19, "_skipped_steps": 9}


BAD_STATE = [
    *[{"scale": v} for v in (math.nan, -1.0, 0.0, math.inf, "8", True, 1e39, torch.tensor([8.0]), None)],
    {"scale": 2.0**20}, {"scale": 1.0},  # outside the checkpoint's max_scale / min_scale
    *[{"growth_factor": v} for v in (1.0, math.inf, "2")], *[{"backoff_factor": v} for v in (0.0, 1.0)],
    *[{"growth_interval": v} for v in (-1, 2.5, 2**31)],
    *[{"_growth_tracker": v} for v in (2**40, -1, 1.5, torch.tensor(1.0))],
    {"hysteresis": 0}, {"_hysteresis_tracker": 5}, {"_hysteresis_tracker": -1}, {"min_scale": -1.0},
    {"max_scale": 1.0}, {"_skipped_steps": -1}, {"_skipped_steps": "3"}, {"_skipped_steps": 2**64},
]


@pytest.mark.parametrize("bad", BAD_STATE, ids=lambda v: repr(v)[:40])
def test_load_state_dict_refuses_and_writes_nothing(bad):
    sd = other_valid_state()
    sd.update(bad)
    key = next(iter(bad))
    check_refused(mid_iteration("scaled"), lambda s: s.load_state_dict(sd), ValueError,
                  "GradScaler.load_state_dict", key if key not in ("min_scale", "max_scale") else "scale")


@pytest.mark.parametrize("missing", ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"])
def test_load_state_dict_names_a_missing_key(missing):
    sd = other_valid_state()
    del sd[missing]
    check_refused(mid_iteration("scaled"), lambda s: s.load_state_dict(sd), KeyError, "GradScaler.load_state_dict",
                  repr(missing))


def test_load_state_dict_refuses_a_non_dict_and_an_empty_one():
    check_refused(mid_iteration("scaled"), lambda s: s.load_state_dict([1, 2]), TypeError,
                  "GradScaler.load_state_dict", "dict")
    check_refused(mid_iteration("scaled"), lambda s: s.load_state_dict({}), RuntimeError, "empty")


def test_a_valid_load_after_refusals_writes_everything():
    mid = mid_iteration("scaled")
    mid.scaler.load_state_dict(other_valid_state())
    assert mid.scaler.state_dict() == other_valid_state()


# ---- setters ------------------------------------------------------------------------------------
BAD_SETTERS = [
    *[("set_growth_factor", v) for v in (1.0, 0.5, math.nan, math.inf, "2")],
    *[("set_backoff_factor", v) for v in (0.0, 1.0, -0.1, math.nan)],
    *[("set_growth_interval", v) for v in (-1, 2.5, "3", 2**31)],
]


@pytest.mark.parametrize(("setter", "value"), BAD_SETTERS, ids=lambda v: repr(v)[:30])
def test_setters_refuse(setter, value):
    check_refused(mid_iteration("stepped"), lambda s: getattr(s, setter)(value), ValueError,
                  f"GradScaler.{setter}", "new_")


# ---- hypothesis: any bad value, any entry point -------------------------------------------------
def bad_scale_values():
    finite_bad = st.floats(allow_nan=False, allow_infinity=False).filter(
        lambda x: not (torch.finfo(torch.float32).tiny <= x <= F32_MAX))
    return st.one_of(finite_bad, st.sampled_from([math.nan, math.inf, -math.inf]), st.text(max_size=3),
                     st.booleans(), st.lists(st.floats(1.0, 2.0), max_size=2))


bad_ints = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**31), st.floats(allow_nan=True),
                     st.text(max_size=3))


@given(value=bad_scale_values())
def test_any_bad_scale_is_refused_everywhere(value):
    with pytest.raises((ValueError, TypeError)):
        GradScaler("cpu", init_scale=value)
    check_refused(mid_iteration("stepped"), lambda s: s.update(value), ValueError, "new_scale")
    sd = dict(other_valid_state(), scale=value)
    check_refused(mid_iteration("scaled"), lambda s: s.load_state_dict(sd), ValueError, "['scale']")


@given(value=bad_ints)
def test_any_bad_interval_or_tracker_is_refused_everywhere(value):
    with pytest.raises(ValueError, match="growth_interval"):
        GradScaler("cpu", growth_interval=value)
    check_refused(mid_iteration("stepped"), lambda s: s.set_growth_interval(value), ValueError, "new_interval")
    for key in ("growth_interval", "_growth_tracker"):
        sd = dict(other_valid_state(), **{key: value})
        check_refused(mid_iteration("scaled"), lambda s: s.load_state_dict(sd), ValueError, f"[{key!r}]")


@given(value=st.one_of(st.floats().filter(lambda x: not 0.0 < x < 1.0), st.text(max_size=3)))
def test_any_bad_backoff_factor_is_refused_everywhere(value):
    with pytest.raises(ValueError, match="backoff_factor"):
        GradScaler("cpu", backoff_factor=value)
    check_refused(mid_iteration("stepped"), lambda s: s.set_backoff_factor(value), ValueError, "new_factor")


# ---- a scale tensor edited by hand (torch's private _scale) -----------------------------------
@pytest.mark.parametrize("value", [0.0, math.nan, math.inf, -4.0, 1e-45])
@pytest.mark.parametrize("fused, explicit_unscale", [(True, False), (True, True), (False, False)])
def test_hand_edited_unusable_scale_skips_the_step(value, fused, explicit_unscale):
    # A scale whose float32 reciprocal is inf, NaN, 0 or negative cannot unscale. The fused
    # kernel divides by it (before the fix: NaN/inf weights after a check that saw clean
    # grads); it must count as an overflow instead: params and optimizer state unchanged, and
    # update() treats the iteration as one that overflowed.
    mid = mid_iteration("scaled", fused=fused)
    mid.scaler._scale.fill_(value)
    before = mid.snapshot()
    tracker = mid.scaler._growth_tracker.clone()
    if explicit_unscale:
        mid.scaler.unscale_(mid.opt)
    mid.scaler.step(mid.opt)
    after = mid.snapshot()
    assert_same_value(after["params"], before["params"], "params after a step with an unusable scale")
    assert_same_value(after["opt"], before["opt"], "optimizer state after a step with an unusable scale")
    mid.scaler.update()
    assert mid.scaler._growth_tracker.item() == 0 and tracker.item() >= 0  # an overflow resets the tracker
    if math.isnan(value):
        assert math.isnan(mid.scaler._scale.item())  # a NaN scale stays NaN: every step skipped


@pytest.mark.parametrize("fused", [False, True])
def test_a_positional_closure_is_refused_like_the_keyword(fused):
    # torch's scaler refuses closure= but passes step(opt, closure) through, where the closure's
    # backward makes fresh scaled gradients after the check, and the optimizer applies them.
    mid = mid_iteration("scaled", fused=fused)

    def closure():
        mid.opt.zero_grad()
        loss = sum(p.float().square().sum() for p in mid.params)
        mid.scaler.scale(loss).backward()
        return loss

    check_refused(mid, lambda s: s.step(mid.opt, closure), RuntimeError, "Closure")
