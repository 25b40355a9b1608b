"""`mixprec compare`'s O2-bf16-rem-q8 mode (remainder masters and FusedAdam's 8-bit moments): it runs,
its optimizer state is counted exactly, and tasks whose optimizer has no 8-bit moments skip it."""
from __future__ import annotations

import pytest
import torch

from amp_support import one_cpu_thread  # noqa: F401  (autouse fixture: tiny models, one thread)
from mixprec.cli import embedded
from mixprec.cli.lean import ModeSkipped, lean_options
from mixprec.cli.modes import all_modes, default_modes
from test_cli_lean_modes import CPU, TINY, compare


def test_q8_mode_runs_and_counts_codes_and_scales_exactly(tmp_path):
    assert "O2-bf16-rem-q8" in default_modes(CPU)
    code, doc = compare(tmp_path, "--modes", "O2-bf16-rem,O2-bf16-rem-q8", *TINY)
    assert code == 0 and doc["complete"]
    by = {m["mode"]: m for m in doc["modes"]}
    rem, q8 = by["O2-bf16-rem"], by["O2-bf16-rem-q8"]
    assert q8["status"] == rem["status"] and q8["steps"] == 2
    # Per param: fp32 moments 8 bytes; 8-bit ones 1 + 1 bytes of codes and two float32 scales per
    # 256 elements of each tensor (a partial last block counts whole). Same model as the task's.
    task = embedded.make_task(CPU)
    sizes = [p.numel() for p in task.model.parameters()]
    n = sum(sizes)
    scales = sum(8 * -(-s // 256) for s in sizes)
    assert q8["master_bytes_per_param"] == rem["master_bytes_per_param"] == 2
    assert q8["state_bytes_per_param"] == pytest.approx(rem["state_bytes_per_param"] - 8 + 2 + scales / n, rel=1e-12)


def test_q8_mode_skips_optimizers_without_8bit_moments():
    task = embedded.make_task(CPU)
    task.optimizer = torch.optim.SGD(task.model.parameters(), lr=0.1)
    with pytest.raises(ModeSkipped, match=r"master_weights='remainder' is an option of mixprec's fused optimizers"):
        lean_options(all_modes()["O2-bf16-rem-q8"], task, CPU, 0)
    from mixprec.optimizers import FusedSGD
    task.optimizer = FusedSGD(task.model.parameters(), lr=0.1)
    with pytest.raises(ModeSkipped, match=r"state_dtype=torch.int8 \(8-bit moments\) is an option of mixprec's "
                                          r"FusedAdam; this task's optimizer is FusedSGD"):
        lean_options(all_modes()["O2-bf16-rem-q8"], task, CPU, 0)
