# Tests of mixprec.GradScaler: bit-equality with torch.amp.GradScaler over training runs with
# injected inf/NaN, device-side skipping of any optimizer, hysteresis and bounds, state_dicts
# both ways, no host sync (CUDA), and the disabled scaler.
from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch

from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)
from conftest import DEVICES, assert_bitwise_equal, cuda_available, random_tensor
from mixprec.grad_scaler import GradScaler
from mixprec.optimizers import FusedAdam


def low_dtype(device) -> torch.dtype:
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16


def make_model(gen, device) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, scale=0.25))
    return model.to(device)


def make_data(gen, device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(random_tensor((6, 8), torch.float32, device, gen), random_tensor((6, 4), torch.float32, device, gen))
            for _ in range(steps)]


def poison_grad(model: torch.nn.Module, value: float, index: int) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    g = params[index % len(params)].grad
    g.view(-1)[index % g.numel()].fill_(value)  # fill_ takes the scalar as a kernel argument: no copy, no sync


OPTIMIZERS = {
    "sgd_momentum": lambda ps, dev: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam_foreach": lambda ps, dev: torch.optim.Adam(ps, lr=1e-2, foreach=True, capturable=dev != "cpu"),
    "adamw_loop": lambda ps, dev: torch.optim.AdamW(ps, lr=1e-2, foreach=False, amsgrad=True,
                                                    capturable=dev != "cpu"),
    "rmsprop": lambda ps, dev: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, capturable=dev != "cpu"),
    "adam_fused": lambda ps, dev: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "mixprec_fused_adam": lambda ps, dev: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
}


def train(scaler, model, opt, data, device, poison: dict, *, clip: bool = False):
    """A few autocast steps; ``poison[step]`` is written into a gradient after backward."""
    losses, scales = [], []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        with torch.autocast(torch.device(device).type, dtype=low_dtype(device)):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in poison:
            poison_grad(model, poison[step], step * 7 + 3)
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
        scales.append(scaler.get_scale())
    return losses, scales


def assert_same_run(a, b, what):
    (losses_a, scales_a), model_a, opt_a = a
    (losses_b, scales_b), model_b, opt_b = b
    assert scales_a == scales_b, f"{what}: scale sequences differ: {scales_a} vs {scales_b}"
    for i, (la, lb) in enumerate(zip(losses_a, losses_b)):
        assert_bitwise_equal(la, lb, f"{what}: loss {i}", nan_equal=True)
    for i, (pa, pb) in enumerate(zip(model_a.parameters(), model_b.parameters())):
        assert_bitwise_equal(pa, pb, f"{what}: param {i}")
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys(), what
    for k in sa:
        for key, va in sa[k].items():
            vb = sb[k][key]
            if isinstance(va, torch.Tensor):
                assert_bitwise_equal(va, vb, f"{what}: state[{k}][{key}]")
            else:
                assert va == vb, f"{what}: state[{k}][{key}]"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [False, True])
def test_matches_torch_grad_scaler(device, opt_name, clip, gen):
    # Overflows at steps 1 (inf), 2 (NaN) and 6 (-inf) exercise backoff; growth_interval=2
    # exercises growth in between. Same losses, params, optimizer state and scales, bit for bit.
    if clip and opt_name in ("adam_fused", "mixprec_fused_adam") and device == "cpu":
        pass  # unscale_ before a fused step is supported by both scalers: keep the case
    model = make_model(gen, device)
    data = make_data(gen, device, 9)
    poison = {1: math.inf, 2: math.nan, 6: -math.inf}
    runs = []
    for cls in (torch.amp.GradScaler, GradScaler):
        m = copy.deepcopy(model)
        opt = OPTIMIZERS[opt_name](m.parameters(), device)
        scaler = cls(torch.device(device).type, init_scale=2.0**12, growth_interval=2)
        runs.append((train(scaler, m, opt, data, device, poison, clip=clip), m, opt))
    assert_same_run(runs[0], runs[1], f"{opt_name} on {device}")
    assert runs[1][0][1][1] < runs[1][0][1][0], "the first overflow must back the scale off"


