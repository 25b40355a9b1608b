# `mixprec compare` end to end with tiny settings: the embedded task through `python -m mixprec`,
# a user task from a file, the output files (report.json, curves.png, TensorBoard logs) parsed,
# the rigged-overflow diagnostics, and bad input: one-line errors, non-zero exits, partial results.
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import mixprec
from mixprec.cli.main import main
from mixprec.cli.modes import default_modes
from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TASKS = os.path.join(HERE, "cli_tasks.py")
TINY = ["--epochs", "2", "--steps-per-epoch", "2", "--val-steps", "1", "--no-progress"]




def run(tmp_path, *args):
    return main(["compare", "--out", str(tmp_path), "--device", "cpu", *args])


def report(tmp_path) -> dict:
    with open(tmp_path / "report.json") as f:
        return json.load(f)  # strict: the writer never emits NaN/inf


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_embedded_default_through_python_m(tmp_path):
    # The child imports the mixprec this process imported (an installed one in CI, a source tree
    # with its built library in development).
    package_parent = os.path.dirname(os.path.dirname(mixprec.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mixprec", "compare", "--out", str(tmp_path), "--device", "cpu",
                           "--epochs", "1", "--steps-per-epoch", "2", "--val-steps", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    doc = report(tmp_path)
    expected = default_modes(torch.device("cpu"))
    assert [m["mode"] for m in doc["modes"]] == expected == doc["modes_requested"]
    assert doc["complete"] and doc["error"] is None and doc["metric_name"] == "accuracy"
    for m in doc["modes"]:
        assert m["status"] == "ok", m
        assert m["steps"] == 2 and len(m["loss_curve"]) == 2 and len(m["scale_curve"]) == 2
        assert m["time_per_epoch"] > 0 and m["samples_per_s"] > 0 and m["samples"] == 2 * 64
        assert 0 <= m["val_metric"] <= 1 and m["val_loss"] > 0 and m["final_loss_scale"] == 1.0
    assert doc["modes"][0]["speedup"] == 1.0
    assert doc["recommendation"]["mode"] in expected
    # The table and the recommendation are printed; every mode not chosen says why.
    assert "Recommended: " + doc["recommendation"]["mode"] in proc.stdout
    for name in expected:
        assert name in proc.stdout
    assert set(doc["recommendation"]["reasons"]) == set(expected)
    with open(tmp_path / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "tensorboard").exists()  # only with --tensorboard


@pytest.mark.cuda
def test_every_mode_on_cuda(tmp_path):
    assert main(["compare", "--out", str(tmp_path), "--device", "cuda", "--modes", "all", "--tensorboard",
                 "--epochs", "2", "--steps-per-epoch", "4", "--val-steps", "1", "--no-progress"]) == 0
    doc = report(tmp_path)
    assert doc["device"].startswith("cuda") and doc["default_modes"] == [m["mode"] for m in doc["modes"]]
    fp8_hardware = torch.cuda.get_device_capability() >= (8, 9)
    for m in doc["modes"]:
        if m["mode"] == "O2-bf16-fp8" and not fp8_hardware:  # skipped with the reason, nothing measured
            assert m["status"] == "skipped" and "has no FP8 tensor cores" in m["error"], m
            continue
        assert m["status"] == "ok", m
        assert not m["emulated"]
        assert m["memory_kind"] == "cuda allocator peak" and m["peak_memory_mb"] > 0 and m["peak_rss_mb"] is None
        dynamic = m["dtype"] == "float16" and m["opt_level"] in ("O1", "O2", "torch.amp")
        if dynamic:  # 2^16, less a backoff per overflowing step (a first step may overflow)
            assert m["final_loss_scale"] == 2.0**16 / 2 ** m["skipped_steps"]
        else:
            assert m["final_loss_scale"] == 1.0 and m["skipped_steps"] == 0
    by = {m["mode"]: m for m in doc["modes"]}
    assert by["O2-bf16-rem"]["state_bytes_per_param"] == by["O2-bf16"]["state_bytes_per_param"] - 2
    assert doc["recommendation"]["mode"] is not None
    assert {"torch-fp16", "torch-bf16", "O2-bf16-rem", "O3-bf16-sr", "O2-bf16-fp8"} <= set(doc["default_modes"])
    assert doc["modes"][-1]["optimizer"] == "torch.optim.AdamW(fused=True)"  # the embedded task's FusedAdam
    assert doc["recommendation"]["switch"] is not None and doc["recommendation"]["versus_torch"]


def test_user_task_outputs_parse(tmp_path, capsys):
    example = os.path.join(ROOT, "examples", "python", "compare_task.py")
    assert run(tmp_path, "--task", example + ":make_task", "--modes", "O2-bf16", "--tensorboard", *TINY) == 0
    doc = report(tmp_path)
    assert [m["mode"] for m in doc["modes"]] == ["O0", "O2-bf16"]  # O0 always runs, first
    assert doc["metric_name"] == "R^2" and doc["higher_is_better"] is True
    o0, o2 = doc["modes"]
    assert o0["epochs"] == o2["epochs"] == 2 and len(o0["val_metric_curve"]) == 2
    assert o0["samples"] == 2 * 2 * 128 and o0["memory_kind"].startswith("cpu")
    # Same initial weights and data order: the first losses agree to bf16 rounding.
    assert abs(o0["loss_curve"][0] - o2["loss_curve"][0]) < 0.05 * abs(o0["loss_curve"][0])
    import matplotlib.image
    assert matplotlib.image.imread(tmp_path / "curves.png").shape[2] in (3, 4)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = doc["tensorboard_run"]
    assert os.path.dirname(run_dir) == str(tmp_path / "tensorboard")
    acc = EventAccumulator(os.path.join(run_dir, "O2-bf16"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "loss_scale", "skipped_steps", "step_time_ms", "memory_mb", "val/loss", "val/metric"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [round(e.value, 4) for e in acc.Scalars("train/loss")] == [round(v, 4) for v in o2["loss_curve"]]


def test_tuple_task_without_metric_judges_by_loss(tmp_path):
    assert run(tmp_path, "--task", TASKS + ":tuple_task", "--modes", "O1-bf16", "--no-plot", *TINY) == 0
    doc = report(tmp_path)
    assert doc["metric_name"] == "loss" and doc["higher_is_better"] is False
    for m in doc["modes"]:
        assert m["val_metric"] == m["val_loss"] and m["train_metric"] is None


def test_rigged_overflow_diverges_with_diagnostics(tmp_path):
    code = run(tmp_path, "--task", TASKS + ":rigged_task", "--modes", "O2-fp16", "--debug-forward",
               "--patience", "3", "--epochs", "3", "--steps-per-epoch", "4", "--no-progress", "--no-plot")
    assert code == 0  # the baseline is fine; a diverged mode is a finding, not an error
    doc = report(tmp_path)
    o0, fp16 = doc["modes"]
    assert o0["status"] == "ok" and o0["first_nonfinite_module"] is None
    assert fp16["status"] == "diverged"
    assert "module '1.1' (Scale)" in fp16["first_nonfinite_module"] and "from finite inputs" in fp16["error"]
    assert fp16["skipped_steps"] == fp16["nan_loss_steps"] == 3 and fp16["steps"] == 3
    assert all(e["kind"] == "nan_loss" for e in fp16["overflow_events"])
    assert "2.weight" in fp16["nonfinite_params"]
    assert fp16["final_loss_scale"] == 2.0**13  # three backoffs from 2^16
    assert doc["recommendation"]["mode"] == "O0"
    assert doc["recommendation"]["reasons"]["O2-fp16"].startswith("diverged: loss non-finite for 3 steps")


def test_mode_without_kernel_is_recorded_not_fatal(tmp_path, capsys):
    assert run(tmp_path, "--task", TASKS + ":no_kernel_task", "--modes", "O1-bf16,O3-bf16", "--no-plot", *TINY) == 0
    doc = report(tmp_path)
    assert [m["status"] for m in doc["modes"]] == ["ok", "failed", "failed"]
    assert doc["modes"][1]["error"] == "NotImplementedError: \"addmm_impl_cpu_\" not implemented for 'Half'"
    assert doc["recommendation"]["reasons"]["O3-bf16"].startswith("failed: NotImplementedError")
    assert doc["recommendation"]["mode"] == "O0"
    assert error_lines(capsys) == []


def test_out_of_memory_mode_exits_nonzero_and_keeps_measurements(tmp_path, capsys):
    assert run(tmp_path, "--task", TASKS + ":oom_task", "--modes", "O1-bf16,O2-bf16", *TINY) == 1
    (line,) = error_lines(capsys)
    assert line.startswith("mixprec compare: error: O1-bf16 ran out of memory: RuntimeError: [enforce fail")
    doc = report(tmp_path)
    assert doc["complete"] and doc["error"] == line.split("error: ", 1)[1]
    assert [m["status"] for m in doc["modes"]] == ["ok", "out of memory", "out of memory"]
    assert doc["modes"][0]["steps"] == 4 and doc["modes"][0]["val_metric"] is not None
    assert (tmp_path / "curves.png").exists()


def test_baseline_out_of_memory(tmp_path, capsys):
    assert run(tmp_path, "--task", TASKS + ":oom_everywhere_task", "--modes", "O2-bf16", "--no-plot", *TINY) == 1
    (line,) = error_lines(capsys)
    assert line.startswith("mixprec compare: error: O0 (the baseline) out of memory: RuntimeError:")
    assert "can't allocate memory" in line
    doc = report(tmp_path)
    assert doc["recommendation"]["mode"] is None
    assert doc["recommendation"]["reasons"]["O2-bf16"].startswith("no baseline to compare against")


def test_interrupt_keeps_finished_modes(tmp_path, capsys):
    assert run(tmp_path, "--task", TASKS + ":interrupt_task", "--modes", "O2-bf16,O3-bf16", *TINY) == 130
    (line,) = error_lines(capsys)
    assert line.startswith("mixprec compare: error: interrupted")
    doc = report(tmp_path)
    assert not doc["complete"] and doc["error"] == "interrupted"
    assert [(m["mode"], m["status"]) for m in doc["modes"]] == [("O0", "ok")]


@pytest.mark.parametrize("args, message", [
    (["--modes", "O0,O7-fp16"], "unknown mode 'O7-fp16' (known: O0, O1-fp16"),
    (["--modes", ","], "no mode given"),
    (["--task", "no_such_package_xyz.tasks:make"], "cannot import task module 'no_such_package_xyz.tasks': "
                                                  "ModuleNotFoundError: No module named 'no_such_package_xyz'"),
    (["--task", "missing_file.py:make"], "task file 'missing_file.py' does not exist"),
    (["--task", TASKS + ":nothing_here"], "has no attribute 'nothing_here'"),
    (["--task", "no_colon"], "--task must look like 'package.module:function'"),
    (["--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
    (["--tolerance", "2"], "argument --tolerance: must be in [0, 1], got 2"),
])
def test_bad_input_one_line_error(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert run(out, *args) == 2
    (line,) = error_lines(capsys)
    assert line.startswith("mixprec compare: error: ") and message in line, line
    assert not out.exists()  # nothing was measured


def test_import_error_inside_user_module(tmp_path, capsys):
    bad = tmp_path / "bad_task.py"
    bad.write_text("import torch\nraise ValueError('broken on purpose\\nsecond line')\n")
    assert run(tmp_path / "out", "--task", f"{bad}:make", *TINY) == 2
    (line,) = error_lines(capsys)
    assert line == f"mixprec compare: error: cannot import task module '{bad}': ValueError: broken on purpose"


@pytest.mark.parametrize("fn, message", [
    ("returns_garbage", "must return a mixprec.cli.Task, a dict or a tuple"),
    ("missing_loader", "returned a dict missing val_loader"),
])
def test_malformed_task_stops_with_partial_report(tmp_path, capsys, fn, message):
    assert run(tmp_path, "--task", f"{TASKS}:{fn}", *TINY) == 2
    (line,) = error_lines(capsys)
    assert message in line
    doc = report(tmp_path)
    assert not doc["complete"] and message in doc["error"] and doc["modes"] == []  # found before any mode


def test_help_and_no_command(capsys):
    assert main([]) == 2
    assert main(["compare", "--help"]) == 0
    assert "--tolerance" in capsys.readouterr().out
