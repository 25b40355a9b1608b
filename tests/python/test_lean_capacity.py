# benchmarks/lean_capacity.py (issue 24's largest-model figure): the depth search finds the exact
# deepest depth that fits and sees the next one fail, whether the affine prediction is right, too
# high or too low; the lean variants it runs train on the CPU; the script's smoke run works end to end.
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, os.path.abspath(BENCH))

import lean_capacity  # noqa: E402
from lean_capacity import Attempt, search  # noqa: E402

BUDGET = 10_000


def oracle(peak_of):
    """A fake device: depth d needs peak_of(d) bytes and fits in BUDGET; records the depths tried."""
    tried = []

    def fits_at(d: int) -> Attempt:
        tried.append(d)
        peak = peak_of(d)
        return Attempt(d, peak <= BUDGET, peak if peak <= BUDGET else None, d, 0.0)
    return fits_at, tried


@pytest.mark.parametrize("peak_of", [
    lambda d: 100 + 37 * d,             # affine: the prediction is right
    lambda d: 100 + 37 * d + d * d,     # activations grow faster: the prediction is too deep
    lambda d: 2000 + 37 * d if d > 12 else 100 + 90 * d,  # the probes overstate the slope: too shallow
])
def test_search_finds_the_deepest_depth_and_sees_the_next_fail(peak_of):
    truth = max(d for d in range(1, 1000) if peak_of(d) <= BUDGET)
    fits_at, tried = oracle(peak_of)
    attempts = search(fits_at, (4, 12), BUDGET, max_tries=12)
    best = max(a.depth for a in attempts if a.fits)
    assert best == truth
    assert any(a.depth == truth + 1 and not a.fits for a in attempts)
    assert len(tried) == len(set(tried)) <= 14  # no depth trained twice, the budget of tries kept


def test_search_stops_when_even_the_first_probe_does_not_fit():
    fits_at, tried = oracle(lambda d: BUDGET + d)
    attempts = search(fits_at, (4, 12), BUDGET, max_tries=8)
    assert not any(a.fits for a in attempts) and len(tried) == 2


def test_search_keeps_its_budget_of_tries():
    fits_at, tried = oracle(lambda d: d)  # everything up to depth 10,000 fits: unbounded climb
    search(fits_at, (4, 12), 50, max_tries=5)  # a wrong budget: the climb would go on
    assert len(tried) == 7


def test_the_script_runs_the_lean_modes_on_the_cpu(tmp_path):
    out = tmp_path / "cap.json"
    cmd = [sys.executable, os.path.join(BENCH, "lean_capacity.py"), "--device", "cpu", "--tiny", "--budget-gib",
           "0.004", "--probe", "1,2", "--max-tries", "4", "--modes", "torch-bf16,mixprec-o2-bf16-rem-q8",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    # 8-bit moments and remainder masters keep fewer bytes per param than fp32 params, grads and
    # AdamW moments: the same budget holds a deeper model.
    assert rows["mixprec-o2-bf16-rem-q8"]["depth"] > rows["torch-bf16"]["depth"] >= 1


def test_kept_bytes_counts_each_storage_once():
    model = torch.nn.Linear(8, 8)
    model.weight.grad = torch.zeros_like(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["alias"] = model.weight.grad[1:]  # a view of a counted storage
    assert lean_capacity.kept_bytes(model, opt) == (64 + 8 + 64) * 4
