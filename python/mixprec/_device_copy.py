"""Copies of small tensors (scales, found_inf flags, norms) between devices, without a host sync
wherever that is safe."""

from __future__ import annotations

from typing import Optional

import torch


def to_device(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None, *,
              copy: bool = False) -> torch.Tensor:
    """`t` on `device` (and `dtype`). A copy to an accelerator is queued on its stream (non-blocking:
    its kernels run after the copy); a copy to the CPU blocks: CPU kernels read their inputs at
    once, and torch puts a non-blocking device-to-CPU copy into pinned memory still in flight, so a
    CPU group beside GPU ones would read a stale scale or flag."""
    device = torch.device(device)
    return t.to(device=device, dtype=dtype, non_blocking=device.type != "cpu", copy=copy)
