# Smoke tests of benchmarks/e2e_distributed.py (issue 9's DDP/FSDP2 benchmark) on the CPU: 1 and 2
# gloo ranks, both wraps, torch.amp fp16 and mixprec O2 on the tiny GPT; the figures are CPU noise,
# but every run must finish with finite losses, ranks that agree, and the derived ratios present.
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import assert_usage_error

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, os.path.abspath(BENCH))

import e2e_distributed  # noqa: E402

pytestmark = pytest.mark.distributed


def test_cpu_run_trains_every_wrap_and_variant_on_one_and_two_ranks(tmp_path):
    out = tmp_path / "dist.json"
    cmd = [sys.executable, os.path.join(BENCH, "e2e_distributed.py"), "--device", "cpu", "--tiny", "--steps", "1",
           "--warmup", "1", "--variants", "torch-fp16,mixprec-o2-fp16", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["wrap"], r["variant"], r["world"]) for r in rows} == {
        (w, v, n) for w in ("ddp", "fsdp2") for v in ("torch-fp16", "mixprec-o2-fp16") for n in (1, 2)}
    for r in rows:
        assert r["status"] == "ok" and r["ranks_agree"] is True, r
        assert math.isfinite(r["loss"]) and r["tok_s_per_gpu"] > 0
        assert (r["efficiency"] is not None) == (r["world"] == 2)
        assert (r["vs_peer"] is not None) == (r["variant"] != "torch-fp16")
    # One rank trains the same model on the same data under both wraps: the same loss.
    alone = {(r["wrap"], r["variant"]): r["loss"] for r in rows if r["world"] == 1}
    assert alone[("ddp", "torch-fp16")] == pytest.approx(alone[("fsdp2", "torch-fp16")], rel=1e-2)
    assert "Issue 9 bars" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--wraps", "zero3"], "zero3"),
    (["--device", "cpu", "--variants", "torch-fp32"], "torch-fp32"),
    (["--device", "cpu", "--backend", "nccl"], "needs --device cuda"),
    (["--device", "cpu", "--worlds", "1,two"], "comma list of integers"),
    (["--device", "cpu", "--worlds", "0"], ">= 1"),
    (["--device", "cpu", "--steps", "0"], "--steps"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, message, capsys):
    assert_usage_error(e2e_distributed.parse_args, argv, message, capsys)


def test_derive_takes_efficiency_from_one_rank_and_ratios_from_the_peer():
    def row(wrap, variant, world, tok):
        return {"wrap": wrap, "variant": variant, "world": world, "status": "ok", "tok_s_per_gpu": tok,
                "ranks_agree": True}

    rows = [row("ddp", "torch-fp16", 1, 100.0), row("ddp", "torch-fp16", 2, 95.0),
            row("ddp", "mixprec-o2-fp16", 1, 130.0), row("ddp", "mixprec-o2-fp16", 2, 117.0),
            {"wrap": "fsdp2", "variant": "torch-fp16", "world": 2, "status": "error: x"}]
    e2e_distributed.derive(rows)
    assert rows[1]["efficiency"] == pytest.approx(0.95) and rows[3]["efficiency"] == pytest.approx(0.9)
    assert rows[0]["efficiency"] is None and rows[1]["vs_peer"] is None
    assert rows[3]["vs_peer"] == pytest.approx(117.0 / 95.0)
    verdicts = e2e_distributed.bars(rows)
    assert "PASS ddp torch-fp16 on 2 ranks: scaling efficiency 95.0% (bar 90%)" in verdicts
    assert "PASS ddp mixprec-o2-fp16 on 2 ranks: scaling efficiency 90.0% (bar 90%)" in verdicts
    assert any(v.startswith("PASS ddp mixprec-o2-fp16 on 2 ranks: 1.232x") for v in verdicts)
