"""Optional TensorBoard logs for `mixprec compare`: one run directory per mode with loss, loss
scale, skipped steps, step time and memory per step, and validation figures per epoch."""

from __future__ import annotations

import math
import os
from typing import Optional


def check_available() -> Optional[str]:
    """None when TensorBoard logs can be written, else the one-line reason."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        return f"--tensorboard needs the tensorboard package (pip install tensorboard): {e}"
    return None


class TensorBoardSink:
    """The runner's sink for one mode: scalars go to ``<root>/<mode>``."""

    def __init__(self, root: str, mode: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(root, mode))

    def _add(self, scalars: dict, step: int) -> None:
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):  # a NaN point would hide the whole curve
                self.writer.add_scalar(tag, value, step)

    def on_step(self, step: int, scalars: dict) -> None:
        self._add(scalars, step)

    def on_epoch(self, epoch: int, scalars: dict) -> None:
        self._add(scalars, epoch)

    def close(self) -> None:
        self.writer.close()
