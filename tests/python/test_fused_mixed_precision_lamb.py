# Tests of mixprec.optimizers.FusedMixedPrecisionLamb (Apex's name) against test_lamb.py's float64
# LAMB reference: fp32 masters of fp16/bf16 models, GradScalers through scaler.step and
# step(grad_scaler=...), skipped steps, device-tensor lr, checkpoints and refused arguments.
from __future__ import annotations

import copy
import io
import math
import subprocess
import sys
import warnings

import pytest
import torch

import mixprec
from conftest import (
    CHUNK,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    inject_non_finite,
    random_tensor,
    snapshot,
    torch_grad_scaler,
)
from mixprec.optimizers import FusedMixedPrecisionLamb
from test_lamb import Track, check_against, clip_factor

SCALE = 1024.0
SHAPES = [(1,), (7, 3), (CHUNK + 1,), (20, 15)]
# How the gradients reach the optimizer: unscaled, or scaled by a GradScaler that hands itself
# (or, after unscale_, nothing) to step().
MODES = ("plain", "torch_scaler_step", "mixprec_scaler_step", "step_grad_scaler", "torch_unscale_first")


def _scaler(kind, device, dtype):
    if kind == "mixprec":
        scaler = mixprec.GradScaler(device, init_scale=SCALE)
    else:
        scaler = torch_grad_scaler(device, dtype, init_scale=SCALE)
    scaler.scale(torch.ones((), device=device))  # makes the scale tensor, as scaling a loss does
    return scaler


def _quiet_step(scaler, opt):
    # Both scalers pass themselves as grad_scaler= to an optimizer whose step takes it, with
    # torch's FutureWarning about that (deprecated) protocol.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return scaler.step(opt)


def _make(device, gen, dtype, reduced, **kw):
    params = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in SHAPES]
    split = [params[0::2], params[1::2]]
    groups = [{"params": split[0]}, {"params": split[1], "weight_decay": 0.0, "lr": 3e-3}]
    opt = FusedMixedPrecisionLamb(groups, lr=1e-2, reduced_precision_dtype=reduced, **kw)
    return params, split, opt


def _set_grads(params, gen, device, scale=1.0):
    """Fresh gradients as backward leaves them (times `scale`); returns the unscaled float64 ones
    the kernel sees."""
    seen = []
    for p in params:
        g = (random_tensor(p.shape, torch.float64, "cpu", gen) * scale).to(p.dtype)
        p.grad = g.to(device)
        seen.append(g.double() / scale)
    return seen


def _everything(opt, params):
    out = list(params) + [g["step"] for g in opt.param_groups] + [g["lr"] for g in opt.param_groups]
    return out + [t for p in params for t in opt.state[p].values()]


CASES = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, None),
         (torch.bfloat16, torch.float16)]  # any fp16/bf16 param gets a master once masters are on


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,reduced", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_steps_match_float64_reference(device, gen, dtype, reduced, mode):
    if mode == "torch_unscale_first" and dtype == torch.float16:
        pytest.skip("GradScaler.unscale_ refuses fp16 gradients")
    if mode != "plain" and dtype == torch.bfloat16 and reduced == torch.float16:
        pytest.skip("covered without a scaler")
    params, split, opt = _make(device, gen, dtype, reduced)
    scaled = mode != "plain"
    scaler = _scaler("mixprec" if mode.startswith("mixprec") else "torch", device, dtype) if scaled else None
    tracks = [Track(ps) for ps in split]  # fp32 math on fp32 weights or masters: float64's bound
    for step in range(1, 9):
        seen = _set_grads(params, gen, device, SCALE if scaled else 1.0)
        stored = [p.grad.clone() for p in params]
        if mode == "plain":
            opt.step()
        elif mode == "step_grad_scaler":
            opt.step(grad_scaler=scaler)
        else:
            if mode == "torch_unscale_first":
                scaler.unscale_(opt)
            _quiet_step(scaler, opt)
        if scaled:
            scaler.update()
            assert scaler.get_scale() == SCALE
        for gi, (track, group) in enumerate(zip(tracks, opt.param_groups)):
            track.step(seen[gi::2], clip_factor(seen, 1.0), step=step, lr=float(group["lr"]), betas=(0.9, 0.999),
                       eps=1e-6, weight_decay=group["weight_decay"])
    for p, g in zip(params, stored):  # .grad holds the unscaled gradient the update used
        expect = g if not scaled else (g.float() / SCALE).to(dtype)
        assert_bitwise_equal(p.grad, expect, ".grad after the step")
    for gi, (track, ps) in enumerate(zip(tracks, split)):
        group = opt.param_groups[gi]
        assert group["lr"].dtype == torch.float32 and group["lr"].device == ps[0].device
        assert group["step"].device == ps[0].device and float(group["step"]) == 8
        masters = [opt.state[p].get("master_param", p) for p in ps]
        check_against(track, masters, [opt.state[p]["exp_avg"] for p in ps],
                      [opt.state[p]["exp_avg_sq"] for p in ps], torch.float32, f"{mode} group {gi}")
        for i, (p, m) in enumerate(zip(ps, masters)):
            assert ("master_param" in opt.state[p]) == (dtype != torch.float32)
            assert m.dtype == torch.float32
            if dtype != torch.float32:  # the model copy is the rounded master
                assert_bitwise_equal(p.detach(), m.to(dtype), f"model copy [{i}]")


