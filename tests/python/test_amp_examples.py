# docs/amp.md's recipes stay true: examples/python/amp_guide.py runs each one and checks what the
# guide says about it (losses fall, skips are counted, a resumed run is bit-identical, ...).
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "examples" / "python" / "amp_guide.py"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_amp_guide_recipes_run_as_documented(device):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MIXPREC_APEX_ALIAS", None)
    r = subprocess.run([sys.executable, str(GUIDE), "--device", device], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "all recipes ran as documented" in r.stdout, r.stdout + r.stderr
