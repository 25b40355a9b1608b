# The torch.amp baseline modes of `mixprec compare` (torch-fp16, torch-bf16) on the CPU: they start
# from the O-levels' weights and data, really run in low precision, count fp16 overflows and
# diverge like the O-levels, and take torch.optim's counterpart of the task's optimizer.
from __future__ import annotations

import json
import os

import pytest
import torch

from mixprec.cli.main import main
from mixprec.cli.torch_amp import NoTorchEquivalent, optimizer_name, torch_optimizer
from mixprec.optimizers import FusedAdam, FusedLAMB, FusedSGD
from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_tasks.py")
TINY = ["--epochs", "1", "--steps-per-epoch", "2", "--val-steps", "1", "--no-progress", "--no-plot"]


def compare(tmp_path, *args) -> tuple[dict, dict]:
    """report.json, and its modes by name."""
    assert main(["compare", "--out", str(tmp_path), "--device", "cpu", *TINY, *args]) == 0
    with open(tmp_path / "report.json") as f:
        doc = json.load(f)
    return doc, {m["mode"]: m for m in doc["modes"]}


def test_baselines_start_from_the_o_levels_weights(tmp_path):
    doc, modes = compare(tmp_path, "--task", TASKS + ":tiny_task", "--modes", "O1,torch")
    assert list(modes) == ["O0", "O1-fp16", "O1-bf16", "torch-fp16", "torch-bf16"]
    assert all(m["status"] == "ok" and m["steps"] == 2 for m in modes.values())
    for dt in ("fp16", "bf16"):
        torch_mode, o1 = modes[f"torch-{dt}"], modes[f"O1-{dt}"]
        # The same weights, batch and autocast dtype give the same first loss, bit for bit; and
        # it is not O0's: the baseline really ran its linear layers in low precision.
        assert torch_mode["loss_curve"][0] == o1["loss_curve"][0] != modes["O0"]["loss_curve"][0]
        assert torch_mode["opt_level"] == "torch.amp" and torch_mode["optimizer"] == "torch.optim.SGD(fused=True)"
    assert modes["O0"]["optimizer"] == "torch.optim.SGD"
    assert modes["torch-fp16"]["scale_curve"] == [2.0**16] * 2 and modes["torch-bf16"]["scale_curve"] == [1.0] * 2
    rec = doc["recommendation"]
    assert rec["switch"] in (True, False) and rec["versus_torch"].startswith(("switch to mixprec", "stay with"))


def test_baselines_equal_fp32_where_autocast_casts_nothing(tmp_path):
    _, modes = compare(tmp_path, "--task", TASKS + ":elementwise_task", "--modes", "torch")
    first = {name: m["loss_curve"][0] for name, m in modes.items()}
    assert first["torch-fp16"] == first["torch-bf16"] == first["O0"], first


def test_torch_fp16_overflow_is_counted_and_diverges(tmp_path):
    assert main(["compare", "--out", str(tmp_path), "--device", "cpu", "--task", TASKS + ":rigged_task",
                 "--modes", "torch-fp16", "--patience", "3", "--epochs", "2", "--steps-per-epoch", "4",
                 "--no-progress", "--no-plot"]) == 0
    with open(tmp_path / "report.json") as f:
        doc = json.load(f)
    o0, fp16 = doc["modes"]
    assert o0["status"] == "ok"
    assert fp16["status"] == "diverged" and fp16["error"].startswith("loss non-finite for 3 steps in a row")
    assert fp16["skipped_steps"] == fp16["nan_loss_steps"] == fp16["steps"] == 3
    assert fp16["final_loss_scale"] == 2.0**13  # three backoffs from 2^16
    assert [e["kind"] for e in fp16["overflow_events"]] == ["nan_loss"] * 3
    assert "2.weight" in fp16["nonfinite_params"]
    assert doc["recommendation"]["reasons"]["torch-fp16"].startswith("diverged: loss non-finite")


