"""A user task for `mixprec compare`: point the command at your own model and data with
`--task examples/python/compare_task.py:make_task` (or `--task package.module:make_task`).

The entry point takes the device and returns a mixprec.cli.Task; the compare calls it once per
precision mode and loads the first call's initial weights into every later model, so each mode
starts from the same weights. Here: an MLP regressing a smooth function of its inputs, with
torch DataLoaders and R^2 on the validation set as the metric.

    mixprec compare --task examples/python/compare_task.py:make_task --modes O0,O2-bf16
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.cli import Task


def _data(n: int, gen: torch.Generator) -> TensorDataset:
    x = torch.randn(n, 16, generator=gen)
    y = torch.sin(x[:, :4]).sum(dim=1, keepdim=True) + 0.1 * x[:, 4:8].pow(2).sum(dim=1, keepdim=True)
    return TensorDataset(x, y)


def r_squared(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - SSE/SST: 1 is a perfect fit (higher is better)."""
    pred, target = pred.float(), target.float()
    return 1 - (pred - target).pow(2).sum() / (target - target.mean()).pow(2).sum()


def make_task(device: torch.device) -> Task:
    gen = torch.Generator().manual_seed(7)  # the data: the same on every call
    train, val = _data(4096, gen), _data(1024, gen)
    # The weights come from torch's global generator, which the compare seeds (--seed).
    model = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 1)).to(device)
    return Task(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        loss_fn=nn.functional.mse_loss,
        # A loader's shuffling also draws from the global generator: every mode sees the same order.
        train_loader=DataLoader(train, batch_size=128, shuffle=True),
        val_loader=DataLoader(val, batch_size=512),
        metric_fn=r_squared,
        metric_name="R^2",
        higher_is_better=True,
        name="example: MLP regression",
    )
