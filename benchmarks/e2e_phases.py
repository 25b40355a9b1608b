"""Where a training step's time goes, for e2e_gpt2.py: phase marks per step (CUDA events, or the
host clock on the CPU), synchronized phase runs that separate host launch time from device time,
and a torch.profiler pass that sums kernel time per phase and per kind of kernel."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

#: The phases every variant's step marks, in order (empty ones cost nothing: back-to-back marks).
#: loss_scale is what runs between the end of backward() and the optimizer: mixprec amp's check
#: and scale update at the exit of scale_loss; torch's scaler does its check inside step().
PHASES = ("forward", "backward", "loss_scale", "optimizer")


class PhaseClock:
    """Timestamps the phase boundaries of `n_steps` steps.

    On CUDA, one event per boundary on the current stream: with the host running ahead (no sync in
    the loop) the gaps are device time, launch stalls included. On the CPU, perf_counter (the CPU
    runs each op to completion). `sync=True` (profiling only) synchronizes after every phase and
    also records the host time to enqueue it, which tells a launch-bound phase (host time close
    to its wall time) from a device-bound one. `label=True` opens a record_function range named
    e2e::<phase> around each phase, for profiler traces.
    """

    def __init__(self, device: torch.device, n_steps: int, *, sync: bool = False, label: bool = False):
        self.cuda = device.type == "cuda"
        self.sync, self.label, self.n_steps = sync, label, n_steps
        n = len(PHASES) + 1
        self.events = ([[torch.cuda.Event(enable_timing=True) for _ in range(n)] for _ in range(n_steps)]
                       if self.cuda else None)
        self.host_marks = [[0.0] * n for _ in range(n_steps)]
        self.enqueue = [[0.0] * len(PHASES) for _ in range(n_steps)]
        self._range = None
        self._step, self._i = -1, len(PHASES)

    def _wait(self) -> None:
        if self.cuda and self.sync:
            torch.cuda.synchronize()

    def _open(self) -> None:
        if self.label:
            self._range = torch.profiler.record_function("e2e::" + PHASES[self._i])
            self._range.__enter__()

    def _close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def begin(self, step: int) -> None:
        if self._i != len(PHASES):
            raise RuntimeError(f"PhaseClock: step {self._step} ended after phase {PHASES[self._i - 1]!r}, "
                               f"before {PHASES[self._i]!r}: a step must mark every phase")
        self._wait()
        self._step, self._i = step, 0
        if self.cuda:
            self.events[step][0].record()
        self.host_marks[step][0] = time.perf_counter()
        self._open()

    def mark(self, phase: str) -> None:
        if self._i >= len(PHASES) or phase != PHASES[self._i]:
            expected = PHASES[self._i] if self._i < len(PHASES) else "begin()"
            raise RuntimeError(f"PhaseClock: mark({phase!r}) out of order; expected {expected!r}")
        s, i = self._step, self._i
        self.enqueue[s][i] = time.perf_counter() - self.host_marks[s][i]
        if self.cuda:
            self.events[s][i + 1].record()
        self._wait()
        self._close()  # after the sync, so the range covers every kernel of the phase
        self.host_marks[s][i + 1] = time.perf_counter()
        self._i += 1
        if self._i < len(PHASES):
            self._open()

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step_seconds(self, first: int = 0) -> list[float]:
        """Seconds per step for steps first..: from one step's begin to the next's, so the loop's
        own work between steps counts; the last step ends at its last mark (call finish() first)."""
        out = []
        for s in range(first, self.n_steps):
            last = s + 1 == self.n_steps
            if self.cuda:
                end = self.events[s][-1] if last else self.events[s + 1][0]
                out.append(self.events[s][0].elapsed_time(end) / 1e3)
            else:
                end = self.host_marks[s][-1] if last else self.host_marks[s + 1][0]
                out.append(end - self.host_marks[s][0])
        return out

    def phase_seconds(self, first: int = 0) -> list[list[float]]:
        """[step][phase] seconds for steps first.. (call finish() first)."""
        out = []
        for s in range(first, self.n_steps):
            if self.cuda:
                ev = self.events[s]
                out.append([ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(len(PHASES))])
            else:
                hm = self.host_marks[s]
                out.append([hm[i + 1] - hm[i] for i in range(len(PHASES))])
        return out


def medians(rows: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*rows)] if rows else []


# ---- kernels by kind -----------------------------------------------------------------------------

# First match wins; names are lower-cased kernel names (torch's, cuBLAS's, flash's, mixprec's).
_KINDS = (
    ("memcpy/memset", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("loss scaling", ("unscale", "non_finite", "nonfinite", "update_scale", "amp_update")),
    ("optimizer", ("adam", "increment_step")),
    ("matmul", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "sm90_", "sm80_", "splitk")),
    ("layernorm", ("layer_norm", "layernorm", "gammabeta")),  # GammaBetaBackward: LayerNorm's weight grads
    ("softmax/loss", ("softmax", "nll_loss", "cross_entropy")),
    ("embedding", ("embedding", "index", "scatter", "gather")),
    ("reduction", ("reduce",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in _KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise/other"


def _is_device_work(e) -> bool:
    """A kernel, copy or memset that ran on the GPU (not the GPU-side copy of a user range)."""
    if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
        return False
    return not (getattr(e, "is_user_annotation", False) or e.name.startswith("e2e::"))


def attribute(events, n_steps: int) -> dict:
    """Sums device time from profiler events (FunctionEvent-like: name, device_type, time_range)
    per phase, per kernel kind and per kernel, in ms per step. A kernel belongs to the phase whose
    host range (record_function e2e::<phase>, closed after a device sync, so it spans the phase's
    kernels) contains its midpoint; kernel and host times share the profiler's clock."""
    events = list(events)
    ranges = [(e.name[len("e2e::"):], e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith("e2e::") and getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU]
    busy = dict.fromkeys(PHASES, 0.0)
    busy["unattributed"] = 0.0
    kinds: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in events:
        if not _is_device_work(e):
            continue
        us = e.time_range.end - e.time_range.start
        mid = 0.5 * (e.time_range.start + e.time_range.end)
        phase = next((p for p, a, b in ranges if a <= mid <= b), "unattributed")
        busy[phase] += us
        kind = kernel_kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + us
        kernels[e.name] = kernels.get(e.name, 0.0) + us

    def per_step(us: float) -> float:
        return us / 1e3 / n_steps

    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return {"phase_busy_ms": {p: per_step(us) for p, us in busy.items()},
            "busy_ms": per_step(sum(busy.values())),
            "kinds_ms": {k: per_step(v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [(name[:110], per_step(us)) for name, us in top]}


def device_gaps(events, n_steps: int, top: int = 8) -> dict:
    """The device's idle time between its kernels (and copies) over an unsynchronized run of
    `n_steps` steps, in ms per step, with the largest gaps and the kernels on either side: where a
    GPU-bound loop still waits for the host. Overlapping kernels (other streams) count once."""
    work = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if _is_device_work(e))
    if not work:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "top_gaps": []}
    gaps = []
    busy = 0.0
    cur_start, cur_end, cur_name = work[0]
    for start, end, name in work[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    span = work[-1][1] - work[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {"span_ms": span / 1e3 / n_steps, "busy_ms": busy / 1e3 / n_steps,
            "idle_ms": (span - busy) / 1e3 / n_steps, "gaps_over_20us": sum(1 for g in gaps if g[0] > 20) / n_steps,
            "top_gaps": [(round(us, 1), before[:60], after[:60]) for us, before, after in gaps[:top]]}


def profile_steps(step: Callable[[int, PhaseClock], object], device: torch.device, first_step: int,
                  n_steps: int, trace_path: Optional[str] = None) -> dict:
    """Runs `n_steps` steps three times: twice with a device sync after every phase, once plain
    (host enqueue and wall time per phase) and once under torch.profiler (device busy time per
    phase, by kernel kind, top kernels); then once unsynced under torch.profiler (the device's idle
    gaps in the loop as timed: device_gaps). `step(i, clock)` runs training step i, marking the
    phases on `clock`.

    Per phase: wall (ms, synchronized), host (ms spent enqueueing: near wall means the host is
    the bottleneck), busy (ms of kernels), and idle = wall - busy (launch gaps, syncs, Python).
    """
    clock = PhaseClock(device, n_steps, sync=True)
    for i in range(n_steps):
        clock.begin(i)
        step(first_step + i, clock)
    clock.finish()
    walls = medians([[clock.host_marks[s][i + 1] - clock.host_marks[s][i] for i in range(len(PHASES))]
                     for s in range(n_steps)])
    hosts = medians(clock.enqueue)
    result = {"phases": {p: {"wall_ms": w * 1e3, "host_ms": h * 1e3} for p, w, h in zip(PHASES, walls, hosts)},
              "steps": n_steps}
    if device.type != "cuda":
        return result  # kernel times exist only on the GPU; the CPU's wall is its busy time

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    labelled = PhaseClock(device, n_steps, sync=True, label=True)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(n_steps):
            labelled.begin(i)
            step(first_step + n_steps + i, labelled)
        labelled.finish()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    summary = attribute(prof.events(), n_steps)
    # The loop as timed (no syncs): what the device waits for between kernels. The profiler's own
    # per-launch cost inflates host-bound gaps a little; compare variants within one run.
    free = PhaseClock(device, n_steps)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(n_steps):
            free.begin(i)
            step(first_step + 2 * n_steps + i, free)
        free.finish()
    result["unsynced"] = device_gaps(prof.events(), n_steps)
    result["unsynced"]["step_ms"] = statistics.median(free.step_seconds()) * 1e3
    for p in PHASES:
        ph = result["phases"][p]
        ph["busy_ms"] = summary["phase_busy_ms"][p]
        ph["idle_ms"] = max(ph["wall_ms"] - ph["busy_ms"], 0.0)
    result["unattributed_busy_ms"] = summary["phase_busy_ms"]["unattributed"]
    result.update({k: summary[k] for k in ("busy_ms", "kinds_ms", "top_kernels_ms")})
    return result