@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("mode", ["torch_scaler_step", "mixprec_scaler_step", "step_grad_scaler"])
def test_non_finite_gradient_skips_the_whole_step(device, gen, mode, where):
    dtype = torch.float16
    params, split, opt = _make(device, gen, dtype, dtype)
    scaler = _scaler("mixprec" if mode.startswith("mixprec") else "torch", device, dtype)

    def step():
        _quiet_step(scaler, opt) if mode != "step_grad_scaler" else opt.step(grad_scaler=scaler)
        scaler.update()

    for _ in range(2):
        _set_grads(params, gen, device, SCALE)
        step()
    _set_grads(params, gen, device, SCALE)
    victim = params[int(torch.randint(0, len(params), (1,), generator=gen))]
    inject_non_finite(victim.grad, where, [math.inf, -math.inf, math.nan][int(torch.randint(0, 3, (1,),
                                                                                            generator=gen))], gen)
    grads = [p.grad for p in params]
    state = _everything(opt, params)
    before, before_grads = snapshot(state), snapshot(grads)
    step()
    assert_unchanged(before, state, "step with a non-finite gradient")
    # torch's scaler checks the grads by multiplying them by 1.0 in place, which on CUDA turns any
    # NaN into the canonical NaN: the payload is torch's doing, the values must stay.
    for i, (g, b) in enumerate(zip(grads, before_grads)):
        assert_bitwise_equal(g, b, f"grad {i} after a skipped step", nan_equal=mode != "mixprec_scaler_step")
    assert scaler.get_scale() == SCALE / 2
    _set_grads(params, gen, device, SCALE / 2)
    step()  # the next good step proceeds
    assert all(float(g["step"]) == 3 for g in opt.param_groups)
    assert not torch.equal(params[0].detach(), before[0])


def test_lr_tensor_changed_between_steps_takes_effect(device, gen):
    params, split, opt = _make(device, gen, torch.float32, None)
    tracks = [Track(ps) for ps in split]
    # A scheduler's fill_, a new tensor, and a plain number (torch's own schedulers' two ways).
    changes = {2: lambda g, i: g["lr"].fill_(5e-3 * (i + 1)),
               3: lambda g, i: g.__setitem__("lr", torch.tensor(2e-2 / (i + 1), device=device)),
               4: lambda g, i: g.__setitem__("lr", 7e-3)}
    for step in range(1, 6):
        for i, g in enumerate(opt.param_groups):
            if step in changes:
                changes[step](g, i)
        lrs = [float(g["lr"]) for g in opt.param_groups]
        seen = _set_grads(params, gen, device)
        opt.step()
        for gi, track in enumerate(tracks):
            track.step(seen[gi::2], clip_factor(seen, 1.0), step=step, lr=lrs[gi], betas=(0.9, 0.999), eps=1e-6,
                       weight_decay=opt.param_groups[gi]["weight_decay"])
    for gi, (track, ps) in enumerate(zip(tracks, split)):
        for i, p in enumerate(ps):
            assert_rel_err(p, track.ref[0][i], 1e-5, f"group {gi} param {i}")


