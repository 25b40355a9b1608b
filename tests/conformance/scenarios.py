"""The conformance table: optimizer scenarios that the Python front (run_python, here) and the C++
front (tests/cpp/conformance_driver.cpp) must run to bit-identical results and identical errors."""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass
from typing import Any, Optional

import torch

import mixprec
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD


@dataclass(frozen=True)
class Family:
    cls: type
    defaults: dict  # every constructor hyper-parameter, spelled out (never a default of either front)
    group1: dict  # what group 1 names differently: each value unlike both fronts' field defaults
    bad: tuple  # (option, value) refused by both fronts' validation


FAMILIES = {
    "adam": Family(FusedAdam, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.02, amsgrad=False,
                                   adam_w_mode=True, bias_correction=True, maximize=False),
                   dict(lr=5e-3, amsgrad=True, adam_w_mode=False), ("eps", -1.0)),
    "sgd": Family(FusedSGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False,
                                 wd_after_momentum=False, maximize=False),
                  dict(lr=0.02, momentum=0.5, wd_after_momentum=True, maximize=True), ("momentum", -1.0)),
    "adagrad": Family(FusedAdagrad, dict(lr=0.05, eps=1e-10, weight_decay=0.01, adagrad_w_mode=False, lr_decay=0.01,
                                         initial_accumulator_value=0.1, maximize=False),
                      dict(lr=0.02, adagrad_w_mode=True), ("lr_decay", -1.0)),
    "lamb": Family(FusedLAMB, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.02, bias_correction=True,
                                   grad_averaging=True, adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False),
                   dict(lr=5e-3, weight_decay=0.0, use_nvlamb=True, grad_averaging=False), ("max_grad_norm", -1.0)),
    "novograd": Family(FusedNovoGrad, dict(lr=1e-2, betas=(0.95, 0.98), eps=1e-8, weight_decay=0.01,
                                           bias_correction=True, grad_averaging=True, reg_inside_moment=False,
                                           norm_type=2.0, init_zero=False),
                       dict(lr=5e-3, reg_inside_moment=True, norm_type=0.0, init_zero=True), ("norm_type", 3.0)),
}

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Group 1's params take the next dtype, so every scenario mixes two.
NEXT_DTYPE = {"float32": "float16", "float16": "bfloat16", "bfloat16": "float32"}
STEPS = 6
OVERFLOW_STEPS = (1, 4)  # with a scaler: these steps' grads hold inf or NaN and change nothing
MISSING_GRAD_STEP = 2  # group 0's first param has no grad at this step (partial-group paths)
CHECKPOINT_AFTER = 3  # steps before the optimizer is saved, rebuilt and loaded
BAD_STEP = 4  # with an error case: this step first runs with group 1's option broken (refused)
SCALER = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)

# The factors of the table; pairwise() picks rows so that every pair of levels of any two factors
# appears in some row (the full product is 5*3*3*2*2*2*2*2 = 1440 rows; about 20 cover all pairs).
FACTORS = {
    "family": list(FAMILIES),
    "dtype": list(DTYPES),
    # none: no masters; group0: only group 0 names master_weights=True; all: the constructor's True.
    "masters": ["none", "group0", "all"],
    "state_dtype": ["float32", "bfloat16"],  # group 1's (FusedAdam's only; others ignore it)
    "scaler": [False, True],
    "checkpoint": [False, True],
    "error": [False, True],
    "boundary": [False, True],  # group 0 gets a 65537-element param (past one 64 Ki CPU chunk)
}


def pairwise(factors: dict) -> list[dict]:
    """A greedy pairwise-covering subset of the product of `factors`, deterministic."""
    names = list(factors)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}
    candidates = [dict(zip(names, values)) for values in itertools.product(*factors.values())]
    rows = []
    while uncovered:
        def gain(row):
            return sum((a, row[a], b, row[b]) in uncovered for a, b in itertools.combinations(names, 2))
        best = max(candidates, key=gain)
        uncovered -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(names, 2)}
        rows.append(best)
    return rows


@dataclass(frozen=True)
class Row:
    name: str
    family: str
    dtype: str = "float32"
    masters: str = "none"
    state_dtype: str = "float32"
    scaler: bool = False
    checkpoint: bool = False
    error: bool = False
    boundary: bool = False
    construct_error: bool = False  # group 1 refused at construction instead
    # At BAD_STEP group 1's (4, 4) param gets a bad grad: "layout", its grad transposed (non-contiguous),
    # refused by both fronts' checks; "alias", the param itself, which only the op's overlap check refuses.
    bad_grad: str = ""
    # Why the fronts are expected to differ here (an xfail, strict): None when they must agree.
    expected_difference: Optional[str] = None
    # master_weights set between steps: (step, group, on), before that step's grads; group -1 is the
    # whole optimizer (Python's opt.master_weights, C++'s set_master_weights).
    switches: tuple = ()


