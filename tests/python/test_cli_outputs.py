# What `mixprec compare` leaves for looking and reporting: the figure's panels (inspected through
# its axes, not pixels), a fresh TensorBoard run per invocation with the HParams view, and the
# `mixprec --version`, `mixprec env` and `--help` texts.
from __future__ import annotations

import datetime
import json
import os
import re
import sys

import pytest
import torch

import mixprec
from mixprec.cli import env as env_cli
from mixprec.cli.main import main
from mixprec.cli.memory import CPU_KIND, CUDA_KIND
from mixprec.cli.plots import build_figure
from mixprec.cli.report import DIVERGED, OK, ModeResult, add_relative_figures
from mixprec.cli.tb_logs import new_run_dir
from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_tasks.py")


def curves(name, kind, scale=1.0, status=OK, loss=1.0):
    r = ModeResult(name, name.split("-")[0], "x", status=status, time_per_epoch=2.0, val_metric=0.9, val_loss=0.3,
                   peak_memory_mb=100.0, memory_kind=kind, steps=6)
    r.loss_curve = [loss, loss / 2, loss / 4, loss / 8, loss / 16, loss / 32]  # identical for every mode
    r.scale_curve = [scale] * 6
    r.val_metric_curve = [0.8, 0.9]
    return r


def titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


def test_figure_on_a_gpu_with_fp16_has_every_panel():
    results = [curves("O0", CUDA_KIND), curves("O2-fp16", CUDA_KIND, scale=2.0**16), curves("torch-bf16", CUDA_KIND),
               curves("O3-fp16", CUDA_KIND, status=DIVERGED)]
    results[3].time_per_epoch = results[3].peak_memory_mb = None
    add_relative_figures(results)
    fig = build_figure(results, "accuracy", 0.02, True)
    assert titles(fig) == ["time per epoch (lower is better)", "peak memory (lower is better)", "training loss",
                           "validation accuracy (higher is better)", "loss scale (1 = no scaling)"]
    time_ax, mem_ax, loss_ax, val_ax, _ = fig.axes
    assert [t.get_text() for t in time_ax.get_xticklabels()] == [r.mode for r in results]
    assert [b.get_height() for b in time_ax.patches] == [2.0, 2.0, 2.0, 0.0]  # no time: no bar, and "n/a"
    assert [t.get_text() for t in time_ax.texts] == ["1.00x", "1.00x", "1.00x", "n/a"]
    assert [b.get_hatch() for b in mem_ax.patches] == [None, None, "//", None]  # torch.amp stands out
    # Identical curves stay distinguishable: no two modes share a line style and marker.
    styles = [(line.get_linestyle(), line.get_marker()) for line in loss_ax.get_lines()]
    assert len(styles) == 4 and len(set(styles)) == 4
    assert loss_ax.get_yscale() == "log"  # the losses span 32x
    # The tolerance band: from 2% under O0's final metric up to it (higher is better).
    (band,) = [p for p in val_ax.patches if p.get_label() == "within 2.0% of O0"]
    ys = band.get_path().transformed(band.get_patch_transform()).vertices[:, 1]
    assert min(ys) == pytest.approx(0.9 * 0.98) and max(ys) == pytest.approx(0.9)
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_figure_on_a_cpu_in_bf16_drops_memory_and_scale_panels():
    results = [curves("O0", CPU_KIND), curves("O2-bf16", CPU_KIND), curves("torch-bf16", CPU_KIND)]
    add_relative_figures(results)
    fig = build_figure(results, "loss", 0.05, False)
    assert titles(fig) == ["time per epoch (lower is better)", "training loss", "validation loss (lower is better)"]
    assert any("peak memory not shown" in t.get_text() for t in fig.texts)
    (band,) = [p for p in fig.axes[2].patches if p.get_label() == "within 5.0% of O0"]
    ys = band.get_path().transformed(band.get_patch_transform()).vertices[:, 1]
    assert min(ys) == pytest.approx(0.9) and max(ys) == pytest.approx(0.9 * 1.05)  # lower is better: above O0
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_new_run_dir_is_fresh_even_within_one_second(tmp_path):
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    first, second = new_run_dir(str(tmp_path), now), new_run_dir(str(tmp_path), now)
    assert os.path.basename(first) == "20260102-030405" and os.path.basename(second) == "20260102-030405-2"
    assert os.listdir(first) == os.listdir(second) == []


def _hparams(run_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(run_dir)
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    figures = {t: acc.Scalars(t)[-1].value for t in acc.Tags()["scalars"] if t.startswith("hparam/")}
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()} | figures


def test_tensorboard_run_per_invocation_with_hparams(tmp_path):
    args = ["compare", "--out", str(tmp_path), "--device", "cpu", "--task", TASKS + ":tiny_task", "--modes",
            "torch-bf16", "--tensorboard", "--epochs", "1", "--steps-per-epoch", "2", "--val-steps", "1",
            "--no-progress", "--no-plot"]
    runs = []
    for _ in range(2):
        assert main(args) == 0
        with open(tmp_path / "report.json") as f:
            doc = json.load(f)
        runs.append(doc["tensorboard_run"])
    assert runs[0] != runs[1] and sorted(os.listdir(tmp_path / "tensorboard")) == sorted(map(os.path.basename, runs))
    for run in runs:
        assert sorted(os.listdir(run)) == ["O0", "torch-bf16"]
    row = _hparams(os.path.join(runs[1], "torch-bf16"))
    m = doc["modes"][1]
    assert row["mode"] == "torch-bf16" and row["opt_level"] == "torch.amp" and row["status"] == "ok"
    assert row["optimizer"] == "torch.optim.SGD(fused=True)"
    assert row["hparam/time_per_epoch_s"] == pytest.approx(m["time_per_epoch"])
    assert row["hparam/val_metric"] == pytest.approx(m["val_metric"])
    assert "hparam/peak_memory_mb" not in row  # CPU memory is noise, kept out of the comparison