def test_each_group_owns_its_lr_and_step_tensors(device, gen):
    # Apex clones tensor defaults per group: a scheduler's fill_ on one group's lr must not move
    # another's. Groups added later start at the constructor's step, or at their own.
    ps = [torch.nn.Parameter(random_tensor(4, torch.float16, device, gen)) for _ in range(4)]
    lr = torch.tensor(2e-3)
    opt = FusedMixedPrecisionLamb([{"params": ps[:1]}, {"params": ps[1:2]}], lr=lr, step=3,
                                  reduced_precision_dtype=torch.float16)
    opt.add_param_group({"params": ps[2:3]})
    opt.add_param_group({"params": ps[3:], "step": 10})
    groups = opt.param_groups
    for g in groups:
        assert g["lr"] is not lr and g["lr"].dtype == torch.float32 and g["lr"].device == ps[0].device
        assert g["step"].dtype == torch.float32 and g["step"].device == ps[0].device
    groups[0]["lr"].fill_(0.5)
    assert [float(g["lr"]) for g in groups[1:]] == [pytest.approx(2e-3)] * 3 and float(lr) == pytest.approx(2e-3)
    assert [float(g["step"]) for g in groups] == [3, 3, 3, 10]
    for p in ps:
        p.grad = random_tensor(4, torch.float16, device, gen)
    opt.step()
    assert [float(g["step"]) for g in groups] == [4, 4, 4, 11]


def _twin(opt, params, reduced):
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    groups = [{"params": twins[0::2]}, {"params": twins[1::2], "weight_decay": 0.0, "lr": 3e-3}]
    return twins, FusedMixedPrecisionLamb(groups, lr=1e-2, reduced_precision_dtype=reduced)


def _through_a_file(state_dict):
    """A checkpoint as torch.save writes it and torch.load(weights_only=True) reads it back."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_state_dict_round_trip_and_copies_resume_bit_identically(device, gen):
    dtype = torch.bfloat16
    params, split, opt = _make(device, gen, dtype, dtype, step=5)
    for _ in range(3):
        _set_grads(params, gen, device)
        opt.step()
    loaded = _through_a_file(opt.state_dict())
    twins, opt2 = _twin(opt, params, dtype)
    opt2.load_state_dict(loaded)
    loaded["param_groups"][0]["lr"].fill_(123.0)  # the loaded optimizer owns its scalars
    loaded["param_groups"][0]["step"].fill_(0.0)
    clone = copy.deepcopy(opt)
    cgroups = [g["params"] for g in clone.param_groups]
    cparams = [cgroups[i % 2][i // 2] for i in range(len(params))]  # in params' order (groups interleave)
    for _ in range(3):
        _set_grads(params, gen, device, SCALE)
        for t, c, p in zip(twins, cparams, params):
            t.grad, c.grad = p.grad.clone(), p.grad.clone()
        for o in (opt, opt2, clone):
            o.step(grad_scaler=_scaler("torch", device, dtype))
    for other, others in ((opt2, twins), (clone, cparams)):
        assert other.reduced_precision_dtype is dtype
        for i, (p, t) in enumerate(zip(params, others)):
            assert_bitwise_equal(t, p, f"param[{i}]")
            assert sorted(other.state[t]) == ["exp_avg", "exp_avg_sq", "master_param"]
            for key in opt.state[p]:
                assert_bitwise_equal(other.state[t][key], opt.state[p][key], f"state[{i}][{key}]")
        for g, g2 in zip(opt.param_groups, other.param_groups):
            assert float(g2["step"]) == float(g["step"]) == 11
            assert_bitwise_equal(g2["lr"], g["lr"], "lr")
            assert g2["lr"].device == g2["params"][0].device


def test_apex_shaped_checkpoint_loads(gen):
    # Apex's state_dict: int32 step, 0-dim lr, no adam_w_mode/use_nvlamb (optimizer attributes).
    params, _, opt = _make("cpu", gen, torch.float32, None)
    saved = {"state": {i: {"exp_avg": random_tensor(p.shape, torch.float32, "cpu", gen),
                           "exp_avg_sq": random_tensor(p.shape, torch.float32, "cpu", gen).abs()}
                       for i, p in enumerate(params)},
             "param_groups": [dict(lr=torch.tensor(4e-3), step=torch.tensor([7], dtype=torch.int), bias_correction=True,
                                   betas=(0.9, 0.999), eps=1e-6, weight_decay=wd, grad_averaging=True, max_grad_norm=1.0,
                                   params=ids) for wd, ids in ((0.01, [0, 2]), (0.0, [1, 3]))]}
    opt.load_state_dict(saved)
    for g in opt.param_groups:
        assert float(g["step"]) == 7 and g["adam_w_mode"] is True and g["use_nvlamb"] is False
        assert g["lr"].dtype == torch.float32 and float(g["lr"]) == pytest.approx(4e-3)
    _set_grads(params, gen, "cpu")
    opt.step()
    assert float(opt.param_groups[0]["step"]) == 8


@pytest.mark.parametrize("kw,exc,words", [
    (dict(amsgrad=True), RuntimeError, "AMSGrad"),
    (dict(reduced_precision_dtype=torch.int8), ValueError, "invalid reduced_precision_dtype"),
    (dict(reduced_precision_dtype="float16"), ValueError, "invalid reduced_precision_dtype"),
    (dict(step=-1), ValueError, "FusedMixedPrecisionLamb: step is -1.0"),
    (dict(step=True), ValueError, "FusedMixedPrecisionLamb: step is bool"),
    (dict(lr=-1.0), ValueError, "FusedMixedPrecisionLamb: defaults: invalid lr"),
    (dict(betas=(1.0, 0.9)), ValueError, "invalid betas"),
    (dict(max_grad_norm=math.nan), ValueError, "invalid max_grad_norm"),
])
def test_bad_constructor_arguments_raise_named_errors(gen, kw, exc, words):
    p = torch.nn.Parameter(random_tensor(5, torch.float16, "cpu", gen))
    before = snapshot([p])
    with pytest.raises(exc, match=words):
        FusedMixedPrecisionLamb([p], **kw)
    assert_unchanged(before, [p], "params")


def _records(scaler):
    """The scaler's per-optimizer records, a fresh one (READY, no check) counting as none."""
    out = {k: (v["stage"].name, dict(v["found_inf_per_device"])) for k, v in scaler._per_optimizer_states.items()}
    return {k: v for k, v in out.items() if v != ("READY", {})}


