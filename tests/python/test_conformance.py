# Conformance of the two fronts: every scenario of tests/conformance/scenarios.py run through the
# Python optimizers and through the C++ ones (the mixprec_conformance driver) gives the same bits.
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.jit._pickle  # noqa: F401 -- restore_type_tag, allowed when loading the driver's results

from conftest import assert_bitwise_equal

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))
import scenarios  # noqa: E402

# scripts/test.sh builds the driver with the GoogleTest suite and names it here.
DRIVER = Path(os.environ.get("MIXPREC_CONFORMANCE_DRIVER", ROOT / "build" / "tests-cpp" / "mixprec_conformance"))
ROWS = scenarios.table()


def _param(row: scenarios.Row):
    marks = [pytest.mark.xfail(reason=row.expected_difference, strict=True, raises=AssertionError)] if row.expected_difference else []
    return pytest.param(row, id=row.name, marks=marks)


@pytest.fixture(scope="module")
def cpp_results(tmp_path_factory):
    """The scenarios (fresh random inputs; MIXPREC_TEST_SEED replays) and the C++ front's results,
    from one run of the driver for all of them."""
    if not DRIVER.is_file() and "MIXPREC_CONFORMANCE_DRIVER" in os.environ:
        pytest.fail(f"MIXPREC_CONFORMANCE_DRIVER names {DRIVER}, which does not exist")  # CI built it: never skip
    if not DRIVER.is_file():
        pytest.skip(f"the C++ conformance driver is not built ({DRIVER}); scripts/test.sh builds it, or set "
                    "MIXPREC_CONFORMANCE_DRIVER to its path")
    env = os.environ.get("MIXPREC_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    print(f"MIXPREC_TEST_SEED={seed}  (test_conformance.py)")
    gen = torch.Generator().manual_seed(seed)
    inputs = {row.name: scenarios.make_inputs(row, gen) for row in ROWS}
    where = tmp_path_factory.mktemp("conformance")
    torch.save(list(inputs.values()), where / "scenarios.pt")
    run = subprocess.run([str(DRIVER), str(where / "scenarios.pt"), str(where / "results.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{DRIVER} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    # torch::pickle_save tags typed dicts with restore_type_tag: the one global allowed beyond tensors.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        results = torch.load(where / "results.pt", weights_only=True)
    return inputs, {r["name"]: r for r in results}


def _same(cpp, py, what):
    if py is None or cpp is None:
        assert cpp is None and py is None, f"{what}: C++ {cpp!r} vs Python {py!r}"
        return
    assert_bitwise_equal(cpp, py.detach(), what)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_fronts_agree_bit_for_bit(row, cpp_results):
    inputs, results = cpp_results
    cpp, py = results[row.name], scenarios.run_python(inputs[row.name])
    expected_error = "ValueError" if row.error or row.construct_error or row.bad_grad else None
    assert py["error"] == expected_error, f"Python front: {py['error']}"
    assert cpp["error"] == expected_error, f"C++ front: {cpp['error']}"
    assert py["unchanged"], "Python front: the refused step changed something"
    assert cpp["unchanged"], "C++ front: the refused step changed something"
    if row.construct_error:
        return
    n = len(py["params"])
    assert len(cpp["params"]) == n
    for i in range(n):
        _same(cpp["params"][i], py["params"][i], f"param {i}")
        _same(cpp["grads"][i], py["grads"][i], f"param {i} .grad")
        assert sorted(cpp["state"][i]) == sorted(py["state"][i]), f"param {i} state keys"
        for key in py["state"][i]:
            _same(cpp["state"][i][key], py["state"][i][key], f"param {i} state {key!r}")
    for g, (c, p) in enumerate(zip(cpp["steps"], py["steps"], strict=True)):
        _same(c, p, f"group {g} step")
    for g, (c, p) in enumerate(zip(cpp["group_tensors"], py["group_tensors"], strict=True)):
        _same(c, p, f"group {g} exp_avg_sq")
    assert cpp["scale"] == py["scale"], "GradScaler scale"


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name) for r in ROWS if r.error or r.construct_error
                                 or r.bad_grad])
def test_error_classes_agree_and_cpp_refuses_unchanged(row, cpp_results):
    """The error half of every error row, apart from the bits: the xfails above must not hide it."""
    inputs, results = cpp_results
    py_error = scenarios.run_python(inputs[row.name])["error"]
    assert py_error == results[row.name]["error"] == "ValueError"
    assert results[row.name]["unchanged"], "C++ front: the refused step changed something"


def test_table_covers_every_pair_of_factor_levels():
    """The table is pairwise-covering: any two levels of any two factors meet in some row."""
    rows = [r for r in ROWS if not r.construct_error and r.expected_difference is None]
    names = list(scenarios.FACTORS)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for va in scenarios.FACTORS[a]:
                for vb in scenarios.FACTORS[b]:
                    assert any(getattr(r, a) == va and getattr(r, b) == vb for r in rows), (a, va, b, vb)