@pytest.mark.parametrize("device", DEVICES)
def test_two_optimizers_overflow_in_one_skips_only_it_and_backs_off_once(device, gen):
    results = []
    model0 = make_model(gen, device)
    data = make_data(gen, device, 4)
    for cls in (torch.amp.GradScaler, GradScaler):
        model = copy.deepcopy(model0)
        first, second = list(model[0].parameters()), list(model[2].parameters())
        opt_a = torch.optim.SGD(first, lr=0.1, momentum=0.9)
        opt_b = FusedAdam(second, lr=1e-2)
        scaler = cls(torch.device(device).type, init_scale=2.0**10, growth_interval=100)
        scales = []
        for step, (x, y) in enumerate(data):
            opt_a.zero_grad()
            opt_b.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=low_dtype(device)):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if step == 2:
                first[0].grad.view(-1)[5] = math.inf  # only opt_a's grads overflow
                before_b = [p.detach().clone() for p in second]
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            scales.append(scaler.get_scale())
            if step == 2:
                assert any(not torch.equal(a, b) for a, b in zip(before_b, second)), "opt_b must still step"
        results.append((scales, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0] == [1024.0, 1024.0, 512.0, 512.0]
    for a, b in zip(results[0][1], results[1][1]):
        assert_bitwise_equal(a, b, "params")


OPT_ZOO = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_amsgrad_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
}


def snapshot_all(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                     for k, v in opt.state[p].items()} for p in model.parameters() if p in opt.state}
    return params, state


def assert_all_unchanged(before, model, opt, what):
    params, state = before
    for i, (b, p) in enumerate(zip(params, model.parameters())):
        assert_bitwise_equal(p, b, f"{what}: param {i}")
    now = {id(p) for p in model.parameters() if p in opt.state and opt.state[p]}
    assert now == set(k for k, v in state.items() if v), f"{what}: the set of params with state changed"
    for p in model.parameters():
        for k, v in state.get(id(p), {}).items():
            cur = opt.state[p][k]
            if isinstance(v, torch.Tensor):
                assert_bitwise_equal(cur, v, f"{what}: state {k}")
            else:
                assert cur == v, f"{what}: state {k}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPT_ZOO))
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_fused_skip_leaves_params_and_state_bit_identical(device, opt_name, bad, gen):
    model = make_model(gen, device)
    opt = OPT_ZOO[opt_name](model.parameters())
    # sync_skip=False: the device-side skip, also on the CPU (where the default reads found_inf).
    scaler = GradScaler(torch.device(device).type, init_scale=2.0**8, growth_interval=1000, sync_skip=False)
    data = make_data(gen, device, 5)

    def backward(step):
        opt.zero_grad()
        x, y = data[step]
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()

    # The very first step creates the state; skipping it takes the documented host path and
    # must remove the state it created.
    backward(0)
    poison_grad(model, bad, 11)
    before = snapshot_all(model, opt)
    scaler.step(opt)
    scaler.update()
    assert_all_unchanged(before, model, opt, f"{opt_name}: skipped first step")
    for step in (1, 2):
        backward(step)
        scaler.step(opt)
        scaler.update()
    guard = scaler._guards[opt]
    # torch's Adagrad has no capturable mode: on a GPU its step counter stays on the CPU and is
    # read there by the optimizer itself, so the skip is host-checked (the documented fallback).
    host = torch.device(device).type == "cuda" and opt_name == "adagrad"
    assert guard.last_used_host is host, "a step with existing state must not need the host"
    backward(3)
    poison_grad(model, bad, 5)
    before = snapshot_all(model, opt)
    scaler.step(opt)
    assert guard.last_used_host is host, "the skip must be decided on the device"
    scaler.update()
    assert_all_unchanged(before, model, opt, f"{opt_name}: skipped step")
    assert scaler.skipped_steps == 2
    # And the next clean step moves the params again.
    backward(4)
    scaler.step(opt)
    scaler.update()
    assert any(not torch.equal(a, p) for a, p in zip(before[0], model.parameters()))


@pytest.mark.parametrize("sync_skip", [None, True])
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw_amsgrad_loop"])
def test_host_skip_on_the_cpu_runs_no_step_and_changes_nothing(opt_name, sync_skip, gen):
    # On the CPU the default reads found_inf (free there) instead of snapshotting: a skipped step
    # does not call step() at all, as with torch's scaler; sync_skip=True does so on any device.
    model = make_model(gen, "cpu")
    opt = OPT_ZOO[opt_name](model.parameters())
    calls = []
    original = opt.step
    opt.step = lambda *a, **k: calls.append(1) or original(*a, **k)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=1000, sync_skip=sync_skip)
    data = make_data(gen, "cpu", 4)
    for step, bad in enumerate([math.inf, None, math.nan, None]):
        opt.zero_grad()
        x, y = data[step]
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if bad is not None:
            poison_grad(model, bad, step + 3)
        before = snapshot_all(model, opt)
        n = len(calls)
        result = scaler.step(opt)
        scaler.update()
        if bad is not None:
            assert result is None and len(calls) == n, "a skipped step must not call step()"
            assert_all_unchanged(before, model, opt, f"{opt_name}: skipped step {step}")
        else:
            assert len(calls) == n + 1
            assert any(not torch.equal(a, p) for a, p in zip(before[0], model.parameters()))
    assert opt not in scaler._guards, "no snapshot buffers on the host path"
    assert scaler.skipped_steps == 2


