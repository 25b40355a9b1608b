# amp.init's handles (Apex's original API): arguments, one active handle, _deactivate's exact
# restore, and loss scaling through handle.scale_loss and wrap_optimizer with injected inf/NaN.
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from amp_o1_support import assert_same_attributes, attributes, make_handle  # noqa: F401 (fixture)
from conftest import assert_unchanged, random_tensor, rel_err, snapshot
from mixprec import amp
from mixprec.amp import _o1_scale


def _model(gen, device):
    # Tanh, not ReLU: a kink that fp16 and float64 put on different sides would dwarf rounding.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, scale=0.2))
    return model.to(device)


def _batch(gen, device):
    # Small values: the scaled fp16 gradients (scale 65536) stay finite unless a test injects.
    return random_tensor((16, 8), torch.float32, device, gen, scale=0.25), \
        random_tensor((16, 4), torch.float32, device, gen, scale=0.25)


def _optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-2, capturable=next(model.parameters()).is_cuda)


def _opt_tensors(opt):
    return [p for g in opt.param_groups for p in g["params"]] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _reference_grads(model, x, y, losses=(0,)):
    """float64 gradients of the summed losses, the model's current weights, no casts."""
    ref = copy.deepcopy(model).double()
    with amp.disable_casts():
        out = ref(x.double())
        sum(_losses(out, y.double())[i] for i in losses).backward()
    return [p.grad for p in ref.parameters()]


def _losses(out, y):
    return [F.mse_loss(out, y), out.float().abs().mean()]


# -- arguments and activation -------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(loss_scale=-1.0), ValueError, "amp.init: loss_scale must be 'dynamic' or a positive finite number"),
    (dict(loss_scale=0), ValueError, "amp.init: loss_scale"),
    (dict(loss_scale=math.inf), ValueError, "amp.init: loss_scale"),
    (dict(loss_scale="static"), ValueError, "amp.init: loss_scale"),
    (dict(loss_scale=True), ValueError, "amp.init: loss_scale"),
    (dict(dtype=torch.float32), ValueError, "amp.init: dtype must be torch.float16 or torch.bfloat16"),
    (dict(patch_type=torch.float64), ValueError, "amp.init: patch_type must be"),
    (dict(dtype=torch.float16, patch_type=torch.bfloat16), ValueError, "amp.init: dtype=torch.float16 conflicts"),
    (dict(enabled="yes"), TypeError, "amp.init: enabled must be True or False"),
    (dict(enable_caching=2), TypeError, "amp.init: enable_caching must be True or False"),
    (dict(allow_banned=None), TypeError, "amp.init: allow_banned"),
])
def test_bad_arguments_raise_and_patch_nothing(kwargs, exc, match, make_handle):
    before = attributes()
    with pytest.raises(exc, match=match):
        amp.init(**kwargs)
    assert_same_attributes(before)
    assert make_handle().is_active()  # no handle was left active


@pytest.mark.parametrize("kwargs", [dict(), dict(allow_banned=True), dict(patch_type=torch.bfloat16),
                                    dict(enable_caching=False, verbose=True)])
def test_deactivate_restores_every_patched_attribute(kwargs, device):
    before = attributes()
    handle = amp.init(**kwargs)
    try:
        table = {(getattr(o, "__name__", str(o)), n) for o, n, _ in handle._patched}
        for key in [("torch", "mm"), ("torch.nn.functional", "linear"), ("torch.nn.functional", "softmax"),
                    ("Tensor", "__add__"), ("Tensor", "__matmul__"), ("Tensor", "sum"), ("Tensor", "exp_"),
                    ("torch._VF", "lstm"), ("torch._VF", "gru_cell"), ("RNNBase", "check_input"),
                    ("torch.nn.functional", "binary_cross_entropy"), ("torch", "cat")]:
            assert key in table, f"{key} is not patched"
        for owner, name, saved in handle._patched:  # each one a wrapper now, around what was there
            current = getattr(owner, name)
            assert current is not saved and current.__wrapped__ is not None, (owner, name)
        assert torch.mm(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device)).dtype != torch.float32
    finally:
        handle._deactivate()
    assert_same_attributes(before)  # `is` over every attribute of every patchable owner
    assert not handle.is_active() and not handle._patched
    # plain torch again
    a = torch.randn(3, 3, device=device)
    assert torch.mm(a, a).dtype == torch.float32
    assert (a.half() * torch.tensor(2.0, device=device)).dtype == torch.float16
    assert a.half().exp_().dtype == torch.float16
    assert torch.nn.LSTM(3, 2).to(device)(a[None])[0].dtype == torch.float32
    handle._deactivate()  # twice: nothing left to undo
    assert_same_attributes(before)


def test_only_one_handle_is_active(make_handle):
    first = make_handle()
    before = attributes()
    for kwargs in (dict(), dict(enabled=False)):
        with pytest.raises(RuntimeError, match="amp.init: an AmpHandle from an earlier amp.init"):
            amp.init(**kwargs)
    assert_same_attributes(before)
    assert first.is_active() and torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float16
    first._deactivate()
    assert make_handle(dtype=torch.bfloat16).is_active()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16


