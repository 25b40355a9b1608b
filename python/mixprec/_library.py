"""Finds and loads mixprec's compiled op library, with errors that say what to do."""

from __future__ import annotations

import glob
import os

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_REBUILD_HINT = (
    "Rebuild mixprec against the torch you run: `pip install --no-build-isolation --force-reinstall .` "
    "in the mixprec checkout (or ./scripts/test.sh, which sets everything up)."
)


def library_path() -> str:
    """The path of the shared library that registers torch.ops.mixprec (libmixprec.so)."""
    candidates = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "lib", "libmixprec.*")))
    if not candidates:
        raise ImportError(
            f"mixprec: the compiled library was not found under {os.path.join(_PACKAGE_DIR, 'lib')}. "
            "mixprec must be built, not imported from its source tree: run "
            "`pip install --no-build-isolation .` in the checkout (./scripts/test.sh does this)."
        )
    return candidates[0]


def _base_version(version: str) -> str:
    return version.split("+")[0]


def load() -> None:
    """Loads the library once. Does not initialize CUDA."""
    global _loaded
    if _loaded:
        return
    path = library_path()
    try:
        torch.ops.load_library(path)
    except OSError as err:
        raise ImportError(
            f"mixprec: loading {path} failed with torch {torch.__version__}: {err}. "
            f"It was most likely built against another torch. {_REBUILD_HINT}"
        ) from err
    built = torch.ops.mixprec._built_torch_version()
    if _base_version(built) != _base_version(torch.__version__):
        raise ImportError(
            f"mixprec: the library was built against torch {built} but torch {torch.__version__} is "
            f"imported. {_REBUILD_HINT}"
        )
    _loaded = True


_loaded = False


def cmake_prefix_path() -> str:
    """The folder to put on CMAKE_PREFIX_PATH so that find_package(mixprec) finds this install."""
    return os.path.join(_PACKAGE_DIR, "share", "cmake")
