"""The answer `mixprec compare` gives to "should I switch from torch.amp?": mixprec's fastest
usable mode judged against the best torch.amp mode on speed, memory and validation metric."""

from __future__ import annotations

import math
from typing import Optional

from .modes import BASELINE, is_torch_amp, label
from .report import ModeResult, Recommendation, within_tolerance

# Speed ratios closer to 1 than this are timing noise on a shared machine, not a reason to switch.
SAME_SPEED = 0.03
# With equal speed, this much less peak memory (GPU only) is a reason to switch on its own.
MEMORY_GAIN = 0.10


def _mb(r: ModeResult) -> Optional[float]:
    x = r.peak_memory_mb
    return x if isinstance(x, (int, float)) and math.isfinite(x) and x > 0 else None


def _memory_phrase(mix: ModeResult, torch: ModeResult, memory: bool) -> str:
    a, b = _mb(mix), _mb(torch)
    if not memory or a is None or b is None:
        return ""
    change = 1.0 - a / b
    if abs(change) < 0.005:
        return ", the same peak memory"
    return f", {abs(change):.0%} {'less' if change > 0 else 'more'} peak memory"


def versus_torch(results: list[ModeResult], rec: Recommendation, tolerance: float, higher_is_better: bool,
                 metric_name: str, memory: bool) -> tuple[Optional[bool], str]:
    """(switch, sentence). Only modes that qualified for the recommendation (``rec.candidates``:
    finished, finite, few skipped steps, metric within ``tolerance`` of O0's) take part. The best
    torch.amp mode is the fastest qualifying one; mixprec's contender is its fastest qualifying
    O-level whose metric is also within ``tolerance`` of that torch.amp mode's. Switch when it is
    faster by more than SAME_SPEED, or as fast and (``memory``: on a GPU) MEMORY_GAIN lighter.
    ``switch`` is None when there is nothing to judge."""
    torch_runs = [r for r in results if is_torch_amp(r.mode)]
    if not torch_runs:
        return None, "no torch.amp mode was run (add --modes torch to compare against it)"
    if rec.mode is None:
        return None, "no verdict: " + rec.reasons.get(BASELINE, "no baseline")
    ok = [r for r in results if r.mode in rec.candidates and r.mode != BASELINE]
    by_speed = sorted(ok, key=lambda r: r.time_per_epoch)
    best_torch = next((r for r in by_speed if is_torch_amp(r.mode)), None)
    mixprec = [r for r in by_speed if not is_torch_amp(r.mode)]
    fp32_note = f"; plain fp32 ({BASELINE}) was faster still here" if rec.mode == BASELINE else ""
    if best_torch is None:
        why = "; ".join(f"{label(r.mode)}: {rec.reasons.get(r.mode, r.status)}" for r in torch_runs)
        if not mixprec:
            return False, (f"stay with fp32 ({BASELINE}): no mixed-precision mode, mixprec's or torch.amp's, kept "
                           f"O0's validation {metric_name} within {tolerance:.1%} ({why})")
        return True, (f"switch to mixprec: {mixprec[0].mode} keeps O0's validation {metric_name} within "
                      f"{tolerance:.1%} and torch.amp does not ({why}){fp32_note}")
    if not mixprec:
        return False, (f"stay with torch.amp: no mixprec mode kept O0's validation {metric_name} within "
                       f"{tolerance:.1%}; {label(best_torch.mode)} did{fp32_note}")
    close = [r for r in mixprec if within_tolerance(r.val_metric, best_torch.val_metric, tolerance, higher_is_better)]
    if not close:
        m = mixprec[0]
        return False, (f"stay with torch.amp: {m.mode}'s validation {metric_name} {m.val_metric:.4g} is not within "
                       f"{tolerance:.1%} of {label(best_torch.mode)}'s {best_torch.val_metric:.4g}{fp32_note}")
    mix = close[0]
    ratio = best_torch.time_per_epoch / mix.time_per_epoch
    metric = f"validation {metric_name} {mix.val_metric:.4g} vs {best_torch.val_metric:.4g}, within {tolerance:.1%}"
    versus = f"{metric}{_memory_phrase(mix, best_torch, memory)}"
    if ratio > 1 + SAME_SPEED:
        return True, (f"switch to mixprec: {mix.mode} is {ratio:.2f}x faster than {label(best_torch.mode)} "
                      f"({versus}){fp32_note}")
    if ratio < 1 - SAME_SPEED:
        return False, (f"stay with torch.amp: {label(best_torch.mode)} is {1 / ratio:.2f}x faster than {mix.mode}, "
                       f"mixprec's fastest mode within tolerance{fp32_note}")
    saving = None if _mb(mix) is None or _mb(best_torch) is None else 1.0 - _mb(mix) / _mb(best_torch)
    if memory and saving is not None and saving >= MEMORY_GAIN:
        return True, (f"switch to mixprec: {mix.mode} is as fast as {label(best_torch.mode)} ({ratio:.2f}x) "
                      f"with {saving:.0%} less peak memory ({metric}){fp32_note}")
    return False, (f"stay with torch.amp: {mix.mode} is no faster than {label(best_torch.mode)} ({ratio:.2f}x, "
                   f"{versus}){fp32_note}")
