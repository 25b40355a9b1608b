# The public API's type hints, as a user's type checker sees them: mypy checks tests/typing/user_code.py
# (assert_type on what amp.initialize, scale_loss and GradScaler return) against the installed package.
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

USER_CODE = Path(__file__).resolve().parents[1] / "typing" / "user_code.py"


def test_user_code_type_checks(tmp_path):
    pytest.importorskip("mypy", reason="mypy is installed by scripts/requirements.txt")
    # From an empty folder, so that mixprec resolves to the installed package (with its py.typed and
    # stubs) as in a user's project, not to the source tree; errors inside packages are not reported.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", sys.executable, "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", "--warn-unused-ignores", str(USER_CODE)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mypy found type errors in user code:\n{result.stdout}{result.stderr}"
