# "Should I switch from torch.amp?" on constructed per-mode results (no training), table-driven:
# torch.amp faster -> stay; mixprec faster within tolerance -> switch; mixprec's metric outside the
# tolerance -> not recommended; the ties, memory, failed baselines and missing baselines.
from __future__ import annotations

import math

import pytest

from mixprec.cli.memory import CPU_KIND, CUDA_KIND
from mixprec.cli.report import DIVERGED, FAILED, OK, ModeResult, add_relative_figures, recommend
from mixprec.cli.verdict import versus_torch


def mode(name, t, metric=0.90, mem=100.0, status=OK, error=None):
    level, _, dt = name.partition("-")
    return ModeResult(mode=name, opt_level="torch.amp" if level == "torch" else level, dtype=dt or "float32",
                      status=status, error=error, time_per_epoch=t, val_metric=metric, val_loss=0.3, steps=100,
                      peak_memory_mb=mem, memory_kind=CUDA_KIND)


def judge(results, tolerance=0.02, higher=True):
    add_relative_figures(results)
    rec = recommend(results, tolerance, 0.05, higher, "accuracy")
    memory = results[0].memory_kind != CPU_KIND
    return rec, versus_torch(results, rec, tolerance, higher, "accuracy", memory)


O0 = ("O0", 10.0)
CASES = [
    # (id, modes as (name, s/epoch[, metric[, peak MB]]), switch, the sentence's start, words it must hold)
    ("torch faster -> stay", [O0, ("O2-bf16", 5.0), ("torch-bf16", 4.0), ("torch-fp16", 4.5)], False,
     "stay with torch.amp: torch.amp bf16 is 1.25x faster than O2-bf16", ["fastest mode within tolerance"]),
    ("mixprec faster within tolerance -> switch", [O0, ("O2-bf16", 4.0, 0.895), ("torch-bf16", 4.48)], True,
     "switch to mixprec: O2-bf16 is 1.12x faster than torch.amp bf16",
     ["validation accuracy 0.895 vs 0.9, within 2.0%"]),
    ("judged against the best torch.amp mode, not the slower one", [O0, ("O2-bf16", 4.0), ("torch-fp16", 8.0),
                                                                   ("torch-bf16", 4.2)], True,
     "switch to mixprec: O2-bf16 is 1.05x faster than torch.amp bf16", []),
    ("mixprec's metric outside the tolerance of O0 -> not recommended", [O0, ("O2-bf16", 2.0, 0.80),
                                                                         ("torch-bf16", 4.0)], False,
     "stay with torch.amp: no mixprec mode kept O0's validation accuracy within 2.0%", ["torch.amp bf16 did"]),
    ("outside the tolerance of torch.amp's metric -> not recommended",
     [O0, ("O2-bf16", 2.0, 0.885), ("torch-bf16", 4.0, 0.92)], False,
     "stay with torch.amp: O2-bf16's validation accuracy 0.885 is not within 2.0% of torch.amp bf16's 0.92", []),
    ("a slower but accurate mixprec mode is the one judged", [O0, ("O3-bf16", 2.0, 0.5), ("O2-bf16", 3.0),
                                                             ("torch-bf16", 4.0)], True,
     "switch to mixprec: O2-bf16 is 1.33x faster than torch.amp bf16", []),
    ("as fast and 30% lighter -> switch", [O0, ("O2-bf16", 4.0, 0.9, 70.0), ("torch-bf16", 4.04, 0.9, 100.0)], True,
     "switch to mixprec: O2-bf16 is as fast as torch.amp bf16 (1.01x) with 30% less peak memory", []),
    ("as fast, same memory -> stay", [O0, ("O2-bf16", 4.0), ("torch-bf16", 4.04)], False,
     "stay with torch.amp: O2-bf16 is no faster than torch.amp bf16 (1.01x", ["the same peak memory"]),
    ("faster and heavier: said so", [O0, ("O2-bf16", 2.0, 0.9, 150.0), ("torch-bf16", 4.0)], True,
     "switch to mixprec: O2-bf16 is 2.00x faster", ["50% more peak memory"]),
    ("fp32 fastest of all: said so", [("O0", 1.0), ("O2-bf16", 2.0), ("torch-bf16", 3.0)], True,
     "switch to mixprec: O2-bf16 is 1.50x faster", ["plain fp32 (O0) was faster still here"]),
]


@pytest.mark.parametrize("modes, switch, start, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_versus_torch(modes, switch, start, words):
    results = [mode(*m) for m in modes]
    _, (got_switch, text) = judge(results)
    assert got_switch is switch, text
    assert text.startswith(start), text
    for w in words:
        assert w in text, text


def test_torch_amp_failing_is_a_reason_to_switch():
    results = [mode(*O0), mode("O2-bf16", 4.0), mode("torch-fp16", 3.0, status=DIVERGED, error="scale stuck"),
               mode("torch-bf16", 2.0, metric=math.nan)]
    rec, (switch, text) = judge(results)
    assert rec.mode == "O2-bf16" and switch is True
    assert text.startswith("switch to mixprec: O2-bf16 keeps O0's validation accuracy within 2.0% and torch.amp "
                           "does not (torch.amp fp16: diverged: scale stuck; torch.amp bf16: NaN"), text


def test_nothing_but_fp32_keeps_accuracy():
    results = [mode(*O0), mode("O2-bf16", 4.0, metric=0.5), mode("torch-bf16", 4.0, status=FAILED, error="boom")]
    _, (switch, text) = judge(results)
    assert switch is False and text.startswith("stay with fp32 (O0): no mixed-precision mode"), text


def test_no_verdict_without_torch_modes_or_baseline():
    assert judge([mode(*O0), mode("O2-bf16", 1.0)])[1] == (
        None, "no torch.amp mode was run (add --modes torch to compare against it)")
    switch, text = judge([mode("O0", 1.0, status=FAILED, error="boom"), mode("torch-bf16", 1.0)])[1]
    assert switch is None and text.startswith("no verdict: no baseline to compare against: boom")


def test_lower_is_better_metric_and_cpu_memory_ignored():
    results = [mode("O0", 10.0, metric=1.0), mode("O2-bf16", 4.0, metric=1.015, mem=10.0),
               mode("torch-bf16", 4.04, metric=1.0, mem=100.0)]
    for r in results:
        r.memory_kind = CPU_KIND  # a 90% "saving" on a CPU is noise: equal speed stays equal
    _, (switch, text) = judge(results, higher=False)
    assert switch is False and "peak memory" not in text and text.startswith("stay with torch.amp: O2-bf16 is no "
                                                                              "faster"), text
    results[1].val_metric = 1.03  # a higher loss is worse: outside 2% of O0's
    _, (switch, text) = judge(results, higher=False)
    assert switch is False and "no mixprec mode kept" in text
