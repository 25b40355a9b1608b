# The recommendation of `mixprec compare` on synthetic per-mode results (no training): fastest
# within tolerance wins; diverged, NaN, failed, out-of-memory, too-many-skips and out-of-tolerance
# modes are excluded with their reason; speed-up and memory saving against O0; the table's
# columns and width; mode parsing.
from __future__ import annotations

import json
import math

import pytest
import torch

from mixprec.cli.modes import all_modes, default_modes, parse_modes
from mixprec.cli.memory import CPU_KIND, CUDA_KIND
from mixprec.cli.report import (DIVERGED, FAILED, OK, OOM, ModeResult, add_relative_figures, recommend, table,
                                within_tolerance, write_json)


def result(mode, t=1.0, metric=0.9, status=OK, skipped=0, steps=100, mem=100.0, error=None, val_loss=0.3):
    level, _, dt = mode.partition("-")
    return ModeResult(mode=mode, opt_level=level, dtype=dt or "float32", status=status, error=error,
                      time_per_epoch=t, val_metric=metric, val_loss=val_loss, skipped_steps=skipped, steps=steps,
                      peak_memory_mb=mem)


def test_fastest_within_tolerance_is_chosen_and_everyone_else_has_a_reason():
    results = [
        result("O0", t=10.0, metric=0.900, mem=200.0),
        result("O1-fp16", t=6.0, metric=0.899),
        result("O2-fp16", t=4.0, metric=0.850),  # fastest, but 5.6% worse than O0
        result("O2-bf16", t=5.0, metric=0.885, mem=80.0),  # 1.7% worse: inside 2%
        result("O3-fp16", t=3.0, metric=math.nan, val_loss=math.nan),
        result("O3-bf16", t=2.0, status=DIVERGED, error="loss scale stuck at its floor"),
        result("O1-bf16", t=4.5, skipped=20),
    ]
    add_relative_figures(results)
    rec = recommend(results, tolerance=0.02, max_skipped=0.05, higher_is_better=True, metric_name="accuracy")
    assert rec.mode == "O2-bf16"
    r = rec.reasons
    assert r["O2-bf16"].startswith("chosen: 2.00x O0's speed")
    assert r["O2-fp16"].startswith("validation accuracy 0.85 vs O0's 0.9: outside the 2.0% tolerance")
    assert r["O3-fp16"].startswith("NaN")
    assert r["O3-bf16"] == "diverged: loss scale stuck at its floor"
    assert r["O1-bf16"].startswith("too many skipped steps: 20 of 100 (20% > 5%)")
    assert r["O1-fp16"].startswith("slower: 6 s/epoch vs O2-bf16's 5 s/epoch")
    assert r["O0"].startswith("slower")
    assert set(r) == {x.mode for x in results}
    o2 = results[3]
    assert o2.speedup == pytest.approx(2.0) and o2.memory_saving == pytest.approx(0.6)
    assert results[0].speedup == 1.0 and results[0].memory_saving == 0.0


def test_o0_is_recommended_when_nothing_faster_keeps_accuracy():
    results = [result("O0", t=1.0), result("O2-bf16", t=1.5), result("O3-bf16", t=0.5, metric=0.5),
               result("O1-fp16", t=0.7, status=FAILED, error="NotImplementedError: no Half kernel"),
               result("O2-fp16", t=None, status=OOM, error="CUDA out of memory")]
    add_relative_figures(results)
    rec = recommend(results)
    assert rec.mode == "O0"
    assert rec.reasons["O0"] == "chosen: no other mode was faster within tolerance"
    assert rec.reasons["O2-bf16"].startswith("slower")
    assert rec.reasons["O1-fp16"] == "failed: NotImplementedError: no Half kernel"
    assert rec.reasons["O2-fp16"] == "out of memory: CUDA out of memory"
    assert results[4].speedup is None


def test_lower_is_better_metric_direction():
    results = [result("O0", t=2.0, metric=1.00), result("O2-bf16", t=1.0, metric=1.01),
               result("O3-bf16", t=0.5, metric=0.5)]
    add_relative_figures(results)
    rec = recommend(results, tolerance=0.02, higher_is_better=False, metric_name="loss")
    assert rec.mode == "O3-bf16"  # a lower loss is better, never a reason to reject
    assert rec.reasons["O2-bf16"].startswith("slower")
    results[1].val_metric = 1.03
    rec = recommend(results[:2], tolerance=0.02, higher_is_better=False, metric_name="loss")
    assert rec.mode == "O0" and rec.reasons["O2-bf16"] == "validation loss 1.03 vs O0's 1: outside the 2.0% tolerance"


@pytest.mark.parametrize("status, metric", [(FAILED, 0.9), (OOM, 0.9), (DIVERGED, 0.9), (OK, math.nan)])
def test_no_recommendation_without_a_sound_baseline(status, metric):
    results = [result("O0", status=status, metric=metric, error="boom"), result("O2-bf16", t=0.1)]
    rec = recommend(results)
    assert rec.mode is None
    assert all(v.startswith("no baseline to compare against") for v in rec.reasons.values())


