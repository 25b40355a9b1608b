# mixprec.diagnostics: non-finite gradient reports from the check op's per-tensor flags, NaN loss
# vs transient overflow, the forward debug mode on a model rigged to overflow at a known layer,
# and the stuck-scale error, through amp and through mixprec.GradScaler.
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mixprec
from conftest import random_tensor
from mixprec import amp, diagnostics
from mixprec.optimizers import FusedAdam


class Amplify(nn.Module):
    """Multiplies by a factor that fits fp32 but not fp16 (65504): the rigged layer."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def rigged(gen, factor: float = 1e6) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), Amplify(factor)),
                          nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, scale=0.3))
    return model


@pytest.fixture(autouse=True)
def fresh_amp():
    yield
    amp._amp_state.__init__()  # the next test's initialize starts clean


def test_nonfinite_grads_names_exactly_the_bad_params(device, gen, rng):
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2)).to(device)
    model[1].double()  # a float64 layer: outside the op's dtypes, checked through torch
    extra = nn.Parameter(random_tensor((4, 6), torch.bfloat16, device, gen))
    named = list(model.named_parameters()) + [("extra", extra)]
    for _, p in named:
        p.grad = random_tensor(p.shape, p.dtype, device, gen)
    extra.grad = random_tensor((6, 4), torch.bfloat16, device, gen).t()  # non-contiguous
    assert diagnostics.nonfinite_grads(named) == []
    bad = set(rng.sample([n for n, _ in named], 3))
    for n, p in named:
        if n in bad:
            index = tuple(rng.randrange(s) for s in p.grad.shape)
            p.grad[index] = rng.choice([math.inf, -math.inf, math.nan])
    assert diagnostics.nonfinite_grads(named) == [n for n, _ in named if n in bad]
    assert diagnostics.nonfinite_grads(model) == [n for n, _ in model.named_parameters() if n in bad]


def test_nonfinite_grads_plain_list_and_missing_grads(gen):
    a, b, c = (nn.Parameter(random_tensor(3, torch.float16, "cpu", gen)) for _ in range(3))
    a.grad = torch.tensor([1.0, math.inf, 0.0], dtype=torch.float16)
    c.grad = torch.ones(3, dtype=torch.float16)  # b has no grad at all
    assert diagnostics.nonfinite_grads([a, b, c]) == ["param[0]"]


def test_classify_step():
    assert diagnostics.classify_step(torch.tensor(0.5), False) is None
    assert diagnostics.classify_step(torch.tensor(0.5), True) == diagnostics.OVERFLOW
    assert diagnostics.classify_step(torch.tensor(math.nan), True) == diagnostics.NAN_LOSS
    assert diagnostics.classify_step(math.inf, False) == diagnostics.NAN_LOSS
    assert diagnostics.classify_step(None, True) == diagnostics.OVERFLOW


def test_forward_debugger_names_the_rigged_layer(gen):
    model = rigged(gen).half()
    x = random_tensor((4, 8), torch.float16, "cpu", gen)
    with diagnostics.ForwardDebugger(model) as dbg:
        model(x)
        first = dbg.first
        assert first is not None and first.module == "2.1" and first.module_type == "Amplify"
        assert first.inputs_finite and first.num_inf + first.num_nan > 0 and first.dtype == "float16"
        dbg.reset()
        model.float()(x.float())  # fits fp32: nothing to report
        assert dbg.first is None
    with diagnostics.ForwardDebugger(model.half(), raise_error=True):
        with pytest.raises(diagnostics.NonFiniteForwardError, match=r"module '2\.1' \(Amplify\)"):
            model(x)
    model(x)  # hooks removed on leaving the with: no error any more


def test_forward_debugger_in_amp_o2(gen):
    model = rigged(gen)
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with diagnostics.ForwardDebugger(model) as dbg:
        out = model(random_tensor((4, 8), torch.float32, "cpu", gen))
    assert not torch.isfinite(out).all()
    assert dbg.first.module == "2.1"


def _train_steps(model, opt, batches, monitor):
    for x, y in batches:
        opt.zero_grad()
        loss = monitor.watch_loss(nn.functional.mse_loss(model(x), y))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def test_monitor_transient_overflow_names_the_param(gen):
    model = rigged(gen, factor=1.0)
    opt = FusedAdam(model.parameters(), lr=1e-3)
    # A modest scale, so that only the injected inf overflows.
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, max_loss_scale=2.0**6)
    calls = []

    def poison(grad):  # the gradient of one weight overflows at step 2 only
        calls.append(1)
        if len(calls) != 3:
            return grad
        grad = grad.clone()
        grad[1, 0] = math.inf
        return grad

    model[2][0].weight.register_hook(poison)
    batches = [(random_tensor((4, 8), torch.float32, "cpu", gen), random_tensor((4, 1), torch.float32, "cpu", gen))
               for _ in range(5)]
    with diagnostics.Monitor(model, patience=2) as monitor:
        _train_steps(model, opt, batches, monitor)
    assert monitor.updates == 5 and monitor.overflows == 1 and monitor.consecutive == 0
    (event,) = monitor.events
    assert event.step == 2 and event.kind == diagnostics.OVERFLOW and event.params == ["2.0.weight"]
    assert event.scale == 2.0**5 and math.isfinite(event.loss)
    assert amp.skipped_steps() == 1


def test_monitor_nan_loss_then_stuck_error(device, gen):
    model = rigged(gen).to(device)  # overflows in fp16 at every step: the loss is inf/NaN
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, min_loss_scale=2.0**14)
    batches = [(random_tensor((4, 8), torch.float32, device, gen), random_tensor((4, 1), torch.float32, device, gen))
               for _ in range(10)]
    monitor = diagnostics.Monitor(model, patience=3)
    with pytest.raises(diagnostics.LossScaleStuckError, match=r"last 3 updates.*floor 16384.*loss itself was NaN"):
        _train_steps(model, opt, batches, monitor)
    # Scale 2^16 -> 2^15 -> 2^14 (the floor): the third overflow in a row at the floor raises.
    assert monitor.updates == 3 and [e.kind for e in monitor.events] == [diagnostics.NAN_LOSS] * 3
    assert "2.0.weight" in monitor.events[0].params
    monitor.close()
    _train_steps(model, opt, batches[:2], monitor)  # detached: no error, no events
    assert monitor.updates == 3


def test_monitor_with_grad_scaler(gen):
    model = rigged(gen, factor=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8)
    x, y = random_tensor((4, 8), torch.float32, "cpu", gen), random_tensor((4, 1), torch.float32, "cpu", gen)
    with diagnostics.Monitor(model, scaler) as monitor:
        for step in range(3):
            opt.zero_grad()
            loss = monitor.watch_loss(nn.functional.mse_loss(model(x), y))
            scaler.scale(loss).backward()
            if step == 1:
                model[3].bias.grad.fill_(math.nan)
            scaler.step(opt)
            scaler.update()
    assert [(e.step, e.kind, e.params) for e in monitor.events] == [(1, diagnostics.OVERFLOW, ["3.bias"])]
    assert monitor.events[0].scale == 2.0**7


def test_monitor_bad_arguments(gen):
    model = rigged(gen)
    with pytest.raises(RuntimeError, match="amp is not initialized"):
        diagnostics.Monitor(model)
    with pytest.raises(TypeError, match="mixprec.GradScaler"):
        diagnostics.Monitor(model, scaler=object())
    with pytest.raises(ValueError, match="patience"):
        diagnostics.Monitor(model, mixprec.GradScaler("cpu"), patience=0)
