# Tests of the mixprec package itself: import without CUDA initialization, the CMake package
# config it ships, and the loud, actionable ImportErrors of python/mixprec/_library.py.
from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec import _library


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (this one has torch and mixprec imported already)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_import_does_not_initialize_cuda():
    # Also after a CPU op: loading or calling must not create a CUDA context (fork safety,
    # CUDA_VISIBLE_DEVICES set late, processes without a GPU).
    r = run_python("""
        import torch, mixprec
        print("after import", torch.cuda.is_initialized())
        mixprec.multi_tensor_norm([torch.ones(3)])
        found = torch.zeros(1)
        mixprec.non_finite_check_and_unscale_([torch.ones(3)], found, torch.ones(1))
        print("after ops", torch.cuda.is_initialized())
    """)
    assert r.returncode == 0, r.stderr
    assert "after import False" in r.stdout and "after ops False" in r.stdout, r.stdout


def test_version_matches_the_installed_distribution():
    assert mixprec.__version__ == importlib.metadata.version("mixprec")


def test_distribution_ships_its_license_and_type_marker():
    meta = importlib.metadata.metadata("mixprec")
    assert meta["License-Expression"] == "BSD-3-Clause", meta.get_all("License-Expression")
    assert "Typing :: Typed" in meta.get_all("Classifier")
    files = [str(f) for f in importlib.metadata.files("mixprec")]
    assert any(f.endswith("LICENSE") for f in files), files[:20]
    assert os.path.isfile(os.path.join(os.path.dirname(mixprec.__file__), "py.typed"))


def test_cmake_prefix_path_holds_the_package_config():
    prefix = mixprec.cmake_prefix_path
    assert os.path.isdir(prefix), prefix
    # find_package(mixprec) looks in <prefix>/, <prefix>/mixprec*/ and <prefix>/(lib*|share)/cmake/mixprec*/.
    patterns = ["mixprecConfig.cmake", "mixprec*/mixprecConfig.cmake", "*/cmake/mixprec*/mixprecConfig.cmake"]
    configs = [p for pat in patterns for p in glob.glob(os.path.join(prefix, pat))]
    assert configs, f"no mixprecConfig.cmake where find_package looks under {prefix}"
    folder = os.path.dirname(configs[0])
    version_file = os.path.join(folder, "mixprecConfigVersion.cmake")
    assert os.path.isfile(version_file)
    with open(version_file) as f:
        assert f'"{mixprec.__version__}"' in f.read(), "mixprecConfigVersion.cmake disagrees with __version__"
    with open(configs[0]) as f:
        config = f.read()
    assert "find_dependency(Torch" in config, "the config must pull in Torch for its users"
    # The public header the config's target exports is installed beside the package.
    assert glob.glob(os.path.join(os.path.dirname(mixprec.__file__), "include", "mixprec", "ops.h"))


def test_missing_library_raises_an_actionable_import_error(tmp_path, monkeypatch):
    # The loader pointed at a package folder without lib/: library_path() and load() both fail.
    monkeypatch.setattr(_library, "_PACKAGE_DIR", str(tmp_path))
    monkeypatch.setattr(_library, "_loaded", False)
    for call in (_library.library_path, _library.load):
        with pytest.raises(ImportError) as err:
            call()
        msg = str(err.value)
        assert "mixprec" in msg and str(tmp_path) in msg, msg
        assert "pip install" in msg and "./scripts/test.sh" in msg, f"says what to do: {msg}"


def test_import_from_a_copy_without_the_library_fails_loudly(tmp_path):
    # End to end: `import mixprec` from a package that lacks its compiled library (a source
    # checkout put on sys.path, say) is an ImportError naming the fix, not an AttributeError later.
    pkg = tmp_path / "mixprec"
    shutil.copytree(os.path.dirname(mixprec.__file__), pkg, ignore=shutil.ignore_patterns("lib", "__pycache__"))
    r = run_python("import mixprec", PYTHONPATH=str(tmp_path))
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "compiled library was not found" in r.stderr, r.stderr
    assert "pip install" in r.stderr, r.stderr


def test_torch_version_mismatch_raises_an_actionable_import_error():
    # A library built against another torch: pretend the running torch is another release.
    r = run_python("""
        import torch
        torch.__version__ = "2.99.0+fake"
        try:
            import mixprec
        except ImportError as e:
            print("ImportError:", e)
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ImportError:" in out, out
    assert "2.99.0+fake" in out and torch.__version__.split("+")[0] in out, f"names both versions: {out}"
    assert "Rebuild" in out and "pip install" in out, f"says what to do: {out}"


def test_same_release_with_another_local_tag_loads():
    # +cpu vs +cu130 builds of one release are ABI-compatible for mixprec: only the release counts.
    r = run_python("""
        import torch
        torch.__version__ = torch.__version__.split("+")[0] + "+othertag"
        import mixprec
        print("ok", mixprec.multi_tensor_norm([torch.ones(4)])[0].item())
    """)
    assert r.returncode == 0, r.stderr
    assert "ok 2.0" in r.stdout, r.stdout


def test_library_that_fails_to_load_raises_an_actionable_import_error(monkeypatch):
    # dlopen failing (undefined torch symbols: built against another torch) becomes an ImportError.
    def fail(path):
        raise OSError(f"{path}: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")

    monkeypatch.setattr(_library, "_loaded", False)
    monkeypatch.setattr(torch.ops, "load_library", fail)
    with pytest.raises(ImportError) as err:
        _library.load()
    msg = str(err.value)
    assert "undefined symbol" in msg and torch.__version__ in msg, msg
    assert "Rebuild" in msg and "pip install" in msg, f"says what to do: {msg}"
    assert isinstance(err.value.__cause__, OSError)


def test_ops_are_registered_for_cpu_and_meta():
    # Every op of library.cpp reaches Python, with CPU and Meta kernels (and CUDA in a CUDA build).
    for name in ("non_finite_check_and_unscale_", "update_scale_", "multi_tensor_norm"):
        op = getattr(torch.ops.mixprec, name).default
        for key in ("CPU", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), f"{name} has no {key} kernel"
        if torch.cuda.is_available():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"), f"{name} has no CUDA kernel"


def test_cmake_source_lists_name_every_source_file():
    # CMakeLists.txt builds what cmake/sources.cmake names, not what a glob finds: a new source file
    # must be added there (and a removed one taken out), or the build silently lacks it.
    root = Path(__file__).resolve().parents[2]
    listed = set(re.findall(r"^\s+(csrc/\S+)$", (root / "cmake" / "sources.cmake").read_text(), re.M))
    on_disk = {str(p.relative_to(root)) for ext in ("*.cpp", "*.cu") for p in (root / "csrc").rglob(ext)}
    assert sorted(on_disk - listed) == [], "sources not in cmake/sources.cmake"
    assert sorted(listed - on_disk) == [], "cmake/sources.cmake names files that do not exist"