def test_scale_stuck_at_its_floor_stops_torch_fp16_as_it_stops_o1(tmp_path):
    # Finite losses, gradients that overflow at any scale: both scalers halve from 2^16 to 1, and
    # --patience overflowing steps at the floor stop the mode, at the same step for both.
    assert main(["compare", "--out", str(tmp_path), "--device", "cpu", "--task", TASKS + ":grad_overflow_task",
                 "--modes", "O1-fp16,torch-fp16", "--patience", "3", "--epochs", "6", "--no-progress",
                 "--no-plot"]) == 0
    with open(tmp_path / "report.json") as f:
        _, o1, fp16 = json.load(f)["modes"]
    assert fp16["status"] == o1["status"] == "diverged"
    assert fp16["error"].startswith("loss scale stuck at its floor: torch.amp.GradScaler backed off on the last")
    assert fp16["steps"] == fp16["skipped_steps"] == o1["steps"] == o1["skipped_steps"] == 16
    assert fp16["final_loss_scale"] == o1["final_loss_scale"] == 1.0 and fp16["nan_loss_steps"] == 0
    assert fp16["overflow_events"][0]["kind"] == "overflow" and "0.weight" in fp16["nonfinite_params"]


def test_optimizer_torch_lacks_fails_only_the_baselines(tmp_path, capsys):
    doc, modes = compare(tmp_path, "--task", TASKS + ":lamb_task", "--modes", "O2-bf16,torch-bf16")
    assert [m["status"] for m in modes.values()] == ["ok", "ok", "failed"]
    assert modes["torch-bf16"]["error"].startswith("torch.optim has no counterpart of the task's FusedLAMB")
    assert doc["recommendation"]["reasons"]["torch-bf16"].startswith("failed: torch.optim has no counterpart")
    assert "Versus torch.amp: " in capsys.readouterr().out


def _params():
    return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]


def test_torch_optimizer_counterparts():
    p = _params()
    opt = torch_optimizer(FusedAdam([{"params": p[:1]}, {"params": p[1:], "lr": 5e-4}], lr=3e-3, weight_decay=0.01,
                                    betas=(0.8, 0.9)))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert optimizer_name(opt) == "torch.optim.AdamW(fused=True)"
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in opt.param_groups] == [
        (3e-3, 0.01, (0.8, 0.9)), (5e-4, 0.01, (0.8, 0.9))]
    assert [g["params"] for g in opt.param_groups] == [p[:1], p[1:]]  # the same Parameter objects
    assert type(torch_optimizer(FusedAdam(p, adam_w_mode=False))) is torch.optim.Adam
    sgd = torch_optimizer(FusedSGD(p, lr=0.1, momentum=0.9, nesterov=True))
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["nesterov"] and sgd.param_groups[0]["momentum"] == 0.9
    plain = torch_optimizer(torch.optim.Adam(p, lr=0.5, foreach=True))
    assert plain.defaults["fused"] is True and plain.param_groups[0]["lr"] == 0.5
    assert optimizer_name(FusedAdam(p)) == "mixprec.optimizers.FusedAdam"


class _Custom(torch.optim.SGD):
    pass


@pytest.mark.parametrize("make, message", [
    (lambda p: FusedLAMB(p), "torch.optim has no counterpart of the task's FusedLAMB"),
    (lambda p: FusedAdam(p, bias_correction=False), "FusedAdam has bias_correction=False, which torch.optim cannot"),
    (lambda p: FusedSGD(p, lr=0.1, wd_after_momentum=True), "has wd_after_momentum=True"),
    (lambda p: FusedAdam([{"params": p[:1]}, {"params": p[1:], "adam_w_mode": False}]), "(Adam, AdamW)"),
])
def test_torch_optimizer_refuses_what_torch_cannot_express(make, message):
    with pytest.raises(NoTorchEquivalent) as e:
        torch_optimizer(make(_params()))
    assert message in str(e.value)


def test_users_own_optimizer_class_is_kept():
    opt = _Custom(_params(), lr=0.1)
    assert torch_optimizer(opt) is opt
