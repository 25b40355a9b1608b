# A whole amp O2 training step (forward, scale_loss's backward, check and scale update, FusedAdam's
# step on fp32 masters) captured in one CUDA graph and replayed must train exactly as the same
# steps run eagerly, an overflow's skip and a learning-rate schedule included. That holds only if
# nothing in the step waits for the host or keeps per-step state there, which is what mixprec's
# amp and optimizers promise (benchmarks/e2e_gpt2.py's *-graph variants rely on it).
from __future__ import annotations

import math

import pytest
import torch

from mixprec import amp
from mixprec.optimizers import FusedAdam

STEPS = 8
WARMUP = 2  # eager steps before the capture, off the default stream
OVERFLOW_STEP = 5  # a batch with an inf: the step must be skipped and the scale halved


def _batches(device):
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(STEPS):
        x = torch.randn(32, 16, generator=g)
        if i == OVERFLOW_STEP:
            x[3, 7] = math.inf
        out.append((x.to(device), torch.randn(32, 4, generator=g).to(device)))
    return out


def _lr(step: int) -> float:
    return 1e-2 * (step + 1) / STEPS  # changes every step: the graph must read it from the device


def _train(dtype: torch.dtype, graphed: bool) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 4)).to(device)
    opt = FusedAdam(model.parameters(), lr=_lr(0), weight_decay=0.01, adam_w_mode=True)
    # Dynamic scaling in bf16 too (its default is a static 1.0): the skip and the halving run.
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, loss_scale="dynamic", verbosity=0)
    for group in opt.param_groups:
        group["lr"] = torch.tensor(_lr(0), device=device)
    initial = [p.detach().float().clone() for p in model.parameters()]

    def body(x, y):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss.detach()

    losses, scales = [], []
    graph, static = None, None
    for i, (x, y) in enumerate(_batches(device)):
        for group in opt.param_groups:
            group["lr"].fill_(_lr(i))
        if not graphed or i < WARMUP:
            side = torch.cuda.Stream() if graphed else torch.cuda.current_stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if graphed and i == WARMUP - 1:
                    torch.cuda.set_sync_debug_mode("error")  # lazy state is made: nothing may sync now
                try:
                    loss = body(x, y)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                opt.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(side)
        else:
            if graph is None:
                static = (x.clone(), y.clone())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_loss = body(*static)
            static[0].copy_(x)
            static[1].copy_(y)
            graph.replay()
            loss = static_loss.clone()
        losses.append(float(loss))
        scales.append(amp.loss_scale())
    return {"losses": losses, "scales": scales, "masters": [m.detach().clone() for m in amp.master_params(opt)],
            "params": [p.detach().clone() for p in model.parameters()], "initial": initial,
            "step": float(opt.param_groups[0]["step"])}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_o2_step_replayed_from_a_cuda_graph_trains_as_eager(dtype):
    eager = _train(dtype, graphed=False)
    replayed = _train(dtype, graphed=True)
    # The overflow was seen and skipped by both: the loss is not finite there, the scale halved,
    # one update fewer than steps.
    assert not math.isfinite(eager["losses"][OVERFLOW_STEP]) and not math.isfinite(replayed["losses"][OVERFLOW_STEP])
    assert replayed["scales"] == eager["scales"]
    assert eager["scales"][OVERFLOW_STEP] == eager["scales"][OVERFLOW_STEP - 1] / 2
    assert replayed["step"] == eager["step"] == STEPS - 1
    finite = [i for i in range(STEPS) if i != OVERFLOW_STEP]
    torch.testing.assert_close([replayed["losses"][i] for i in finite], [eager["losses"][i] for i in finite],
                               rtol=1e-4, atol=1e-6)
    moved = max(float((m.float() - p0).abs().max()) for m, p0 in zip(eager["masters"], eager["initial"]))
    assert moved > 1e-2  # the lr schedule took the weights far beyond the tolerance below
    for i, (got, want) in enumerate(zip(replayed["masters"], eager["masters"])):
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), i
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"master {i}: {m}")
    for i, (got, want) in enumerate(zip(replayed["params"], eager["params"])):
        assert got.dtype == dtype, i
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3, msg=lambda m, i=i: f"param {i}: {m}")
