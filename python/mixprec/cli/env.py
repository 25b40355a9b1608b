"""`mixprec env`: the facts a bug report needs (mixprec, torch, CUDA runtime and driver, GPUs,
whether mixprec's CUDA kernels were built and for which architectures, Python, platform), as
aligned plain text to paste as it is."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Optional

import torch

BUILD_INFO = "mixprec_build_info.json"  # written by CMakeLists.txt beside the library


def build_info() -> Optional[dict]:
    """What the build recorded (CMakeLists.txt writes it beside libmixprec), or None for a library
    built before it was recorded."""
    from .. import _library

    path = os.path.join(os.path.dirname(_library.library_path()), BUILD_INFO)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _cuda_kernels_registered() -> bool:
    # The dispatcher is the authority on what the loaded library holds, whatever a file says.
    return torch._C._dispatch_has_kernel_for_dispatch_key("mixprec::adam_", "CUDA")


def _driver_version() -> Optional[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _covered(capability: tuple[int, int], archs: list[str]) -> bool:
    """Whether code built for ``archs`` (CMake's "80", "90a", ...) runs on a GPU of ``capability``:
    SASS runs on the same major version at an equal or higher minor one."""
    for arch in archs:
        digits = "".join(c for c in arch if c.isdigit())
        if len(digits) >= 2 and int(digits[:-1]) == capability[0] and int(digits[-1]) <= capability[1]:
            return True
    return False


def collect() -> list[tuple[str, str]]:
    """The report as (field, value) pairs, in the order printed."""
    import mixprec

    info = build_info()
    rows = [("mixprec", f"{mixprec.__version__} ({os.path.dirname(mixprec.__file__)})")]
    rows.append(("mixprec built against torch", torch.ops.mixprec._built_torch_version()))
    kernels = _cuda_kernels_registered()
    archs = [str(a) for a in (info or {}).get("cuda_architectures", [])]
    if info is None:
        arch_text = "not recorded by this build (rebuild mixprec to record it)"
    else:
        arch_text = ", ".join(f"sm_{a}" for a in archs) or "none"
    rows.append(("mixprec CUDA kernels", "built" if kernels else "not built (CPU kernels only)"))
    rows.append(("mixprec CUDA architectures", arch_text))
    if info is not None and info.get("cuda_compiler"):
        rows.append(("mixprec CUDA compiler", f"nvcc {info['cuda_compiler']}"))
    rows.append(("torch", f"{torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU'} "
                          f"build)"))
    rows.append(("CUDA runtime", torch.version.cuda or "none (CPU build of torch)"))
    cuda = torch.cuda.is_available()
    rows.append(("CUDA driver", (_driver_version() or "unknown") if cuda else "n/a (no GPU visible)"))
    if cuda and torch.backends.cudnn.is_available():
        rows.append(("cuDNN", str(torch.backends.cudnn.version())))
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cap = (p.major, p.minor)
            note = "" if not kernels or info is None else \
                ("" if _covered(cap, archs) else "; not among mixprec's built architectures")
            rows.append((f"GPU {i}", f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB{note}"))
    else:
        rows.append(("GPU", "none visible"))
    rows.append(("Python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"))
    rows.append(("platform", platform.platform()))
    rows.append(("CPU", f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, "
                        f"torch threads {torch.get_num_threads()}"))
    for name in ("matplotlib", "tensorboard", "tqdm", "numpy"):
        rows.append((name, _package_version(name)))
    return rows


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def render(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':{width + 1}} {v}" for k, v in rows)
