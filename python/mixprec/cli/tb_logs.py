"""Optional TensorBoard logs for `mixprec compare`: a fresh run folder per invocation holding one
run per mode (loss, loss scale, skipped steps, step time and memory per step, validation figures
per epoch) and the comparison itself in the HParams view (one row per mode)."""

from __future__ import annotations

import datetime
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


def new_run_dir(root: str, now: Optional[datetime.datetime] = None) -> str:
    """``root/<YYYYmmdd-HHMMSS>``, created empty, with ``-2``, ``-3``... when that second is taken:
    each invocation gets its own folder, so runs never append into an earlier one's curves."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    os.makedirs(root, exist_ok=True)
    path, n = os.path.join(root, stamp), 1
    while True:
        try:
            os.mkdir(path)  # atomic: two invocations in the same second get different folders
            return path
        except FileExistsError:
            n += 1
            path = os.path.join(root, f"{stamp}-{n}")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class TensorBoardSink:
    """The runner's sink for one mode: scalars go to ``<run_dir>/<mode>``."""

    def __init__(self, run_dir: str, mode: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, mode))

    def _add(self, scalars: dict, step: int) -> None:
        for tag, value in scalars.items():
            if _finite(value):  # a NaN point would hide the whole curve
                self.writer.add_scalar(tag, value, step)

    def on_step(self, step: int, scalars: dict) -> None:
        self._add(scalars, step)

    def on_epoch(self, epoch: int, scalars: dict) -> None:
        self._add(scalars, epoch)

    def add_result(self, result, all_modes: list[str]) -> None:
        """The mode's row in the HParams view: what it is (mode, opt level, dtype, optimizer,
        status) and its figures (written into this mode's own run, so each mode is one run)."""
        hparams = {"mode": result.mode, "opt_level": result.opt_level, "dtype": result.dtype,
                   "optimizer": result.optimizer or "", "status": result.status,
                   "emulated": "yes" if result.emulated else "no"}  # torch logs a bool as 0.0/1.0
        from .memory import CPU_KIND

        memory = result.memory_kind != CPU_KIND  # on a CPU the figure is noise (see memory.py)
        figures = {"time_per_epoch_s": result.time_per_epoch, "speedup": result.speedup,
                   "peak_memory_mb": result.peak_memory_mb if memory else None, "memory_saving": result.memory_saving,
                   "val_loss": result.val_loss, "val_metric": result.val_metric,
                   "skipped_fraction": result.skipped_steps / result.steps if result.steps else None,
                   "final_loss_scale": result.final_loss_scale,
                   "state_bytes_per_param": result.state_bytes_per_param,
                   "master_bytes_per_param": result.master_bytes_per_param}
        metrics = {f"hparam/{k}": v for k, v in figures.items() if _finite(v)}
        self.writer.add_hparams(hparams, metrics, hparam_domain_discrete={"mode": list(all_modes)}, run_name=".")

    def close(self) -> None:
        self.writer.close()