def table() -> list[Row]:
    rows = [Row(name=f"{r['family']}-{r['dtype']}-m_{r['masters']}-s_{r['state_dtype']}"
                f"{'-scaler' if r['scaler'] else ''}{'-ckpt' if r['checkpoint'] else ''}"
                f"{'-error' if r['error'] else ''}{'-boundary' if r['boundary'] else ''}", **r)
            for r in pairwise(FACTORS)]
    rows += [Row(name=f"{f}-construct-error", family=f, construct_error=True) for f in FAMILIES]
    # Both fronts check every group's tensors before any group steps (Python: the ops' check twins).
    rows += [Row(name=f"{f}-bad-grad-layout-in-group-1", family=f, dtype="float16", masters="all", bad_grad="layout")
             for f in FAMILIES]
    # What only the op refuses (a grad that is its param) is refused before group 0 steps, in both
    # fronts (the op's check twin for every group but the first).
    rows += [Row(name=f"{f}-grad-is-its-param-in-group-1", family=f, dtype="float16", masters="all", bad_grad="alias")
             for f in FAMILIES]
    # A group naming master_weights=False under a constructor's True keeps it in both fronts (C++
    # options remember what a group named, even a value equal to the class's default).
    rows.append(Row(name="adam-float16-group1-explicitly-without-masters", family="adam", dtype="float16",
                    masters="group1_off"))
    # master_weights switched off and on between steps (issues 20/21): a group stepped without its
    # masters drops them, and the next master step makes them from the params, in both fronts.
    # Group 0 switched at MISSING_GRAD_STEP: its first param, not stepped then, keeps its master.
    rows += [
        Row(name="sgd-float16-masters-switched-off-and-on", family="sgd", dtype="float16", masters="all",
            switches=((1, -1, False), (3, -1, True))),
        Row(name="adam-float16-group0-masters-switched-at-the-missing-grad-step", family="adam", dtype="float16",
            masters="all", switches=((MISSING_GRAD_STEP, 0, False), (4, 0, True))),
        Row(name="lamb-bfloat16-masters-switched-on-under-a-scaler", family="lamb", dtype="bfloat16",
            masters="none", scaler=True, switches=((1, -1, True), (2, -1, False), (5, -1, True))),
        Row(name="novograd-float16-group1-masters-switched-on-then-refused", family="novograd", dtype="float16",
            masters="group0", error=True, switches=((1, 1, True), (3, 1, False), (BAD_STEP, 1, True))),
    ]
    return rows


# ---- inputs --------------------------------------------------------------------------------------

def _random(shape, gen) -> torch.Tensor:
    """Never zero, random signs, magnitudes in [0.25, 4) (conftest.random_tensor's recipe)."""
    x = torch.rand(shape, generator=gen, dtype=torch.float64).mul_(4).sub_(2).exp2_()
    return torch.where(torch.randint(0, 2, shape, generator=gen, dtype=torch.bool), -x, x)


def make_inputs(row: Row, gen: torch.Generator) -> dict:
    """The scenario as a plain dict of tensors, numbers, strings and lists (what torch::pickle_load reads)."""
    fam = FAMILIES[row.family]
    dtypes = [DTYPES[row.dtype], DTYPES[NEXT_DTYPE[row.dtype]]]
    shapes = [[(7,), (3, 5)] + ([(65537,)] if row.boundary else []), [(4, 4), (1,)]]
    defaults = dict(fam.defaults, master_weights=row.masters in ("all", "group1_off"))
    options = [{}, dict(fam.group1)]
    if row.masters == "group0":
        options[0]["master_weights"] = True
    if row.masters == "group1_off":
        options[1]["master_weights"] = False
    if row.family == "adam":
        defaults["state_dtype"] = "float32"
        if row.state_dtype == "bfloat16":
            options[1]["state_dtype"] = "bfloat16"
    if row.construct_error:
        options[1][fam.bad[0]] = fam.bad[1]
    groups = [dict(params=[_random(s, gen).to(dt) for s in ss], options=o)
              for ss, dt, o in zip(shapes, dtypes, options)]
    scale = SCALER["init_scale"] if row.scaler else 1.0
    grads = []
    for step in range(STEPS):
        step_grads = [[(_random(s, gen) * scale).to(dt) for s in ss] for ss, dt in zip(shapes, dtypes)]
        if row.scaler and step in OVERFLOW_STEPS:
            g, i = step % 2, step % len(shapes[step % 2])
            flat = step_grads[g][i].view(-1)
            flat[int(torch.randint(0, flat.numel(), (1,), generator=gen))] = float("inf") if step == 1 else float("nan")
        grads.append(step_grads)
    grads[MISSING_GRAD_STEP][0][0] = None
    return dict(
        name=row.name, family=row.family, defaults=defaults, groups=groups, grads=grads,
        scaler=dict(SCALER) if row.scaler else None,
        checkpoint_after=CHECKPOINT_AFTER if row.checkpoint else -1,
        bad=(dict(kind="option", group=1, key=fam.bad[0], value=fam.bad[1], step=BAD_STEP) if row.error else
             dict(kind=f"grad_{row.bad_grad}", group=1, param=0, step=BAD_STEP) if row.bad_grad else None),
        construct_error=row.construct_error,
        switches=[dict(step=st, group=g, on=on) for st, g, on in row.switches],
    )


