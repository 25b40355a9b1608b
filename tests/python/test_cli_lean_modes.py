"""`mixprec compare`'s lean modes (O2-bf16-rem, O3-bf16-sr, O2-bf16-fp8): parsing, CPU runs, state bytes, skips."""
from __future__ import annotations

import json
import os

import pytest
import torch

from mixprec.cli import embedded
from mixprec.cli.main import main
from mixprec.cli.modes import all_modes, default_modes, parse_modes
from mixprec.cli.report import OK, SKIPPED, ModeResult, recommend
from mixprec.cli.lean import ModeSkipped, lean_options
from mixprec.cli.runner import RunConfig, make_precision
from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_tasks.py")
TINY = ["--epochs", "1", "--steps-per-epoch", "2", "--val-steps", "1", "--no-progress"]
LEAN = ["O2-bf16-rem", "O3-bf16-sr", "O2-bf16-fp8"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def compare(tmp_path, *args) -> tuple[int, dict]:
    code = main(["compare", "--out", str(tmp_path), "--device", "cpu", *args])
    with open(tmp_path / "report.json") as f:
        return code, json.load(f)


def test_parsing_accepts_the_new_names_and_refuses_unknown_ones_with_the_list():
    modes = all_modes()
    assert [(modes[n].opt_level, modes[n].dtype, modes[n].variant) for n in LEAN] == [
        ("O2", torch.bfloat16, "rem"), ("O3", torch.bfloat16, "sr"), ("O2", torch.bfloat16, "fp8")]
    assert [m.name for m in parse_modes("o3-BF16-sr, O2-bf16-fp8,O2-bf16-rem", CPU)] == \
        ["O0", "O3-bf16-sr", "O2-bf16-fp8", "O2-bf16-rem"]
    # An opt level alone still means its two dtypes; the lean variants are asked for by name.
    assert [m.name for m in parse_modes("O2", CPU)] == ["O0", "O2-fp16", "O2-bf16"]
    assert set(LEAN) <= {m.name for m in parse_modes("all", CPU)}
    # FP8 on a CPU is an emulation: not in the CPU default, in the GPU one.
    assert {"O2-bf16-rem", "O3-bf16-sr"} <= set(default_modes(CPU)) and "O2-bf16-fp8" not in default_modes(CPU)
    assert set(LEAN) <= set(default_modes(CUDA))
    with pytest.raises(ValueError, match=r"unknown mode 'O2-bf16-fp4' \(known: .*O2-bf16-rem, O2-bf16-rem-q8, O3-bf16-sr, "
                                         r"O2-bf16-fp8, .*all, default\)"):
        parse_modes("O2-bf16-fp4", CPU)


def test_lean_and_fp8_modes_run_on_the_embedded_task(tmp_path, capsys):
    code, doc = compare(tmp_path, "--modes", ",".join(["O2-bf16"] + LEAN), *TINY)
    assert code == 0 and doc["complete"]
    out = capsys.readouterr().out
    by = {m["mode"]: m for m in doc["modes"]}
    assert list(by) == ["O0", "O2-bf16"] + LEAN
    for m in by.values():
        assert m["status"] == OK and m["steps"] == 2 and m["peak_memory_mb"] is not None, m
        assert m["optimizer"] == "mixprec.optimizers.FusedAdam" and m["state_bytes_per_param"] is not None
    o2, rem, sr, fp8 = (by[n] for n in ["O2-bf16"] + LEAN)
    # Counted from the state tensors: an int16 remainder is 2 bytes less than an fp32 master, the
    # rest of the state (Adam's moments) alike; pure bf16 keeps no master at all.
    assert o2["master_bytes_per_param"] == 4 and rem["master_bytes_per_param"] == o2["master_bytes_per_param"] - 2
    assert rem["state_bytes_per_param"] == o2["state_bytes_per_param"] - 2
    assert sr["master_bytes_per_param"] == 0 and sr["state_bytes_per_param"] == o2["state_bytes_per_param"] - 4
    assert by["O0"]["master_bytes_per_param"] == 0
    # FP8 ran, emulated, is marked so and is not recommended on its time.
    assert fp8["emulated"] and "emulated" in fp8["note"] and not any(by[n]["emulated"] for n in by if n != fp8["mode"])
    assert doc["recommendation"]["reasons"]["O2-bf16-fp8"].startswith("not a candidate: emulated")
    # The embedded transformer's Linears (width 64, 2 layers) are all eligible but the 10-class head.
    assert fp8["fp8_linears"] == 8 and fp8["fp8_fallbacks"] == 0 and o2["fp8_linears"] is None
    assert "O2-bf16-fp8: emulated" in out
    assert "O2-bf16-fp8: 8 nn.Linear in FP8; 0 call(s) ran plain F.linear" in out
    assert "optimizer state after training, bytes per parameter (of it master weights):" in out
    assert f"  O2-bf16-rem: {rem['state_bytes_per_param']:.4g} (2)" in out
    with open(tmp_path / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_stochastic_mode_rounds_stochastically_without_masters():
    task = embedded.make_task(CPU)
    precision = make_precision(all_modes()["O3-bf16-sr"], task, CPU, RunConfig(seed=7))
    try:
        groups = task.optimizer.param_groups
        assert all((g["rounding"], g["seed"], g["master_weights"]) == ("stochastic", 7, False) for g in groups)
        assert all(p.dtype == torch.bfloat16 for p in task.model.parameters())
    finally:
        precision.close()


def test_modes_a_torch_optimizer_cannot_take_are_skipped_with_the_reason(tmp_path):
    code, doc = compare(tmp_path, "--task", TASKS + ":tiny_task", "--modes", "O2-bf16-rem,O3-bf16-sr", *TINY)
    assert code == 0 and doc["complete"] and doc["error"] is None
    by = {m["mode"]: m for m in doc["modes"]}
    for name, option in [("O2-bf16-rem", "master_weights='remainder'"), ("O3-bf16-sr", "rounding='stochastic'")]:
        assert by[name]["status"] == SKIPPED and by[name]["steps"] == 0
        assert by[name]["error"] == f"{option} is an option of mixprec's fused optimizers; this task's optimizer is SGD"
        assert doc["recommendation"]["reasons"][name] == "skipped: " + by[name]["error"]
    assert by["O0"]["status"] == OK and doc["recommendation"]["mode"] == "O0"


def test_fp8_is_skipped_without_an_eligible_linear(tmp_path):
    code, doc = compare(tmp_path, "--task", TASKS + ":tiny_task", "--modes", "O2-bf16-fp8", *TINY)
    fp8 = doc["modes"][1]
    assert code == 0 and fp8["status"] == SKIPPED and fp8["steps"] == 0 and fp8["fp8_linears"] is None
    assert fp8["error"] == "no nn.Linear of the model is eligible for FP8 (in_features and out_features multiples of 16)"


def test_fp8_is_skipped_on_a_gpu_without_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ModeSkipped, match=r"^NVIDIA A100 \(compute capability 8\.0\) has no FP8 tensor cores; FP8 "
                                          r"needs 8\.9 or newer$"):
        lean_options(all_modes()["O2-bf16-fp8"], embedded.make_task(CPU), CUDA, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert lean_options(all_modes()["O2-bf16-fp8"], embedded.make_task(CPU), CUDA, 0) == {"fp8": True}


def test_emulated_and_skipped_modes_are_never_recommended():
    def result(mode, t, status=OK, emulated=False):
        return ModeResult(mode, "O2", "bfloat16", status=status, time_per_epoch=t, val_loss=0.3, val_metric=0.9,
                          steps=10, emulated=emulated, note="emulated: test", error=None if status == OK else "why")
    rec = recommend([result("O0", 2.0), result("O2-bf16-fp8", 0.5, emulated=True),
                     result("O2-bf16-rem", 0.1, status=SKIPPED)])
    assert rec.mode == "O0" and rec.reasons["O2-bf16-fp8"] == "not a candidate: emulated: test"
    assert rec.reasons["O2-bf16-rem"] == "skipped: why"