def test_disabled_init_is_a_no_op(gen):
    before = attributes()
    handle = amp.init(enabled=False)
    assert isinstance(handle, amp.NoOpHandle) and not handle.is_active()
    assert_same_attributes(before)
    model = _model(gen, "cpu")
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch(gen, "cpu")
    loss = F.mse_loss(model(x), y)
    with handle.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    with opt.scale_loss(loss) as scaled:
        assert scaled is loss
        scaled.backward()
    w0 = model[0].weight.detach().clone()
    twin = copy.deepcopy(model)  # the same step by the bare optimizer: bit-identical
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert not torch.equal(model[0].weight, w0)


def test_disable_casts_turns_the_handle_off_inside(make_handle):
    handle = make_handle()
    a = torch.ones(2, 2)
    for ctx in (handle._disable_casts, amp.disable_casts):
        with ctx():
            assert not handle.is_active() and torch.mm(a, a).dtype == torch.float32
        assert handle.is_active() and torch.mm(a, a).dtype == torch.float16


def test_verbose_prints_each_cast(make_handle, capsys):
    make_handle(verbose=True)
    torch.mm(torch.ones(2, 2), torch.ones(2, 2).half())
    torch.exp(torch.ones(2).half())
    assert capsys.readouterr().out.splitlines() == ["Float->Half (mm)", "Half->Float (exp)"]


# -- loss scaling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_scale_loss_skips_the_overflowing_step(opt_kind, bad, device, gen, make_handle):
    handle = make_handle()
    model = _model(gen, device)
    opt = _optimizer(opt_kind, model)
    scaler = handle._default_scaler
    for step in range(4):
        x, y = _batch(gen, device)
        opt.zero_grad()
        ref = _reference_grads(model, x, y)
        loss = F.mse_loss(model(x), y)
        scale = scaler.loss_scale() if step else 65536.0
        with handle.scale_loss(loss, opt) as scaled:
            assert torch.equal(scaled, loss.float() * scale)
            scaled.backward()
            if step == 2:
                model[2].weight.grad.view(-1)[5] = bad  # an overflow in the scaled gradients
        before = snapshot(_opt_tensors(opt))
        opt.step()
        if step == 2:
            assert_unchanged(before, _opt_tensors(opt), "skipped step")
            assert scaler.loss_scale() == scale / 2
        else:
            for p, r in zip(model.parameters(), ref):
                assert rel_err(p.grad, r) < 1e-2, "unscaled gradients vs float64"
            assert scaler.loss_scale() == scale
            assert any(not torch.equal(a, b) for a, b in zip(before, _opt_tensors(opt))), "a clean step applies"
        assert "step" not in vars(opt), "the guarded step removes itself"


def test_scale_loss_with_a_static_scale(device, gen, make_handle):
    handle = make_handle(loss_scale=128.0)
    model = _model(gen, device)
    opt = _optimizer("sgd", model)
    for step in range(2):
        x, y = _batch(gen, device)
        opt.zero_grad()
        ref = _reference_grads(model, x, y)
        loss = F.mse_loss(model(x), y)
        with handle.scale_loss(loss, opt) as scaled:
            assert torch.equal(scaled, loss.float() * 128.0)
            scaled.backward()
            if step:
                model[0].bias.grad[0] = math.inf
        before = snapshot(_opt_tensors(opt))
        if step:
            opt.step()  # non-finite gradients are never applied, even with a static scale
            assert_unchanged(before, _opt_tensors(opt), "skipped step")
        else:
            assert all(rel_err(p.grad, r) < 1e-2 for p, r in zip(model.parameters(), ref))
        assert handle._default_scaler.loss_scale() == 128.0


def test_an_exception_in_the_block_skips_the_next_step(device, gen, make_handle):
    handle = make_handle()
    model = _model(gen, device)
    opt = _optimizer("sgd", model)
    x, y = _batch(gen, device)
    with pytest.raises(KeyError):
        with handle.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
            raise KeyError("in the block")
    before = snapshot(_opt_tensors(opt))
    with pytest.raises(RuntimeError, match="does not support closure"):
        opt.step(lambda: None)
    assert "step" in vars(opt), "a refused step keeps the guard"
    opt.step()  # the gradients are still scaled: not applied
    assert_unchanged(before, _opt_tensors(opt), "step after an exception")
    assert handle._default_scaler.loss_scale() == 65536.0 and not handle.cache


def test_deactivate_keeps_a_pending_skip(device, gen, make_handle):
    handle = make_handle()
    model = _model(gen, device)
    opt = _optimizer("sgd", model)
    x, y = _batch(gen, device)
    with handle.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
        model[0].weight.grad[0, 0] = math.inf
    handle._deactivate()
    before = snapshot(_opt_tensors(opt))
    opt.step()
    assert_unchanged(before, _opt_tensors(opt), "overflowing step after _deactivate")
    assert "step" not in vars(opt)


