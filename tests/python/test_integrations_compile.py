# torch.compile of an amp model on the CPU (inductor): under O1 and O2 the compiled model is one graph
# (fullgraph) and trains as the eager one, an overflowing step included; a compiled whole step too.
from __future__ import annotations

import pytest
import torch

from mixprec import amp
from test_integrations_support import make_optimizer, tiny_data

F = torch.nn.functional
STEPS = 8
INJECT = 3  # this step's input holds an inf: the loss is NaN, the step skipped, the scale halved

# Tolerance: inductor may keep a fused chain's intermediates in fp32 where eager rounds each op's
# output to the low dtype; one such rounding is at most half an ulp (2**-11 of the value in fp16,
# 2**-8 in bf16). Allow four of them in the fp32 loss after STEPS small Adam steps. (Measured on
# torch 2.13 CPU: the losses agree exactly, since the GEMMs and mixprec's ops are opaque to inductor.)
RTOL = {torch.float16: 4 * 2.0 ** -11, torch.bfloat16: 4 * 2.0 ** -8}


def net() -> torch.nn.Module:
    """Linear, LayerNorm (mixprec's layer_norm op under O2), GELU, Linear."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 2))


def train(opt_level: str, dtype: torch.dtype, compile_mode: str):
    model = net()
    model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), opt_level=opt_level, dtype=dtype,
                                      loss_scale="dynamic", verbosity=0)
    # fullgraph: the whole forward (amp's casts or autocast, mixprec's ops) is one graph, or an error.
    forward = torch.compile(model, fullgraph=True) if compile_mode == "model" else model

    def step(x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        return loss

    if compile_mode == "step":  # Dynamo breaks the graph around zero_grad, amp's bookkeeping and step
        step = torch.compile(step)
    losses = []
    for i, (x, y) in enumerate((tiny_data() * 2)[:STEPS]):
        if i == INJECT:
            x = x.clone()
            x[0, 0] = float("inf")
        losses.append(step(x, y).item())
    return losses, amp.skipped_steps(), amp.loss_scale(), [p.detach().float() for p in model.parameters()]


def check_like_eager(opt_level, dtype, compile_mode, rtol):
    torch._dynamo.reset()
    eager_losses, eager_skipped, eager_scale, eager_params = train(opt_level, dtype, "eager")
    losses, skipped, scale, params = train(opt_level, dtype, compile_mode)
    assert skipped == eager_skipped == 1 and scale == eager_scale == 2.0 ** 15
    assert losses[INJECT] != losses[INJECT] and eager_losses[INJECT] != eager_losses[INJECT]  # NaN both
    del losses[INJECT], eager_losses[INJECT]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=rtol, atol=0)
    assert eager_losses[-1] < eager_losses[0]
    for p, e in zip(params, eager_params):
        torch.testing.assert_close(p, e, rtol=rtol, atol=rtol * float(e.abs().max()))


@pytest.mark.parametrize("opt_level,dtype", [("O1", torch.float16), ("O2", torch.float16), ("O2", torch.bfloat16)],
                         ids=["O1-fp16", "O2-fp16", "O2-bf16"])
def test_compiled_model_trains_like_eager(opt_level, dtype):
    check_like_eager(opt_level, dtype, "model", RTOL[dtype])


def test_compiled_whole_step_trains_like_eager():
    # The loss is computed inside the compiled region too: fp32 math that inductor may reorder.
    check_like_eager("O2", torch.float16, "step", RTOL[torch.float16])
