"""The lean modes of `mixprec compare`: whether a task and device can take one; optimizer state bytes per param."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..optimizers import FusedAdam, FusedOptimizer
from .modes import Mode
from .task import Task


class ModeSkipped(Exception):
    """This mode cannot run here (this task's optimizer, this device); the message says why."""


# Compute capability of the first GPUs with FP8 tensor cores (Ada, Hopper): torch._scaled_mm.
FP8_MIN_CAPABILITY = (8, 9)
FP8_EMULATED = ("emulated: on a CPU FP8 is fp32 matmuls on FP8-rounded operands, so its time and memory say "
                "nothing about FP8 hardware (its accuracy does)")


def lean_options(mode: Mode, task: Task, device: torch.device, seed: int) -> dict:
    """amp.initialize's extra arguments for a lean variant, after checking it can run; raises
    ModeSkipped with the reason when this task's optimizer or this device cannot take it."""
    if mode.variant == "fp8":
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise ModeSkipped(f"{torch.cuda.get_device_name(device)} (compute capability {cap}) has no FP8 tensor "
                              f"cores; FP8 needs {'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer")
        return {"fp8": True}
    if not mode.variant:
        return {}
    if not isinstance(task.optimizer, FusedOptimizer):
        option = "master_weights='remainder'" if mode.variant.startswith("rem") else "rounding='stochastic'"
        raise ModeSkipped(f"{option} is an option of mixprec's fused optimizers; this task's optimizer is "
                          f"{type(task.optimizer).__name__}")
    if mode.variant == "rem-q8":
        if not isinstance(task.optimizer, FusedAdam):
            raise ModeSkipped(f"state_dtype=torch.int8 (8-bit moments) is an option of mixprec's FusedAdam; this "
                              f"task's optimizer is {type(task.optimizer).__name__}")
        # Before the first step: no moments exist yet, so they are made 8-bit from the start.
        task.optimizer.state_dtype = torch.int8
        return {"master_weights": "remainder"}
    if mode.variant == "rem":
        return {"master_weights": "remainder"}
    for group in task.optimizer.param_groups:  # pure bf16 (O3 keeps no masters), rounded stochastically
        group.update(rounding="stochastic", seed=seed)
    return {}


def state_bytes(optimizer: Any) -> tuple[Optional[float], Optional[float]]:
    """(all optimizer state, master weights alone) in bytes per parameter, counted from the
    tensors the optimizer keeps (element size x count: exact). The master is ``master_param``
    (fp32) or ``master_remainder`` (int16). 8-bit Adam moments count their codes (1 + 1 bytes)
    and their float32 scales (8 bytes per 256 elements, more on tensors that end in a partial
    block). None when there are no parameters or no state."""
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]
    n = sum(p.numel() for p in params)
    state = getattr(optimizer, "state", {})
    if not n or not any(p in state for p in params):
        return None, None
    total = master = 0
    for p in params:
        for key, value in state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                size = value.numel() * value.element_size()
                total += size
                master += size if key in ("master_param", "master_remainder") else 0
    return total / n, master / n