def test_grad_scaler_keyword_is_detected_per_step_function(gen):
    # torch's deprecated protocol: a fused optimizer whose step takes grad_scaler= gets the
    # scaler itself. The check is cached per function, so two classes must not share an answer.
    class OldProtocol(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.seen = grad_scaler
            return "old"

    model = make_model(gen, "cpu")
    old = OldProtocol(model.parameters(), lr=0.1)
    new = FusedAdam(model.parameters(), lr=1e-2)
    scaler = GradScaler("cpu")
    for _ in range(2):  # the second round reads the cache
        for opt in (old, new):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 8)).sum()).backward()
        with pytest.warns(FutureWarning, match="stop passing itself"):
            assert scaler.step(old) == "old"
        assert old.seen is scaler
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler.step(new)
        assert not hasattr(new, "grad_scale") and not hasattr(new, "found_inf")
        scaler._per_optimizer_states.clear()  # old never recorded found_inf: reset the iteration


def reference_scales(found: list[bool], init, growth, backoff, interval, hysteresis=1, lo=0.0, hi=0.0):
    """The documented rule in float64 (every factor here is a power of two: exact in float32)."""
    scale, tracker, tolerated, out = init, 0, hysteresis, []
    for f in found:
        if f:
            tracker = 0
            tolerated -= 1
            if tolerated <= 0:
                scale = max(scale * backoff, lo)
                tolerated = hysteresis
        else:
            tracker += 1
            if tracker >= interval:
                grown = scale * growth
                scale = min(grown, hi) if hi > 0 else grown
                tracker = 0
                tolerated = hysteresis
        out.append(scale)
    return out


class OneParam:
    """A one-parameter problem whose gradient overflows exactly on the chosen steps."""

    def __init__(self, device):
        self.p = torch.nn.Parameter(torch.ones(3, device=device))
        self.opt = torch.optim.SGD([self.p], lr=1e-3)

    def run(self, scaler, found):
        scales = []
        for f in found:
            self.opt.zero_grad()
            scaler.scale((self.p * 1.5).sum()).backward()
            if f:
                self.p.grad[1] = math.inf
            scaler.step(self.opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [
    dict(hysteresis=3),
    dict(hysteresis=2, min_scale=2.0**6),
    dict(max_scale=2.0**11),
    dict(hysteresis=1, min_scale=2.0**7, max_scale=2.0**10),
])
def test_hysteresis_and_bounds_follow_the_rule(device, config, rng):
    found = [rng.random() < 0.45 for _ in range(40)] + [True] * 6 + [False] * 12
    kw = dict(init_scale=2.0**9, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    scaler = GradScaler(torch.device(device).type, **kw, **config)
    got = OneParam(device).run(scaler, found)
    want = reference_scales(found, 2.0**9, 2.0, 0.5, 3, config.get("hysteresis", 1), config.get("min_scale", 0.0),
                            config.get("max_scale", 0.0))
    assert got == want
    assert scaler.skipped_steps == sum(found)
    if "min_scale" in config:
        assert min(got) >= config["min_scale"]
    if "max_scale" in config:
        assert max(got) <= config["max_scale"]


def test_hysteresis_delays_backoff():
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=100, hysteresis=3)
    scales = OneParam("cpu").run(scaler, [True, True, True, True])
    assert scales == [1024.0, 1024.0, 512.0, 512.0]


