# The Python examples of README.md and docs/*.md run as written, on the CPU: a newcomer copies them.
"""Each document is a session: its ```python blocks run in order in one fresh interpreter (a later
block may use what an earlier one defined), in an empty working directory. A block that cannot run
as written (it needs a GPU, several processes, or names the reader supplies) says so in its info
string, ```python fragment, which GitHub still highlights as Python; this test skips those.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TORCHVISION_FIX

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# An opening fence with its info string, the body, the closing fence (the same number of backticks).
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
FENCE = re.compile(r"^(?P<ticks>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=ticks)[ \t]*$", re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, list[str], str]]:
    """(line, info words, body) of every fenced block whose language is python."""
    blocks = []
    for m in FENCE.finditer(text):
        words = m.group("info").split()
        if words and words[0] == "python":
            blocks.append((text.count("\n", 0, m.start()) + 1, words[1:], m.group("body")))
    return blocks


def session(path: Path) -> str:
    """The runnable blocks of one document, joined, each under a comment naming its line."""
    parts = [f"# --- {path.name}, line {line}\n{body}"
             for line, flags, body in python_blocks(path.read_text()) if "fragment" not in flags]
    return "\n".join(parts)


def test_the_block_parser_sees_fences_and_flags():
    text = "x\n```python\na = 1\n```\n```python fragment\nb\n```\n````markdown\n```python\nc\n```\n````\n"
    assert python_blocks(text) == [(2, [], "a = 1\n"), (5, ["fragment"], "b\n")]


def test_unknown_flags_are_refused():
    # A typo ("fragmnet") would silently turn a fragment into a runnable block or the reverse.
    for path in DOCUMENTS:
        for line, flags, _ in python_blocks(path.read_text()):
            assert set(flags) <= {"fragment"}, f"{path.name}:{line}: unknown flags {flags} after ```python"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_document_examples_run_as_written(path, tmp_path):
    code = session(path)
    if not code:
        pytest.skip(f"{path.name} has no runnable Python block")
    script = tmp_path / f"{path.stem}_examples.py"
    script.write_text(f"{TORCHVISION_FIX}  # this harness's, not the example's: see conftest.py\n{code}")
    # The package under test, as the suite imports it (source tree or installed), and one thread:
    # the examples are tiny and CI's machine is shared.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    missing = MISSING_MODULE.search(result.stderr)
    if result.returncode != 0 and missing and missing.group(1).split(".")[0] != "mixprec":
        # An optional framework (docs/integrations.md: lightning, accelerate, transformers) that this
        # environment lacks; scripts/setup.sh installs them, so CI runs these examples.
        pytest.skip(f"{path.name}'s examples need {missing.group(1)}, not installed here")
    assert result.returncode == 0, f"{path.name}'s examples failed:\n{result.stdout}\n{result.stderr}"