# ---- the Python front ----------------------------------------------------------------------------

def _py_options(options: dict) -> dict:
    """The scenario's option values as the Python front spells them (tuples, dtypes)."""
    out = {}
    for k, v in options.items():
        out[k] = tuple(v) if k == "betas" else DTYPES[v] if k == "state_dtype" else v
    return out


def _build(sc: dict, params: list) -> torch.optim.Optimizer:
    cls = FAMILIES[sc["family"]].cls
    groups = [dict(params=ps, **_py_options(g["options"])) for ps, g in zip(params, sc["groups"])]
    return cls(groups, **_py_options(sc["defaults"]))


def _snapshot(opt, params) -> list[torch.Tensor]:
    flat = [p for ps in params for p in ps]
    out = [p.detach().clone() for p in flat]
    for p in flat:
        out += [v.clone() for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    for g in opt.param_groups:
        out += [v.clone() for k, v in sorted(g.items()) if k != "params" and isinstance(v, torch.Tensor)]
    return out


def _bitwise_same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) for x, y in zip(a, b))


def run_python(sc: dict) -> dict:
    """Runs scenario `sc` through the Python front; returns what the C++ driver returns."""
    result: dict[str, Any] = dict(error=None, unchanged=True)
    params = [[torch.nn.Parameter(t.clone()) for t in g["params"]] for g in sc["groups"]]
    try:
        opt = _build(sc, params)
    except Exception as e:  # noqa: BLE001 -- the class is the result
        result["error"] = type(e).__name__
        return result
    scaler = mixprec.GradScaler("cpu", **sc["scaler"]) if sc["scaler"] else None
    for step, step_grads in enumerate(sc["grads"]):
        if step == sc["checkpoint_after"]:
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            buf.seek(0)
            params = [[torch.nn.Parameter(p.detach().clone()) for p in ps] for ps in params]
            opt = _build(sc, params)
            opt.load_state_dict(torch.load(buf, weights_only=True))
        for switch in (w for w in sc["switches"] if w["step"] == step):
            if switch["group"] < 0:
                opt.master_weights = switch["on"]
            else:
                opt.param_groups[switch["group"]]["master_weights"] = switch["on"]
        for ps, gs in zip(params, step_grads):
            for p, g in zip(ps, gs):
                p.grad = None if g is None else g.clone()
        bad = sc["bad"]
        if bad is not None and step == bad["step"]:
            group = opt.param_groups[bad["group"]]
            before = _snapshot(opt, params)
            scaler_before = scaler.state_dict() if scaler is not None else None
            if bad["kind"] == "option":
                kept = group[bad["key"]]
                group[bad["key"]] = bad["value"]
            else:
                p = group["params"][bad["param"]]
                # grad_layout: the same values, transposed layout; grad_alias: the param's own memory
                kept, p.grad = p.grad, p.detach() if bad["kind"] == "grad_alias" else p.grad.t().contiguous().t()
            try:
                _step(opt, scaler)
            except Exception as e:  # noqa: BLE001
                result["error"] = type(e).__name__
            if bad["kind"] == "option":
                group[bad["key"]] = kept
            else:
                p.grad = kept
            result["unchanged"] = (_bitwise_same(before, _snapshot(opt, params))
                                   and (scaler is None or scaler.state_dict() == scaler_before))
        _step(opt, scaler)
    result["params"] = [p.detach() for ps in params for p in ps]
    result["grads"] = [p.grad for ps in params for p in ps]
    result["state"] = [{k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
                       for ps in params for p in ps]
    result["steps"] = [g.get("step") for g in opt.param_groups]
    result["group_tensors"] = [g.get("exp_avg_sq") for g in opt.param_groups]
    result["scale"] = scaler.get_scale() if scaler is not None else None
    return result


def _step(opt, scaler) -> None:
    if scaler is None:
        opt.step()
        return
    scaler.scale(torch.ones(1))  # creates the scale on the first call, as a loss would
    scaler.step(opt)
    scaler.update()