def test_two_scale_loss_blocks_before_one_step(device, gen, make_handle):
    # The first block's gradients are unscaled once only; an overflow in either skips the step.
    handle = make_handle()
    model = _model(gen, device)
    opt = _optimizer("sgd", model)
    x, y = _batch(gen, device)
    ref = _reference_grads(model, x, y, losses=(0, 1))
    out = model(x)
    l0, l1 = _losses(out, y)
    with handle.scale_loss(l0, opt) as scaled:
        scaled.backward(retain_graph=True)
    with handle.scale_loss(l1, opt) as scaled:
        scaled.backward()
    assert all(rel_err(p.grad, r) < 1e-2 for p, r in zip(model.parameters(), ref))
    opt.step()
    assert "step" not in vars(opt)


def test_wrap_optimizer_trains_with_two_losses(device, gen, make_handle):
    handle = make_handle()
    model = _model(gen, device)
    raw = _optimizer("adam", model)
    opt = handle.wrap_optimizer(raw, num_loss=2)
    assert opt.param_groups is raw.param_groups and opt.state is raw.state and repr(opt) == repr(raw)
    with pytest.raises(RuntimeError, match="after handle.wrap_optimizer"):
        with handle.scale_loss(torch.ones(()), raw):
            pass
    for step in range(3):
        x, y = _batch(gen, device)
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        ref = _reference_grads(model, x, y, losses=(0, 1))
        out = model(x)
        scales = [s.loss_scale() if step else 65536.0 for s in opt._loss_scaler]
        for i, loss in enumerate(_losses(out, y)):
            with opt.scale_loss(loss) as scaled:
                scaled.backward(retain_graph=i == 0)
                if step == 1 and i == 1:
                    model[0].weight.grad[1, 2] = math.inf
        if step != 1:
            assert all(rel_err(p.grad, r) < 1e-2 for p, r in zip(model.parameters(), ref))
        grads = snapshot([p.grad for p in model.parameters()])
        with pytest.raises(RuntimeError, match="num_loss=2"):  # a third loss: refused, nothing changes
            with opt.scale_loss(out.sum()):
                pass
        with pytest.raises(NotImplementedError, match="closure"):
            opt.step(closure=lambda: None)
        assert_unchanged(grads, [p.grad for p in model.parameters()], "refused calls")
        before = snapshot(_opt_tensors(raw))
        opt.step()
        if step == 1:
            assert_unchanged(before, _opt_tensors(raw), "skipped step")
            assert [s.loss_scale() for s in opt._loss_scaler] == [scales[0], scales[1] / 2]
        else:
            assert [s.loss_scale() for s in opt._loss_scaler] == scales
    # the wrapped optimizer's state round-trips through the wrapper
    other = handle.wrap_optimizer(_optimizer("adam", copy.deepcopy(model)))
    other.load_state_dict(opt.state_dict())
    a, b = opt.state_dict()["state"], other.state_dict()["state"]
    assert all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


def test_wrap_optimizer_refuses_bad_arguments(gen, make_handle):
    handle = make_handle()
    model = _model(gen, "cpu")
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="wrap_optimizer: num_loss must be a positive int, got 0"):
        handle.wrap_optimizer(raw, num_loss=0)
    with pytest.raises(TypeError, match="wrap_optimizer: optimizer must be a torch.optim.Optimizer"):
        handle.wrap_optimizer(object())
    assert handle._default_scaler is not None  # refused: the handle's own scale_loss still works
    with pytest.raises(TypeError, match="AmpHandle.scale_loss: optimizer must be a torch.optim.Optimizer, got list"):
        with handle.scale_loss(torch.ones((), requires_grad=True), [raw]):
            pass
    assert handle._default_scaler.state.scale is None and not _o1_scale.is_armed(raw)


def test_handle_delegates_initialize_optimizers_to_amp_scale_loss(gen, make_handle):
    model = _model(gen, "cpu")
    x, y = _batch(gen, "cpu")
    ref = _reference_grads(model, x, y)  # before initialize wraps the forward (O0: inputs to fp32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale=128.0, verbosity=0)
    handle = make_handle()
    for h in (handle, amp.InitializeHandle()):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with h.scale_loss(loss, opt) as scaled:
            assert torch.equal(scaled, loss.float() * 128.0)  # initialize's scaler, not the handle's
            scaled.backward()
        assert all(rel_err(p.grad, r) < 1e-2 for p, r in zip(model.parameters(), ref))
    assert handle._default_scaler.state.scale is None and not _o1_scale.is_armed(opt)
    with pytest.raises(RuntimeError, match="amp.initialize"):
        handle.wrap_optimizer(opt)
    init_handle = amp.InitializeHandle()
    assert not init_handle.is_active()  # O0: no casts
    init_handle._deactivate(), init_handle._clear_cache()
    amp.initialize(_model(gen, "cpu"), opt_level="O1", verbosity=0)
    assert init_handle.is_active()