def test_tensorboard_hparams_of_the_lean_and_fp8_modes(tmp_path):
    assert main(["compare", "--out", str(tmp_path), "--device", "cpu", "--modes", "O2-bf16-rem,O2-bf16-fp8",
                 "--tensorboard", "--epochs", "1", "--steps-per-epoch", "1", "--val-steps", "1", "--no-progress",
                 "--no-plot"]) == 0
    with open(tmp_path / "report.json") as f:
        doc = json.load(f)
    for m in doc["modes"]:
        row = _hparams(os.path.join(doc["tensorboard_run"], m["mode"]))
        assert m["emulated"] is (m["mode"] == "O2-bf16-fp8") and row["emulated"] == ("yes" if m["emulated"] else "no")
        assert row["hparam/state_bytes_per_param"] == m["state_bytes_per_param"] > 0
        assert row["hparam/master_bytes_per_param"] == m["master_bytes_per_param"]
    assert [m["master_bytes_per_param"] for m in doc["modes"]] == [0, 2, 4]  # O0, rem, fp8 (an fp32 master)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's version action exits, through main's parse too
        from mixprec.cli.main import build_parser
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"mixprec {mixprec.__version__} (torch {torch.__version__})"] * 2


def test_env_fields(capsys):
    assert main(["env"]) == 0
    fields = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    for key in ("mixprec", "mixprec built against torch", "mixprec CUDA kernels", "mixprec CUDA architectures",
                "torch", "CUDA runtime", "CUDA driver", "Python", "platform", "CPU"):
        assert fields.get(key), (key, fields)
    assert fields["mixprec"].startswith(mixprec.__version__) and fields["torch"].startswith(torch.__version__)
    cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("mixprec::adam_", "CUDA")
    assert fields["mixprec CUDA kernels"].startswith("built" if cuda_kernels else "not built")
    gpu_keys = [k for k in fields if re.fullmatch(r"GPU( \d+)?", k)]
    assert gpu_keys == (["GPU"] if not torch.cuda.is_available() else
                        [f"GPU {i}" for i in range(torch.cuda.device_count())])


def test_env_reads_the_recorded_architectures(tmp_path, monkeypatch):
    from mixprec import _library

    (tmp_path / "libmixprec.so").write_bytes(b"")
    (tmp_path / env_cli.BUILD_INFO).write_text(json.dumps(
        {"mixprec": "0.1.0", "torch": "2.13.0", "cuda_kernels": True, "cuda_architectures": ["80", "90a"],
         "cuda_compiler": "13.0.48"}))
    monkeypatch.setattr(_library, "library_path", lambda: str(tmp_path / "libmixprec.so"))
    fields = dict(env_cli.collect())
    assert fields["mixprec CUDA architectures"] == "sm_80, sm_90a"
    assert fields["mixprec CUDA compiler"] == "nvcc 13.0.48"
    (tmp_path / env_cli.BUILD_INFO).unlink()
    assert dict(env_cli.collect())["mixprec CUDA architectures"].startswith("not recorded by this build")
    assert env_cli._covered((9, 0), ["80", "90a"]) and env_cli._covered((8, 6), ["80"])
    assert not env_cli._covered((8, 0), ["86", "90"]) and not env_cli._covered((10, 0), ["90"])


def test_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit):
        from mixprec.cli.main import build_parser
        build_parser().parse_args(["compare", "--help"])
    text = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    assert len(options) > 10
    for option in options:  # "default: X" (argparse's or ours) at most once per option
        assert len(re.findall(r"default(?::| is)", option, re.IGNORECASE)) <= 1, option
    assert "(default: None)" not in text and "(default: 3)" in text
    assert main(["env", "--help"]) == 0


def _compare_args(out) -> list:
    return ["compare", "--out", str(out), "--device", "cpu", "--task", TASKS + ":tiny_task", "--modes", "O0",
            "--epochs", "1", "--steps-per-epoch", "1", "--val-steps", "1", "--no-progress"]


def test_compare_without_matplotlib_measures_and_says_why_there_is_no_plot(tmp_path, monkeypatch, capsys):
    # matplotlib is an optional extra (mixprec[plot]): by default its absence costs only the figure.
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(_compare_args(tmp_path)) == 0
    assert (tmp_path / "report.json").exists() and not (tmp_path / "curves.png").exists()
    assert "no curves.png" in capsys.readouterr().out


def test_compare_plot_asked_for_without_matplotlib_is_refused_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(_compare_args(tmp_path) + ["--plot"]) == 2
    assert "mixprec[plot]" in capsys.readouterr().err and not (tmp_path / "report.json").exists()
