# Tasks for the `mixprec compare` tests, loaded through --task as a file: a tiny classifier, one
# rigged to overflow in fp16 at a known layer, one that runs out of memory under low precision,
# one whose op has no low-precision kernel, one autocast leaves in fp32, one with an optimizer
# torch.optim lacks, and malformed ones.
from __future__ import annotations

import torch
from torch import nn

from mixprec.cli import Task


def _batches(n_batches: int, seed: int, batch: int = 16):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randn(batch, 8, generator=gen)
        out.append((x, (x[:, 0] > 0).long()))
    return out


def _task(model: nn.Module, device, name: str) -> Task:
    model = model.to(device)
    return Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                loss_fn=nn.functional.cross_entropy, train_loader=_batches(4, 1), val_loader=_batches(2, 2),
                metric_fn=lambda out, y: (out.argmax(-1) == y).float().mean(), metric_name="accuracy", name=name)


def tiny_task(device):
    return _task(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), device, "tiny")


def tuple_task(device):
    t = tiny_task(device)
    return t.model, t.optimizer, t.loss_fn, t.train_loader, t.val_loader  # no metric: the loss judges


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def rigged_task(device):
    # x * 1e6 fits fp32 and is undone at once, but overflows fp16 (65504) at module '1.1'.
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), Scale(1e6), Scale(1e-6)), nn.Linear(16, 2))
    return _task(model, device, "rigged")


class _LowPrecisionOnly(nn.Module):
    """Raises what torch raises when an allocation fails or a kernel is missing, but only when
    running in low precision (its weight cast by O2/O3, or under autocast for O1)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.error = error

    def forward(self, x):
        if self.lin.weight.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type):
            raise self.error
        return self.lin(x)


def oom_task(device):
    err = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 4398046511104 bytes.\nmore detail on a second line")
    return _task(_LowPrecisionOnly(err), device, "oom")


def oom_everywhere_task(device):
    return _task(nn.Sequential(nn.Linear(8, 2), _Huge()), device, "oom everywhere")


class _Huge(nn.Module):
    def forward(self, x):
        return x + torch.empty(2**40, dtype=torch.float32)[:1]  # a real failed allocation (4 TiB)


def no_kernel_task(device):
    return _task(_LowPrecisionOnly(NotImplementedError('"addmm_impl_cpu_" not implemented for \'Half\'')), device,
                 "no kernel")


def returns_garbage(device):
    return 42


def missing_loader(device):
    t = tiny_task(device)
    return {"model": t.model, "optimizer": t.optimizer, "loss_fn": t.loss_fn, "train_loader": t.train_loader}


def interrupt_task(device):
    return _task(_LowPrecisionOnly(KeyboardInterrupt()), device, "Ctrl-C in low precision")


class _Affine(nn.Module):
    """Element-wise only: torch.autocast casts none of it, so a torch.amp mode computes in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 8))
        self.b = nn.Parameter(torch.randn(2))

    def forward(self, x):
        return (x[:, None, :] * self.w).sum(-1) + self.b


def elementwise_task(device):
    return _task(_Affine(), device, "autocast-neutral")


def lamb_task(device):
    from mixprec.optimizers import FusedLAMB

    t = tiny_task(device)
    t.optimizer = FusedLAMB(t.model.parameters(), lr=1e-2)
    return t


class _Fp16GradOverflow(torch.autograd.Function):
    """Identity forward; backward makes every float16 gradient inf: gradients that overflow at any
    loss scale while the loss stays finite (what drives a dynamic scale down to its floor)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf") if grad.dtype == torch.float16 else grad


class _OverflowGrad(nn.Module):
    def forward(self, x):
        return _Fp16GradOverflow.apply(x)


def grad_overflow_task(device):
    return _task(nn.Sequential(nn.Linear(8, 16), _OverflowGrad(), nn.ReLU(), nn.Linear(16, 2)), device,
                 "fp16 gradients overflow")
