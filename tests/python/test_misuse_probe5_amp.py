# The fifth misuse probe (issue 20), part 3: amp with the lean optimizer options (stochastic rounding,
# remainder masters, 8-bit moments) and FP8, checkpoints moved between those modes, and
# mixprec.GradScaler with several optimizers and losses beside torch.amp.GradScaler.
from __future__ import annotations

import io
import math

import pytest
import torch

from amp_support import amp_world, assert_same_world
from conftest import assert_bitwise_equal, random_tensor
from mixprec import GradScaler, amp
from mixprec.optimizers import FusedAdam, FusedLAMB, FusedSGD


def make_model(gen, width=16):
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, 0.2))
    return model


def twin_models(gen):
    model = make_model(gen)
    twin = make_model(gen)
    twin.load_state_dict(model.state_dict())
    return model, twin


def train(model, opt, seed, steps=2, cast=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 16, generator=g)
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- stochastic rounding under amp ---------------------------------------------------------------

@pytest.mark.parametrize("level, cast, pattern", [
    ("O2", torch.float16, "keeps fp32 masters"), ("O2", torch.bfloat16, "keeps fp32 masters"),
    ("O3", torch.float16, "rounds to bfloat16; the model is cast to torch.float16"),
])
def test_initialize_refuses_stochastic_rounding_the_level_cannot_keep(level, cast, pattern, gen):
    """O2 turned the optimizer's masters on beside rounding='stochastic', a combination its own
    rules refuse, so every step after initialize raised; O3 at float16 did the same."""
    model = make_model(gen)
    opt = FusedAdam(model.parameters(), lr=1e-2, rounding="stochastic")
    before = amp_world([model], [opt])
    with pytest.raises(ValueError, match=rf"amp.initialize: optimizer 0 param group 0 has rounding='stochastic'.*{pattern}"):
        amp.initialize(model, opt, opt_level=level, cast_model_type=cast, verbosity=0)
    assert_same_world(before, amp_world([model], [opt]))


def test_o3_bf16_with_stochastic_rounding_steps_as_the_plain_optimizer(gen):
    model, twin = twin_models(gen)
    opt = FusedAdam(model.parameters(), lr=1e-2, rounding="stochastic", seed=4)
    model, opt = amp.initialize(model, opt, opt_level="O3", cast_model_type=torch.bfloat16, verbosity=0)
    twin = twin.bfloat16()
    ref = FusedAdam(twin.parameters(), lr=1e-2, rounding="stochastic", seed=4)
    train(model, opt, 7, steps=3)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        ref.zero_grad()
        twin(torch.randn(16, 16, generator=g).bfloat16()).float().square().mean().backward()
        ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_bitwise_equal(p.detach(), q.detach())


# ---- checkpoints moved between lean modes under amp ---------------------------------------------

MODES = {"fp32-masters": dict(), "remainder": dict(master_weights="remainder"),
         "int8": dict(opt=dict(state_dtype=torch.int8)),
         "fp8-remainder-int8": dict(master_weights="remainder", fp8=True, opt=dict(state_dtype=torch.int8))}


def initialized(gen_model, mode):
    kw = dict(MODES[mode])
    opt = FusedAdam(gen_model.parameters(), lr=1e-2, **kw.pop("opt", {}))
    return amp.initialize(gen_model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0, **kw)


@pytest.mark.parametrize("source, target", [("remainder", "fp32-masters"), ("fp32-masters", "remainder"),
                                            ("int8", "fp32-masters"), ("fp8-remainder-int8", "fp8-remainder-int8")])
def test_a_checkpoint_resumes_bit_for_bit_in_another_lean_mode(source, target, gen):
    """checkpoint_state, saved and loaded weights_only: the optimizer's groups take the checkpoint's
    options (as documented), so the resumed run is the saved run's continuation."""
    a, b = twin_models(gen)
    a, opt_a = initialized(a, source)
    train(a, opt_a, 1)
    saved = roundtrip(amp.checkpoint_state(a, opt_a))
    train(a, opt_a, 2)
    continued = [p.detach().clone() for p in a.parameters()]
    b, opt_b = initialized(b, target)  # a fresh amp: a's scalers go, the checkpoint brings them back
    amp.load_checkpoint_state(saved, b, opt_b)
    assert opt_b.param_groups[0]["master_weights"] == opt_a.param_groups[0]["master_weights"]
    train(b, opt_b, 2)
    for p, q in zip(continued, b.parameters()):
        assert_bitwise_equal(q.detach(), p)


def test_an_fp8_amp_state_into_an_amp_without_fp8_is_refused_and_changes_nothing(gen):
    model = make_model(gen, width=32)
    model, opt = amp.initialize(model, FusedAdam(model.parameters(), lr=1e-2), opt_level="O2", fp8=True, verbosity=0)
    train(model, opt, 3)
    saved = amp.state_dict()
    other = make_model(gen, width=32)
    other, opt2 = amp.initialize(other, FusedAdam(other.parameters(), lr=1e-2), opt_level="O2",
                                 dtype=torch.bfloat16, verbosity=0)
    before = amp_world([other], [opt2])
    with pytest.raises(ValueError, match=r"amp.load_state_dict: state_dict\['fp8'\] does not match the FP8 layers"):
        amp.load_state_dict(saved)
    assert_same_world(before, amp_world([other], [opt2]))


