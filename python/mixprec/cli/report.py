"""Results of `mixprec compare`: one ModeResult per mode, the figures against O0, the
recommendation (the fastest mode whose validation metric stays within a tolerance of O0's, with
the reason each other mode was not chosen), the printed table (100 columns at most; every
figure is in report.json) and report.json."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .memory import CPU_KIND
from .modes import BASELINE, all_modes

OK, DIVERGED, FAILED, OOM, NOT_RUN = "ok", "diverged", "failed", "out of memory", "not run"
SKIPPED = "skipped"  # the mode does not apply to this task or device (``error`` says why)


@dataclass
class ModeResult:
    """Every figure measured for one mode. Times exclude validation; ``time_per_epoch`` is the
    mean over epochs after the first (warm-up) when there are several. ``peak_memory_mb``: the
    CUDA allocator's peak, or on a CPU the growth of the process's peak resident set over its
    size when the mode started (``memory_kind`` says which; ``memory_saving`` only on a GPU).
    ``optimizer``: the optimizer class the mode stepped with. ``state_bytes_per_param``: the
    optimizer's state tensors after training in bytes per parameter (exact), of which
    ``master_bytes_per_param`` are master weights. ``emulated``: the mode ran an emulation
    (FP8 on a CPU), ``note`` says what that means; it is not recommended."""

    mode: str
    opt_level: str
    dtype: str
    status: str = NOT_RUN
    error: Optional[str] = None
    epochs: int = 0
    steps: int = 0
    samples: int = 0
    epoch_times: list = field(default_factory=list)
    time_per_epoch: Optional[float] = None
    samples_per_s: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    peak_rss_mb: Optional[float] = None
    memory_kind: str = ""
    optimizer: Optional[str] = None
    state_bytes_per_param: Optional[float] = None
    master_bytes_per_param: Optional[float] = None
    fp8_linears: Optional[int] = None  # the FP8 mode's nn.Linears in FP8
    fp8_fallbacks: Optional[int] = None  # their calls that ran plain F.linear (token count not a multiple of 16)
    emulated: bool = False
    note: Optional[str] = None
    train_loss: Optional[float] = None
    train_metric: Optional[float] = None
    val_loss: Optional[float] = None
    val_metric: Optional[float] = None
    skipped_steps: int = 0
    nan_loss_steps: int = 0
    final_loss_scale: Optional[float] = None
    loss_curve: list = field(default_factory=list)
    scale_curve: list = field(default_factory=list)
    step_time_ms: list = field(default_factory=list)
    val_loss_curve: list = field(default_factory=list)
    val_metric_curve: list = field(default_factory=list)
    overflow_events: list = field(default_factory=list)
    nonfinite_params: list = field(default_factory=list)
    first_nonfinite_module: Optional[str] = None
    speedup: Optional[float] = None
    memory_saving: Optional[float] = None


@dataclass
class Recommendation:
    mode: Optional[str]
    reasons: dict = field(default_factory=dict)  # mode -> why chosen / why not
    rule: str = ""
    candidates: list = field(default_factory=list)  # the modes that qualified, O0 first
    versus_torch: str = ""  # the answer to "should I switch from torch.amp?" (verdict.py)
    switch: Optional[bool] = None  # True: a mixprec mode beats torch.amp; None: no verdict


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def memory_comparable(results: list[ModeResult]) -> bool:
    """Whether the peak-memory figures say something about the modes (not on a CPU)."""
    return not any(r.memory_kind == CPU_KIND for r in results)


def add_relative_figures(results: list[ModeResult]) -> None:
    """Speed-up (O0's time per epoch / the mode's) and memory saving (1 - peak / O0's peak; only
    where memory is comparable)."""
    base = next((r for r in results if r.mode == BASELINE and r.status in (OK, DIVERGED)), None)
    memory = memory_comparable(results)
    for r in results:
        r.speedup = r.memory_saving = None
        if base is None:
            continue
        if _finite(base.time_per_epoch) and _finite(r.time_per_epoch) and r.time_per_epoch > 0:
            r.speedup = base.time_per_epoch / r.time_per_epoch
        if memory and _finite(base.peak_memory_mb) and _finite(r.peak_memory_mb) and base.peak_memory_mb > 0:
            r.memory_saving = 1.0 - r.peak_memory_mb / base.peak_memory_mb


def within_tolerance(metric: float, baseline: float, tolerance: float, higher_is_better: bool) -> bool:
    """No worse than the baseline by more than ``tolerance`` x |baseline| (better is always fine)."""
    margin = tolerance * abs(baseline)
    return metric >= baseline - margin if higher_is_better else metric <= baseline + margin


def recommend(results: list[ModeResult], tolerance: float = 0.02, max_skipped: float = 0.05,
              higher_is_better: bool = True, metric_name: str = "metric") -> Recommendation:
    """The fastest mode (time per epoch) among O0 and every mode that finished, has a finite
    validation metric within ``tolerance`` (relative) of O0's, and skipped at most
    ``max_skipped`` of its steps; every other mode gets the reason it was not chosen."""
    rule = (f"fastest mode whose validation {metric_name} is within {tolerance:.1%} of O0's and that skipped at "
            f"most {max_skipped:.0%} of its steps")
    reasons: dict[str, str] = {}
    base = next((r for r in results if r.mode == BASELINE), None)
    if base is None or base.status != OK or not _finite(base.val_metric):
        why = "O0 was not run" if base is None else (base.error or f"O0 {base.status}") if base.status != OK \
            else f"O0's validation {metric_name} is not finite"
        for r in results:
            reasons[r.mode] = f"no baseline to compare against: {why}"
        return Recommendation(None, reasons, rule)
    candidates = [base]
    for r in results:
        if r is base:
            continue
        if r.status == OOM:
            reasons[r.mode] = f"out of memory: {r.error}"
        elif r.status == SKIPPED:
            reasons[r.mode] = f"skipped: {r.error}"
        elif r.status == FAILED or r.status == NOT_RUN:
            reasons[r.mode] = f"failed: {r.error}" if r.error else r.status
        elif r.status == DIVERGED:
            reasons[r.mode] = f"diverged: {r.error}" if r.error else "diverged"
        elif r.emulated:
            reasons[r.mode] = f"not a candidate: {r.note}"
        elif not _finite(r.val_metric) or not _finite(r.val_loss):
            reasons[r.mode] = "NaN: non-finite validation loss or metric"
        elif r.steps and r.skipped_steps / r.steps > max_skipped:
            reasons[r.mode] = (f"too many skipped steps: {r.skipped_steps} of {r.steps} "
                               f"({r.skipped_steps / r.steps:.0%} > {max_skipped:.0%})")
        elif not within_tolerance(r.val_metric, base.val_metric, tolerance, higher_is_better):
            reasons[r.mode] = (f"validation {metric_name} {r.val_metric:.4g} vs O0's {base.val_metric:.4g}: outside "
                               f"the {tolerance:.1%} tolerance")
        elif not _finite(r.time_per_epoch):
            reasons[r.mode] = "no time measured"
        else:
            candidates.append(r)
    best = min(candidates, key=lambda r: r.time_per_epoch if _finite(r.time_per_epoch) else math.inf)
    for r in candidates:
        if r is best:
            reasons[r.mode] = ("chosen: no other mode was faster within tolerance" if r is base else
                               f"chosen: {r.speedup or 0:.2f}x O0's speed, validation {metric_name} "
                               f"{r.val_metric:.4g} vs O0's {base.val_metric:.4g}")
        else:
            reasons[r.mode] = (f"slower: {r.time_per_epoch:.3g} s/epoch vs {best.mode}'s "
                               f"{best.time_per_epoch:.3g} s/epoch")
    return Recommendation(best.mode, reasons, rule, [r.mode for r in candidates])


# -- output -------------------------------------------------------------------------------------------
def _fmt(x: Any, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return format(x, spec)


_STATUS_SHORT = {OOM: "OOM"}


def _percent(part: int, whole: int) -> str:
    if not whole:
        return "-"
    share = 100.0 * part / whole
    return "<1%" if 0 < share < 1 else f"{share:.0f}%"


def _scale(x: Optional[float]) -> str:
    """A loss scale as ``2^16`` when it is a power of two (dynamic scales always are), short either way."""
    if _finite(x) and x > 0:
        mantissa, exponent = math.frexp(x)
        if mantissa == 0.5:
            return "1" if exponent == 1 else f"2^{exponent - 1}"
    return _fmt(x, ".3g")


def table(results: list[ModeResult], metric_name: str) -> str:
    """The per-mode table as aligned plain text, 100 columns at most: what a choice rests on
    (speed, memory on a GPU, validation figures, skipped steps, the final loss scale). Training
    means, throughput and curves are in report.json."""
    memory = memory_comparable(results)
    separate_metric = metric_name != "loss"  # without a metric_fn the loss is the metric: one column
    head = ["mode", "status", "s/epoch", "speed-up"] + (["peak MB", "saved"] if memory else []) + \
        ["val loss"] + ([f"val {metric_name[:8]}"] if separate_metric else []) + ["skipped", "scale"]
    rows = [head]
    for r in results:
        row = [r.mode, _STATUS_SHORT.get(r.status, r.status), _fmt(r.time_per_epoch, ".4g"),
               _fmt(r.speedup, ".2f") + ("x" if r.speedup is not None else "")]
        if memory:
            row += [_fmt(r.peak_memory_mb, ".0f"),
                    _fmt(None if r.memory_saving is None else 100 * r.memory_saving, ".0f") +
                    ("%" if r.memory_saving is not None else "")]
        row.append(_fmt(r.val_loss, ".4g"))
        if separate_metric:
            row.append(_fmt(r.val_metric, ".4g"))
        row += [_percent(r.skipped_steps, r.steps), _scale(r.final_loss_scale)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def state_lines(results: list[ModeResult]) -> list[str]:
    """Below the table (which has no room for it), the optimizer's state per parameter of every
    mode that measured it, when a lean mode ran: what the remainder and pure-bf16 modes save
    beside O2-bf16, exact on a CPU as on a GPU (the peak-memory figures are not)."""
    known = all_modes()
    if not any(r.mode in known and known[r.mode].variant and r.state_bytes_per_param is not None for r in results):
        return []
    lines = ["optimizer state after training, bytes per parameter (of it master weights):"]
    for r in results:
        if r.state_bytes_per_param is not None:
            lines.append(f"  {r.mode}: {r.state_bytes_per_param:.4g} ({_fmt(r.master_bytes_per_param, '.4g')})")
    return lines


def _clean(value: Any) -> Any:
    """JSON without NaN/inf (strict parsers reject them): non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str, header: dict, results: list[ModeResult], rec: Optional[Recommendation],
               complete: bool, error: Optional[str]) -> None:
    """Writes every figure atomically (a partial file never replaces a good one)."""
    doc = dict(header)
    doc.update(complete=complete, error=error, modes=[asdict(r) for r in results],
               recommendation=None if rec is None else asdict(rec))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
