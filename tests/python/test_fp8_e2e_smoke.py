# Smoke test of benchmarks/e2e_fp8.py on the CPU: the tiny decoder trains under every variant
# available here (FP8 through the CPU emulation), with finite falling losses, and the cast kernels time.
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def test_tiny_run_writes_comparable_results(tmp_path):
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, os.path.join(BENCH, "e2e_fp8.py"), "--tiny", "--device", "cpu", "--steps", "4",
           "--warmup", "1", "--lr", "3e-3", "--cast-size", "64", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["torch.amp bf16", "O2 bf16", "O2 bf16 fp8", "torchao float8"]
    for name in ("torch.amp bf16", "O2 bf16", "O2 bf16 fp8"):
        r = rows[name]
        assert r["status"] == "ok", (name, r["status"])
        assert math.isfinite(r["final_loss"]) and r["final_loss"] < r["first_loss"], (name, r)
        assert r["tokens_per_s"] > 0
    assert rows["O2 bf16 fp8"]["fp8_layers"] == 9  # 4 per block x 2 blocks, and the LM head
    assert rows["torchao float8"]["status"].startswith("skipped")  # CPU: never measured here
    assert {c["kernel"] for c in data["cast"]} >= {"mixprec cast+amax", "torch cast (clamp, to)"}
    assert "torchao.float8:" in proc.stdout