def _options(opt):
    return [{k: v for k, v in g.items() if not isinstance(v, torch.Tensor) and k != "params"} for g in opt.param_groups]


def _refused(opt, params, call, words, scaler=None):
    everything = _everything(opt, params)
    before, options, n_state = snapshot(everything), _options(opt), len(opt.state)
    records = _records(scaler) if scaler is not None else None
    scale = scaler._scale.clone() if scaler is not None else None
    with pytest.raises(ValueError, match=words):
        call()
    assert_unchanged(before, _everything(opt, params), "refused call")
    assert _options(opt) == options and len(opt.state) == n_state
    if scaler is not None:
        assert _records(scaler) == records
        assert_bitwise_equal(scaler._scale, scale, "scale")


@pytest.mark.parametrize("scaler_kind", ["torch", "mixprec"])
def test_refused_calls_change_nothing(gen, scaler_kind):
    dtype = torch.float16
    params, split, opt = _make("cpu", gen, dtype, dtype)
    _set_grads(params, gen, "cpu")
    opt.step()
    extra = torch.nn.Parameter(random_tensor(3, dtype, "cpu", gen))
    name = "FusedMixedPrecisionLamb"
    _refused(opt, params, lambda: opt.add_param_group({"params": [extra], "eps": -1.0}),
             f"{name}: param group 2: invalid eps")
    _refused(opt, params, lambda: opt.add_param_group({"params": [extra], "step": -3}),
             rf"{name}.add_param_group: param group 2 'step' is -3.0")
    good = opt.state_dict()
    bad_lr = copy.deepcopy(good)
    bad_lr["param_groups"][1]["lr"] = math.nan
    _refused(opt, params, lambda: opt.load_state_dict(bad_lr), "param group 1: invalid lr")
    bad_state = copy.deepcopy(good)
    bad_state["state"][2]["exp_avg_sq"].view(-1)[0] = -1.0
    _refused(opt, params, lambda: opt.load_state_dict(bad_state), r"state\[2\]\['exp_avg_sq'\] holds negative")
    bad_step = copy.deepcopy(good)
    bad_step["param_groups"][0]["step"] = torch.tensor([-2.0])
    _refused(opt, params, lambda: opt.load_state_dict(bad_step), "param group 0 'step' is -2.0")
    # A bad option found by step(grad_scaler=...) also leaves the scaler's record as it was.
    scaler = _scaler(scaler_kind, "cpu", dtype)
    _set_grads(params, gen, "cpu", SCALE)
    opt.param_groups[1]["eps"] = -1e-6
    _refused(opt, params, lambda: opt.step(grad_scaler=scaler), f"{name}: param group 1: invalid eps", scaler)
    _refused(opt, params, lambda: _quiet_step(scaler, opt), f"{name}: param group 1: invalid eps", scaler)


def test_exported_under_apex_alias(tmp_path):
    code = ("import mixprec; mixprec.enable_apex_alias()\n"
            "from apex.optimizers import FusedMixedPrecisionLamb\n"
            "assert FusedMixedPrecisionLamb is mixprec.optimizers.FusedMixedPrecisionLamb\n"
            "assert issubclass(FusedMixedPrecisionLamb, mixprec.optimizers.FusedLAMB)\nprint('OK')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
