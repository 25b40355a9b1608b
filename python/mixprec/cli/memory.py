"""Peak memory of one mode: the CUDA caching allocator's peak on a GPU; on a CPU the growth of
the process's peak resident set (Linux VmHWM, reset per mode through /proc/self/clear_refs)
over its size when the mode started, after freed heap memory was handed back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Optional

import torch

_MB = 2.0**20
CUDA_KIND = "cuda allocator peak"
# On a CPU the figure is mostly the allocator's and the heap's behaviour, not the mode's: it is
# kept in report.json but not compared (no "memory saved" from it).
CPU_KIND = "cpu peak resident-set growth"


def _status_kb(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "reset the peak resident set size" (Linux 4.0+)
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    # glibc keeps freed small blocks in the process; without this a later mode would reuse the
    # previous mode's pages and look smaller than it is.
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


class MemoryMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.kind = CUDA_KIND if self.cuda else CPU_KIND
        self.base_kb: Optional[int] = None
        self.resettable = False

    def start(self) -> None:
        _trim_heap()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.resettable = _reset_peak_rss()
            self.base_kb = _status_kb("VmRSS")

    def current_mb(self) -> Optional[float]:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) / _MB
        rss = _status_kb("VmRSS")
        return None if rss is None or self.base_kb is None else (rss - self.base_kb) / 1024.0

    def peak(self) -> tuple[Optional[float], Optional[float]]:
        """(peak figure in MiB, peak resident set in MiB or None on a GPU)."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / _MB, None
        hwm = _status_kb("VmHWM")
        if hwm is None or self.base_kb is None or not self.resettable:
            return None, None if hwm is None else hwm / 1024.0
        return max(0, hwm - self.base_kb) / 1024.0, hwm / 1024.0