def test_scale_history_is_kept_on_request():
    scaler = GradScaler("cpu", init_scale=64.0, growth_interval=2, history_size=4)
    found = [False, True, False, False, False, True]
    OneParam("cpu").run(scaler, found)
    used = [64.0, 64.0, 32.0, 32.0, 64.0, 64.0]  # the scale each step's loss was multiplied by
    assert scaler.scale_history() == used[-4:]
    assert scaler.scale_history(with_overflow=True) == list(zip(used[-4:], found[-4:]))
    assert GradScaler("cpu").scale_history() == []


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trips_both_ways(device, rng):
    kind = torch.device(device).type
    found = [rng.random() < 0.4 for _ in range(9)]
    ours = GradScaler(kind, init_scale=2.0**10, growth_interval=2, hysteresis=2, min_scale=4.0, max_scale=2.0**14)
    OneParam(device).run(ours, found)
    sd = ours.state_dict()
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= sd.keys()
    assert sd["_skipped_steps"] == sum(found) and sd["hysteresis"] == 2

    theirs = torch.amp.GradScaler(kind)
    theirs.load_state_dict(sd)  # torch ignores mixprec's extra keys
    assert theirs.get_scale() == ours.get_scale() and theirs._get_growth_tracker() == ours._get_growth_tracker()

    # torch -> mixprec, then both continue identically (hysteresis 1, no bounds: torch's rule).
    t = torch.amp.GradScaler(kind, init_scale=2.0**9, growth_interval=3)
    OneParam(device).run(t, found)
    m = GradScaler(kind)
    m.load_state_dict(t.state_dict())
    more = [rng.random() < 0.4 for _ in range(8)]
    assert OneParam(device).run(m, more) == OneParam(device).run(t, more)

    # mixprec -> mixprec keeps everything, including trackers mid-hysteresis.
    clone = GradScaler(kind)
    clone.load_state_dict(ours.state_dict())
    assert clone.state_dict() == ours.state_dict()
    assert OneParam(device).run(clone, more) == OneParam(device).run(ours, more)


def test_state_dict_before_first_step_and_pickle():
    scaler = GradScaler("cpu", init_scale=8.0, hysteresis=2)
    assert scaler.state_dict()["scale"] == 8.0
    OneParam("cpu").run(scaler, [True, False, True])
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.state_dict() == scaler.state_dict()
    assert OneParam("cpu").run(restored, [True, False]) == OneParam("cpu").run(scaler, [True, False])


@pytest.mark.parametrize("bad", [
    {"scale": -1.0}, {"scale": math.nan}, {"growth_factor": 0.5}, {"backoff_factor": 1.5},
    {"growth_interval": -1}, {"growth_interval": 2.5}, {"_growth_tracker": -1}, {"hysteresis": 0},
    {"_hysteresis_tracker": -2}, {"min_scale": -1.0}, {"min_scale": 8.0, "max_scale": 4.0},
    {"_skipped_steps": "3"}, "missing_scale",
])
def test_load_state_dict_rejects_bad_values_and_changes_nothing(bad):
    scaler = GradScaler("cpu", init_scale=16.0, hysteresis=2)
    OneParam("cpu").run(scaler, [True, False])
    before = scaler.state_dict()
    sd = dict(before)
    if bad == "missing_scale":
        del sd["scale"]
    else:
        sd.update(bad)
    with pytest.raises((ValueError, KeyError)):
        scaler.load_state_dict(sd)
    assert scaler.state_dict() == before
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})


def test_misuse_raises_like_torch():
    m = OneParam("cpu")
    scaler = GradScaler("cpu")
    with pytest.raises(AssertionError, match="_scale is None"):
        scaler.step(m.opt)
    scaler.scale((m.p * 2).sum()).backward()
    scaler.unscale_(m.opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(m.opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(m.opt, closure=lambda: 0.0)
    scaler.step(m.opt)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        scaler.step(m.opt)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()
    with pytest.raises(AssertionError):
        GradScaler("cpu", growth_factor=1.0)
    with pytest.raises(AssertionError):
        GradScaler("cpu", backoff_factor=1.0)
    with pytest.raises(ValueError, match="hysteresis"):
        GradScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match="max_scale"):
        GradScaler("cpu", min_scale=8.0, max_scale=4.0)


def test_update_with_new_scale_and_setters():
    m = OneParam("cpu")
    scaler = GradScaler("cpu", init_scale=32.0)
    scaler.scale((m.p * 2).sum()).backward()
    m.p.grad[0] = math.inf
    scaler.step(m.opt)
    scaler.update(new_scale=100.0)
    assert scaler.get_scale() == 100.0 and scaler.skipped_steps == 1
    scaler.scale((m.p * 2).sum()).backward()
    scaler.step(m.opt)
    scaler.update(torch.tensor(7.0))
    assert scaler.get_scale() == 7.0
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(5)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 5)


