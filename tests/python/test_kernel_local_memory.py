# The O2 Adam step's hot loops keep everything in registers: compiled by nvcc for sm_90 and read
# back as SASS (nvdisasm), no local-memory load or store in the AdamW and no-decay loops of the
# instances an O2 step runs. Local memory there cost 5% of the H200's copy bandwidth once
# (benchmarks/RESULTS.md, 2026-12-05); the build only warns about spills (-Xptxas=-warn-spills), and a
# spill outside the loops (a rare slow path, the general flag case) is harmless, so this test
# looks at the loops themselves. Needs nvcc and the nvidia-cuda-nvdisasm wheel (scripts/requirements.txt);
# runs without a GPU.
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# CMakeLists.txt's CUDA options for the kernel tier (no fast math, no FMA contraction), for sm_90.
NVCC_FLAGS = ["-std=c++17", "-arch=sm_90", "-O3", "-fmad=false", "--expt-relaxed-constexpr"]

# AdamOp<param, grad, moments, stores unscaled grads, weight path 0> as c++filt prints them: the
# O2 instances (fp16 or bf16 model and grads; fp32 or bf16 moments; with or without a grad_scale).
O2_INSTANCES = [f"AdamOp<{p}, {p}, {s}, {store}, 0>" for p in ("__half", "__nv_bfloat16")
                for s in ("float", "__nv_bfloat16") for store in ("false", "true")]


def nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        files = importlib.metadata.files("nvidia-cuda-nvdisasm") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "nvdisasm":
            return str(f.locate())
    return None


@pytest.fixture(scope="module")
def adam_sass(tmp_path_factory) -> dict[str, list[str]]:
    """Each kernel of csrc/kernels/cuda/adam.cu, demangled, with its SASS instructions."""
    nvcc, disasm, demangle = shutil.which("nvcc"), nvdisasm(), shutil.which("c++filt")
    if not (nvcc and disasm and demangle):
        pytest.skip(f"needs nvcc, nvdisasm and c++filt (found {nvcc}, {disasm}, {demangle})")
    cubin = tmp_path_factory.mktemp("sass") / "adam.cubin"
    subprocess.run([nvcc, *NVCC_FLAGS, "-I", str(ROOT / "csrc"), "-cubin", "-o", str(cubin),
                    str(ROOT / "csrc/kernels/cuda/adam.cu")], check=True, capture_output=True)
    listing = subprocess.run([disasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
    kernels: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        header = re.match(r"^\.text\.(\S+):$", line)
        if header:
            name = subprocess.run([demangle, header.group(1)], capture_output=True, text=True).stdout.strip()
            current = kernels.setdefault(name, [])
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if instruction and current is not None:
            current.append(instruction.group(1))
    return kernels


def flag_case_loops(instructions: list[str]) -> list[list[str]]:
    """The kernel's code cut at each unconditional EXIT: AdamOp returns from one loop per flag case
    (kernels/adam.h, AdamFlagCase), so the pieces before the last EXIT are the cases' loops (the
    first with the prologue), and what follows it are shared slow paths (division, square root)."""
    pieces, piece = [], []
    for ins in instructions:
        piece.append(ins)
        if ins == "EXIT":
            pieces.append(piece)
            piece = []
    return pieces


def local_memory_ops(piece: list[str]) -> int:
    return sum(1 for ins in piece if re.match(r"^(@!?U?P\w+\s+)?(LDL|STL)\b", ins))


@pytest.mark.slow
@pytest.mark.parametrize("instance", O2_INSTANCES)
def test_o2_adam_loops_use_no_local_memory(adam_sass, instance):
    matches = [name for name in adam_sass if f"{instance} >" in name]
    assert len(matches) == 1, f"{instance}: kernels found {matches}"
    counts = [local_memory_ops(loop) for loop in flag_case_loops(adam_sass[matches[0]])]
    # The AdamW and no-decay loops: none. The general one (every flag live) may spill.
    assert counts.count(0) >= 2, f"{instance}: local-memory loads/stores per flag-case loop {counts}"


def test_the_cut_finds_local_memory_where_there_is_some():
    # The checker itself: a predicated or plain LDL/STL counts, global and shared accesses do not.
    piece = ["LDG.E.128 R4, desc[UR4][R2.64]", "@P0 STL [R1], R2", "LDL.LU R3, [R1+0x4]", "STS [R0], R1",
             "@!P1 LDL R5, [R1]", "STG.E desc[UR4][R2.64], R4", "EXIT"]
    assert local_memory_ops(piece) == 3
    assert flag_case_loops(piece + ["BRA 0x0", "EXIT", "RET.REL.NODEC R2 0x0"]) == [piece, ["BRA 0x0", "EXIT"]]
