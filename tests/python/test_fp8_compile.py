# mixprec.fp8 under torch.compile (CPU emulation; the cuda case runs torch._scaled_mm): an
# Fp8Linear and a small model under amp O2 fp8=True compile with fullgraph=True (no graph break)
# and give eager's outputs, gradients and scaling state, step after step.
from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_tensor

from mixprec import amp, fp8

STEPS = 3


def _compare_steps(eager, compiled, module, eager_module, inputs, exact):
    """Runs both for each input; outputs, input and parameter grads and the FP8 state must agree."""
    check = torch.testing.assert_close if not exact else (lambda a, b, **_: torch.testing.assert_close(
        a, b, rtol=0, atol=0, equal_nan=True))
    for step, x in enumerate(inputs):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(xa), compiled(xb)
        check(yb, ya, msg=lambda m: f"step {step} output: {m}")
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        check(xb.grad, xa.grad, msg=lambda m: f"step {step} input grad: {m}")
        for (name, pa), pb in zip(eager_module.named_parameters(), module.parameters()):
            check(pb.grad, pa.grad, msg=lambda m: f"step {step} {name}.grad: {m}")
        states = [(m.fp8_state, n) for n, m in module.named_modules() if isinstance(m, fp8.Fp8Linear)]
        eager_states = [m.fp8_state for m in eager_module.modules() if isinstance(m, fp8.Fp8Linear)]
        assert states and len(states) == len(eager_states)
        for (sb, name), sa in zip(states, eager_states):
            for key, value in sa.state_dict().items():
                # The state is mutated in place by the compiled graph: it must have landed.
                torch.testing.assert_close(sb.state_dict()[key], value, rtol=0, atol=0,
                                           msg=lambda m: f"step {step} {name}.{key}: {m}")


@pytest.mark.parametrize("backend", ("aot_eager", "inductor"))
@pytest.mark.parametrize("scaling", ("current", "delayed"))
def test_fp8_linear_compiles_fullgraph_with_eager_values(device, scaling, backend, gen):
    layer = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, 0.2))
    layer = fp8.Fp8Linear.from_linear(layer.to(device), fp8.Fp8Recipe(scaling=scaling))
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    inputs = [random_tensor((2, 16, 64), torch.float32, device, gen, 2.0 ** step) for step in range(STEPS)]
    # aot_eager runs eager's kernels: bit for bit. Inductor generates its own code for the
    # element-wise tail (dequantize, bias, cast); rounding may differ there, hence its tolerance.
    _compare_steps(eager, compiled, layer, eager, inputs, exact=backend == "aot_eager")


def test_amp_fp8_model_compiles_fullgraph_with_eager_values(device, gen):
    def build():
        torch.manual_seed(gen.initial_seed())
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", fp8=True, verbosity=0)
        return model, opt

    eager_model, _ = build()
    eager_layers = [m for m in eager_model.modules() if isinstance(m, fp8.Fp8Linear)]
    # amp keeps one set of state per initialize: the second model is a deep copy, not a second call.
    model = copy.deepcopy(eager_model)
    assert len([m for m in model.modules() if isinstance(m, fp8.Fp8Linear)]) == len(eager_layers) == 2
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    inputs = [random_tensor((16, 32), torch.bfloat16, device, gen) for _ in range(STEPS)]
    _compare_steps(eager_model, compiled, model, eager_model, inputs, exact=True)
