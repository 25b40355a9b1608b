# Smoke test of benchmarks/layer_kernels.py on the CPU: every candidate bias gradient passes its
# float64 check and is timed, the weight+bias and LayerNorm rows (torch's and mixprec's) appear,
# and the JSON holds them (the CUDA figures
# are the script's purpose and come from the GPU machine).
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, os.path.abspath(BENCH))

import layer_kernels  # noqa: E402


def test_cpu_quick_run_checks_and_times_every_candidate(tmp_path, capsys):
    out = tmp_path / "layer_kernels.json"
    layer_kernels.main(["--device", "cpu", "--quick", "--sizes", "small", "--runs", "2", "--warmup", "0",
                        "--threads", "1", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    bias = [r for r in results if r["kernel"].startswith("bias grad")]
    assert {r["candidate"] for r in bias} == set(layer_kernels.candidates(256))
    assert len(bias) == 2 * 4 * len(layer_kernels.candidates(256))  # 2 dtypes x 4 Linears of a block
    assert all(r["us"] > 0 and r["rel_err"] < 1e-2 and r["calls"] == 12 for r in bias)
    norms = [r for r in results if r["kernel"].startswith("layer_norm")]
    assert len(norms) == 2 * 2 * 2 and all(r["calls"] == 25 for r in norms)  # dtypes x passes x torch/mixprec
    assert {r["candidate"] for r in norms} == {"torch", "mixprec.layer_norm"}
    params = [r for r in results if r["kernel"].startswith("weight+bias grad")]
    assert len(params) == 2 * 4 * 3 and all(r["rel_err"] < 1e-2 for r in params)
    assert "bias grad mlp.c_fc" in capsys.readouterr().out


def test_a_wrong_candidate_is_refused_before_timing(monkeypatch):
    monkeypatch.setattr(layer_kernels, "candidates", lambda rows: {"torch sum(0)": lambda g: g.sum(0),
                                                                   "off by one row": lambda g: g[1:].sum(0)})
    with pytest.raises(SystemExit, match="off by one row"):
        layer_kernels.bench_bias_grads("small", 256, torch.float16, torch.device("cpu"), None, 1, 0)