# ---- mixprec.GradScaler beside torch.amp.GradScaler ------------------------------------------------

def scaler_run(scaler_cls, opt_cls, seed, inf_at, n_losses):
    """Two models, two optimizers, `n_losses` losses scaled by one scaler, an inf at step `inf_at`."""
    torch.manual_seed(seed)
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    kw = dict(lr=0.1, momentum=0.9) if opt_cls in (torch.optim.SGD, FusedSGD) else dict(lr=0.01)
    opts = [opt_cls(first.parameters(), **kw), opt_cls(second.parameters(), **kw)]
    scaler = scaler_cls("cpu", init_scale=2.0**8, growth_interval=2)
    log = []
    for step in range(6):
        for o in opts:
            o.zero_grad()
        hidden = first(torch.randn(8, 4))
        out = second(hidden)
        losses = [out.square().mean(), hidden.abs().mean()][:n_losses]
        for i, loss in enumerate(losses):
            scaler.scale(loss).backward(retain_graph=i < len(losses) - 1)
        if step == inf_at:
            second.weight.grad[0, 0] = math.inf
        scaler.unscale_(opts[0])  # one unscaled by hand (to clip), one by step()
        for o in opts:
            scaler.step(o)
        scaler.update()
        log.append([p.detach().clone() for p in [*first.parameters(), *second.parameters()]] + [scaler.get_scale()])
    return log, scaler


@pytest.mark.parametrize("n_losses", [1, 2])
@pytest.mark.parametrize("inf_at", [None, 3])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedSGD, FusedAdam], ids=lambda c: c.__name__)
def test_several_optimizers_and_losses_step_as_torchs_scaler(opt_cls, inf_at, n_losses, seed):
    ours, scaler = scaler_run(GradScaler, opt_cls, seed, inf_at, n_losses)
    theirs, _ = scaler_run(torch.amp.GradScaler, opt_cls, seed, inf_at, n_losses)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a[-1] == b[-1], f"step {step}: scale"
        for x, y in zip(a[:-1], b[:-1]):
            assert_bitwise_equal(x, y, f"step {step}")
    restored = GradScaler("cpu")
    restored.load_state_dict(roundtrip(scaler.state_dict()))
    assert restored.state_dict() == scaler.state_dict()


def _unscale_twice(s, o):
    s.unscale_(o)
    s.unscale_(o)


def _step_twice(s, o):
    s.step(o)
    s.step(o)


def _unscale_after_step(s, o):
    s.step(o)
    s.unscale_(o)


MISORDERED = {"unscale_twice": _unscale_twice, "step_twice": _step_twice, "unscale_after_step": _unscale_after_step,
              "update_without_step": lambda s, o: s.update()}


@pytest.mark.parametrize("case", list(MISORDERED))
def test_misordered_scaler_calls_fail_as_torchs_and_the_failing_call_changes_nothing(case, seed):
    errors = []
    for cls in (torch.amp.GradScaler, GradScaler):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale(model(torch.randn(2, 3)).sum()).backward()
        calls = []
        # Each call but the last is made; the world is snapshotted before the last (the refused one).
        MISORDERED[case](_Recorder(scaler, calls), opt)
        for name, args in calls[:-1]:
            getattr(scaler, name)(*args)
        before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()], scaler.state_dict()
        with pytest.raises((RuntimeError, AssertionError)) as info:
            getattr(scaler, calls[-1][0])(*calls[-1][1])
        errors.append((type(info.value), str(info.value)))
        for (p0, g0), p in zip(before[0], model.parameters()):
            assert_bitwise_equal(p.detach(), p0)
            assert_bitwise_equal(p.grad, g0)
        assert scaler.state_dict() == before[1]
    assert errors[0] == errors[1]


class _Recorder:
    """Stands for a scaler in MISORDERED's sequences: records the calls instead of making them."""

    def __init__(self, scaler, calls):
        self._calls = calls

    def __getattr__(self, name):
        return lambda *args: self._calls.append((name, args))


def test_a_scaler_stepping_an_optimizer_it_never_scaled_for_fails_as_torchs(seed):
    errors = []
    for cls in (torch.amp.GradScaler, GradScaler):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cls("cpu", init_scale=4.0).scale(model(torch.randn(2, 3)).sum()).backward()
        other = cls("cpu", init_scale=8.0)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(AssertionError) as info:
            other.step(opt)
        errors.append(str(info.value))
        for p, p0 in zip(model.parameters(), before):
            assert_bitwise_equal(p.detach(), p0)
    assert errors[0] == errors[1]


# ---- amp.init's handle (Apex's original API) with the lean options and held steps -----------------

@pytest.mark.parametrize("cls, kw", [(FusedAdam, dict(state_dtype=torch.int8)), (FusedAdam, dict(state_dtype=torch.bfloat16)),
                                     (FusedLAMB, {})], ids=["adam-int8", "adam-bf16-moments", "lamb"])
