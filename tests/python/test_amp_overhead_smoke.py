# Smoke test of benchmarks/amp_overhead.py (issue 4's overhead benchmark): the script runs every
# variant on the CPU with tiny settings, writes JSON with a row per variant, a verdict per mixprec
# variant, and with --profile the counted calls per step and their difference from torch.amp's.
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def test_runs_every_variant_and_counts_calls(tmp_path):
    out = tmp_path / "amp_overhead.json"
    cmd = [sys.executable, os.path.join(BENCH, "amp_overhead.py"), "--device", "cpu", "--threads", "1",
           "--runs", "1", "--warmup", "1", "--steps", "2", "--batches", "2", "--width", "16", "--features", "8",
           "--profile", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    with open(out) as f:
        data = json.load(f)
    rows = data["results"]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("baseline") == 1 and kinds.count("peer") == 1 and kinds.count("mixprec") >= 6
    for r in rows:
        assert r["step_us"] > 0 and math.isfinite(r["loss_last"]), r["variant"]
        # Every step makes calls and runs Python; the difference is listed against the peer.
        assert r["ops_per_step"] > 10 and r["py_calls_per_step"] > 10, r["variant"]
        if r["kind"] == "mixprec":
            assert "mixprec::" in r["ops_vs_peer"], (r["variant"], r["ops_vs_peer"])
            assert 0 < r["vs_peer"] < math.inf
    assert len(data["verdicts"]) == kinds.count("mixprec")
    assert "calls per step" in proc.stdout