def test_within_tolerance_is_relative_and_one_sided():
    assert within_tolerance(0.89, 0.90, 0.02, True) and not within_tolerance(0.87, 0.90, 0.02, True)
    assert within_tolerance(2.0, 0.90, 0.0, True)
    assert within_tolerance(1.01, 1.0, 0.02, False) and not within_tolerance(1.03, 1.0, 0.02, False)
    assert within_tolerance(-1.01, -1.0, 0.02, True)  # a negative metric (e.g. -loss) keeps a positive margin


def test_table_and_json_with_non_finite_values(tmp_path):
    results = [result("O0"), result("O3-fp16", metric=math.nan, val_loss=math.inf, status=DIVERGED)]
    results[1].loss_curve = [1.0, math.nan, math.inf]
    add_relative_figures(results)
    text = table(results, "accuracy")
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["mode", "status"] and len(lines) == 4
    assert "nan" in lines[3] and "inf" in lines[3]
    path = str(tmp_path / "r.json")
    write_json(path, {"version": 1}, results, recommend(results), True, None)
    with open(path) as f:
        doc = json.loads(f.read(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert doc["modes"][1]["loss_curve"] == [1.0, None, None] and doc["modes"][1]["val_loss"] is None
    assert doc["recommendation"]["mode"] == "O0"


def test_mode_parsing():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    names = list(all_modes())
    assert names[0] == "O0" and {"O1-fp16", "O1-bf16", "O2-fp16", "O2-bf16", "O3-fp16", "O3-bf16"} <= set(names)
    assert {"torch-fp16", "torch-bf16"} <= set(names)
    assert default_modes(cuda) == names
    assert default_modes(cpu) == ["O0", "O1-bf16", "O2-bf16", "O3-bf16", "O2-bf16-rem", "O2-bf16-rem-q8",
                                  "O3-bf16-sr", "torch-bf16"]
    assert [m.name for m in parse_modes("o2", cpu)] == ["O0", "O2-fp16", "O2-bf16"]
    assert [(m.name, m.opt_level, m.dtype) for m in parse_modes("torch", cpu)] == [
        ("O0", "O0", torch.float32), ("torch-fp16", "torch.amp", torch.float16),
        ("torch-bf16", "torch.amp", torch.bfloat16)]
    assert [m.name for m in parse_modes("O3-bf16, O0, O3-bf16", cpu)] == ["O0", "O3-bf16"]
    assert [m.name for m in parse_modes("all", cpu)] == names
    m = parse_modes("O2-bf16", cpu)[1]
    assert (m.opt_level, m.dtype, m.dtype_name) == ("O2", torch.bfloat16, "bfloat16")
    with pytest.raises(ValueError, match=r"unknown mode 'fp8'"):
        parse_modes("O0,fp8", cpu)


def _worst_case_results(kind: str) -> list[ModeResult]:
    """Every mode with the widest figures a real run prints: long names, an out-of-memory mode,
    5-digit MiB, a loss scale of 2^16, small and large losses."""
    out = []
    for i, name in enumerate(all_modes()):
        r = result(name, t=1234.5678 / (i + 1), metric=0.95123456, val_loss=0.000123456, mem=81234.5, skipped=3,
                   steps=2000, status=OOM if name == "O3-fp16" else OK)
        r.final_loss_scale, r.memory_kind = 65536.0 if "fp16" in name else 1.0, kind
        out.append(r)
    add_relative_figures(out)
    return out


@pytest.mark.parametrize("kind", [CUDA_KIND, CPU_KIND])
@pytest.mark.parametrize("metric_name", ["accuracy", "loss", "top-1 accuracy (percent)"])
def test_table_fits_100_columns_without_repeats_or_cpu_memory(kind, metric_name):
    text = table(_worst_case_results(kind), metric_name)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, text
    head = lines[0].split("  ")
    head = [h.strip() for h in head if h.strip()]
    assert head[:4] == ["mode", "status", "s/epoch", "speed-up"] and head[-2:] == ["skipped", "scale"]
    # No metric_fn: the loss is the metric, shown once.
    assert sum("loss" in h for h in head) == 1 if metric_name == "loss" else f"val {metric_name[:8]}" in head
    # On a CPU the resident-set growth is noise: no memory columns and no memory saving at all.
    assert ("peak MB" in head and "saved" in head) == (kind == CUDA_KIND)
    assert ("peak MB" in head) or all(r.memory_saving is None for r in _worst_case_results(kind))
    row = lines[2].split()
    assert row[0] == "O0" and row[-1] == "1" and "2^16" in lines[3] and "OOM" in text


def test_table_figures():
    results = [result("O0", t=2.0, mem=200.0), result("torch-fp16", t=1.0, mem=150.0, skipped=1, steps=400)]
    results[1].final_loss_scale = 2.0**-3
    add_relative_figures(results)
    lines = table(results, "accuracy").splitlines()
    assert lines[3].split() == ["torch-fp16", "ok", "1", "2.00x", "150", "25%", "0.3", "0.9", "<1%", "2^-3"]