def test_a_handle_skips_an_overflowing_step_of_a_held_lean_optimizer(cls, kw, gen):
    """The handle unscales and checks the gradients and arms the optimizer's skip: the run equals
    the plain optimizer's given the same (unscaled) gradients with the overflowing step left out,
    codes and held norms included."""
    model, twin = twin_models(gen)
    opt, ref = cls(model.parameters(), lr=1e-2, **kw), cls(twin.parameters(), lr=1e-2, **kw)
    handle = amp.init(loss_scale=128.0)
    try:
        for step in range(5):
            x = random_tensor((6, 16), torch.float32, "cpu", gen)
            opt.zero_grad()
            with handle.scale_loss(model(x).float().square().mean(), opt) as scaled:
                scaled.backward()
                if step == 2:
                    model[0].weight.grad[0, 0] = math.inf
            for p, q in zip(model.parameters(), twin.parameters()):
                q.grad = p.grad.clone()
            opt.step()
            if step != 2:
                ref.step()
    finally:
        handle._deactivate()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_bitwise_equal(p.detach(), q.detach())
        for key, value in opt.state[p].items():
            assert_bitwise_equal(value, ref.state[q][key], key)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64], ids=str)
def test_an_fp8_linear_given_an_input_of_another_dtype_fails_as_nn_linear(dtype, gen):
    """Peer-equal: on the CPU emulation path (and with fewer than 16 tokens, plain linear) the
    error is torch's own for nn.Linear, word for word."""
    from mixprec.fp8 import Fp8Linear

    layer, plain = Fp8Linear(16, 32), torch.nn.Linear(16, 32)
    x = random_tensor((4, 16), torch.float32, "cpu", gen).to(dtype)
    errors = []
    for module in (layer, plain):
        with pytest.raises(RuntimeError) as info:
            module(x)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def _world(model, opt):
    return [t.detach().clone() for t in model.parameters()] + [p.grad.clone() for p in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values()]


def _same(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("wrapped", [False, True], ids=["handle_scale_loss", "wrap_optimizer"])
@pytest.mark.parametrize("overflow", [False, True])
def test_a_guarded_step_the_optimizer_refuses_keeps_its_overflow_flag_for_the_retry(overflow, wrapped, device, gen):
    """The guard (the overflow flag of the blocks since the last step) was dropped before the step
    ran: a step the fused optimizer refused (a NaN lr), retried once fixed, then applied the
    overflowing gradients on a GPU, where the step is called to skip itself on the device. (On the
    CPU the flag is read on the host and an overflowing step is never called.)"""
    from mixprec.amp import _o1_scale

    model = make_model(gen).to(device)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    handle = amp.init(loss_scale=128.0)
    try:
        stepper = handle.wrap_optimizer(opt) if wrapped else opt
        scale_loss = stepper.scale_loss if wrapped else (lambda loss: handle.scale_loss(loss, opt))
        x = random_tensor((6, 16), torch.float32, device, gen)
        with scale_loss(model(x).float().square().mean()) as scaled:
            scaled.backward()
            if overflow:
                model[0].weight.grad[0, 0] = math.inf
        opt.param_groups[0]["lr"] = float("nan")
        before = _world(model, opt)
        flags = (stepper._found, stepper._loss_idx) if wrapped else None
        try:
            stepper.step()
            was_refused = False
        except ValueError as e:
            assert "invalid lr nan" in str(e)
            was_refused = True
        assert was_refused != (overflow and device == "cpu")
        assert _same(before, _world(model, opt)), "a skipped or refused step changes nothing"
        if not was_refused:
            return
        if wrapped:  # the wrapper's losses since the last step, with their flag, are as before
            assert stepper._loss_idx == flags[1] and torch.equal(stepper._found, flags[0])
        else:
            assert _o1_scale.is_armed(opt)
        opt.param_groups[0]["lr"] = 1e-2
        stepper.step()
        assert _same(before, _world(model, opt)) == overflow
    finally:
        handle._deactivate()


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedSGD], ids=lambda c: c.__name__)
@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_an_amp_step_refused_then_retried_is_the_step_it_would_have_been(level, overflow, opt_cls, gen):
    """amp.initialize's step keeps the block's flag and scale until a step runs: the retry of a
    refused step (a NaN lr) skips an overflow and otherwise steps as the twin that never failed."""
    model, twin = twin_models(gen)
    x = random_tensor((4, 16), torch.float32, "cpu", gen)
    results = []
    for refuse, m in ((True, model), (False, twin)):
        m, opt = amp.initialize(m, opt_cls(m.parameters(), lr=1e-2), opt_level=level, loss_scale="dynamic",
                                verbosity=0)
        with amp.scale_loss(m(x).float().square().mean(), opt) as scaled:
            scaled.backward()
            if overflow:
                m[0].weight.grad[0, 0] = math.inf
        if refuse:
            opt.param_groups[0]["lr"] = float("nan")
            before = [p.detach().clone() for p in m.parameters()]
            with pytest.raises(ValueError, match="invalid lr nan"):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
            opt.param_groups[0]["lr"] = 1e-2
        opt.step()
        results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)
