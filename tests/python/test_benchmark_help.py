# Every benchmark script answers --help: argparse formats help strings with %, so a stray % in one
# (e2e_gpt2.py's "10% of the steps") crashed --help with a TypeError until this test existed.
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
# The runnable scripts; common.py's __main__ is the shared helpers' self-check, with no options.
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.py"))
                 if 'if __name__ == "__main__"' in open(p, encoding="utf-8").read()
                 and os.path.basename(p) != "common.py")


def test_the_scripts_were_found():
    assert {"e2e_gpt2.py", "loss_scale_ops.py", "optimizer_step.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage(script):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--help"], capture_output=True, text=True,
                          timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-3000:]}"
    assert "usage:" in proc.stdout, proc.stdout[:2000]