def test_disabled_scaler_is_a_no_op():
    m = OneParam("cpu")
    scaler = GradScaler("cpu", enabled=False)
    loss = (m.p * 2).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = m.p.detach().clone()
    scaler.unscale_(m.opt)
    assert torch.equal(m.p.grad, torch.full((3,), 2.0))  # not unscaled
    scaler.step(m.opt)
    assert not torch.equal(m.p, before)  # a plain optimizer.step()
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
    assert scaler.skipped_steps == 0 and scaler.scale_history() == []
    scaler.load_state_dict({"scale": 5.0})  # ignored, as in torch


@pytest.mark.skipif(cuda_available(), reason="needs a machine without CUDA")
def test_cuda_scaler_without_cuda_disables_itself_with_a_warning():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler()
    assert not scaler.is_enabled()


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_and_channels_last_and_sparse_grads(device, gen):
    # Mixed dtypes in one optimizer (one pass), channels_last conv grads (permuted but dense),
    # and a sparse embedding gradient: all unscaled as torch would (fp16 grads are refused as
    # torch refuses them: test_misuse_grad_scaler.py).
    conv = torch.nn.Conv2d(3, 4, 3).to(device).to(memory_format=torch.channels_last)
    emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
    half = torch.nn.Parameter(random_tensor((5,), torch.bfloat16, device, gen))
    opt = torch.optim.SGD(list(conv.parameters()) + list(emb.parameters()) + [half], lr=0.1)
    scaler = GradScaler(torch.device(device).type, init_scale=256.0)
    x = random_tensor((2, 3, 6, 6), torch.float32, device, gen).to(memory_format=torch.channels_last)
    loss = conv(x).sum() + emb(torch.tensor([1, 3, 3], device=device)).sum() + (half.float() * 2).sum()
    scaler.scale(loss).backward()
    assert not conv.weight.grad.is_contiguous()
    expected = {id(p): (p.grad.to_dense() if p.grad.is_sparse else p.grad).float() / 256.0
                for p in [conv.weight, conv.bias, emb.weight, half]}
    scaler.unscale_(opt)
    for p in [conv.weight, conv.bias, emb.weight, half]:
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        assert_bitwise_equal(g, expected[id(p)].to(g.dtype), "unscaled grad")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 256.0


@pytest.mark.cuda
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_foreach", "adamw_loop", "rmsprop", "adam_fused",
                                      "mixprec_fused_adam"])
def test_cuda_steps_never_sync(opt_name, gen):
    # After a warm-up step (state creation may sync once, as documented), clean and overflowing
    # steps run without a single host synchronization, for fused and non-fused optimizers alike.
    model = make_model(gen, "cuda")
    opt = OPTIMIZERS[opt_name](model.parameters(), "cuda")
    if opt_name == "adam_foreach":
        for g in opt.param_groups:
            g["capturable"] = False  # the scaler must switch it on by itself
    scaler = GradScaler("cuda", init_scale=2.0**12, growth_interval=2)
    data = make_data(gen, "cuda", 6)
    train(scaler, model, opt, data[:1], "cuda", {})
    before_skip = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, (x, y) in enumerate(data[1:]):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if step in (1, 3):
                poison_grad(model, math.inf if step == 1 else math.nan, step)
                before_skip = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            if step in (1, 3):
                torch.cuda.set_sync_debug_mode("default")  # torch.equal reads its answer on the host
                same = [torch.equal(a, b) for a, b in zip(before_skip, model.parameters())]
                assert all(same), "an overflowing step must not change params"
                torch.cuda.set_sync_debug_mode("error")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaler.skipped_steps == 2


@pytest.mark.cuda
def test_cuda_matches_torch_with_fp16_params_and_fused_optimizer(gen):
    # The fused path with fp16 params: the kernel unscales; both scalers agree bit for bit.
    model = make_model(gen, "cuda").half()
    data = make_data(gen, "cuda", 6)
    runs = []
    for cls in (torch.amp.GradScaler, GradScaler):
        m = copy.deepcopy(model)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3, fused=True)
        scaler = cls("cuda", init_scale=2.0**10, growth_interval=2)
        losses, scales = [], []
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x.half()).float(), y)
            scaler.scale(loss).backward()
            if step == 2:
                poison_grad(m, math.inf, 4)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
            scales.append(scaler.get_scale())
        runs.append(((losses, scales), m, opt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same_run(runs[0], runs[1], "fused fp16")
