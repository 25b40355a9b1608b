# Shared pieces of the integration tests (Lightning, accelerate, Hugging Face, torch.compile): a tiny
# task, the hand-written amp loop each framework's run must reproduce bit for bit, and state snapshots.
from __future__ import annotations

import torch

from conftest import assert_bitwise_equal
from mixprec import amp
from mixprec.optimizers import FusedAdam

LR = 1e-2
CLIP = 0.05  # small enough that clipping acts on most steps of the tiny task (checked where it matters)


def tiny_data(n: int = 64, batch: int = 16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A separable two-class problem: losses fall within a few steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def tiny_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def make_optimizer(params) -> FusedAdam:
    return FusedAdam(params, lr=LR, weight_decay=0.01)


def reference_run(model: torch.nn.Module, batches, epochs: int, opt_level: str = "O2",
                  dtype: torch.dtype = torch.float16, clip: float = 0.0, **amp_kwargs):
    """What every integration must do, written out with amp directly; returns the model, the
    optimizer, the losses and the gradient norms seen before clipping."""
    optimizer = make_optimizer(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0, **amp_kwargs)
    losses, norms = [], []
    for _ in range(epochs):
        for x, y in batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), clip)))
            optimizer.step()
            losses.append(loss.item())
    return model, optimizer, losses, norms


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every parameter, buffer and optimizer state tensor (masters, moments, step), cloned."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        for k, v in optimizer.state.get(p, {}).items():
            out[f"state.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def assert_same(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert_bitwise_equal(x, y, f"{what}: {k}")
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"


def assert_o2_layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """O2 for real: every model param low precision, an fp32 master per param equal to it rounded."""
    params = list(model.parameters())
    assert params and all(p.dtype == dtype for p in params), {p.dtype for p in params}
    for p in params:
        master = optimizer.state[p]["master_param"]
        assert master.dtype == torch.float32 and master.shape == p.shape
        assert torch.equal(master.to(dtype), p.detach())
