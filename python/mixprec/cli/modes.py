"""Precision modes `mixprec compare` knows: every amp opt level in float16 and in bfloat16 (O0
is plain fp32), named like ``O2-bf16``, and the torch.amp baselines ``torch-fp16``/``torch-bf16``
that answer "should I switch"; new opt levels in mixprec.amp appear here by themselves. Four lean
variants of the bf16 levels follow them (VARIANTS): ``O2-bf16-rem`` (int16 remainders for
fp32 masters), ``O2-bf16-rem-q8`` (and 8-bit Adam moments), ``O3-bf16-sr`` (pure bf16, stochastic rounding) and ``O2-bf16-fp8``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..amp import opt_levels

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BASELINE = "O0"
TORCH_AMP = "torch.amp"  # the opt_level of the torch.amp baseline modes
TORCH_PREFIX = "torch"


@dataclass(frozen=True)
class Mode:
    name: str
    opt_level: str
    dtype: torch.dtype  # the low-precision dtype (float32 for O0)
    variant: str = ""  # "" or a key of VARIANTS: the lean option on top of opt_level


    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


# name suffix -> (opt level, what the mode changes), all in bfloat16: the remainder and stochastic
# rounding are options of mixprec's fused optimizers; fp8 is amp.initialize(fp8=True).
VARIANTS = {
    # "rem", not "remainder": the table is 100 columns at most and the mode column is its widest.
    "rem": ("O2", "master_weights='remainder': a bf16 weight plus an int16 remainder, not an fp32 master"),
    "rem-q8": ("O2", "O2-bf16-rem with FusedAdam's state_dtype=torch.int8: 8-bit block-quantized moments"),
    "sr": ("O3", "pure bf16 weights (no masters), the fused optimizer's rounding='stochastic'"),
    "fp8": ("O2", "fp8=True: the eligible nn.Linears in FP8 (emulated on a CPU)"),
}
# Not in the CPU default: the CPU has no FP8 arithmetic, so its emulation is slow and its time
# says nothing about a GPU (ask for it by name, or with 'all').
CPU_EXCLUDED_VARIANTS = ("fp8",)


def is_torch_amp(name: str) -> bool:
    return name.startswith(TORCH_PREFIX + "-")


def label(name: str) -> str:
    """How a mode reads in a sentence: ``torch-bf16`` is "torch.amp bf16", an O-level its name."""
    return f"{TORCH_AMP} {name[len(TORCH_PREFIX) + 1:]}" if is_torch_amp(name) else name


def all_modes() -> dict[str, Mode]:
    modes = {}
    for level in sorted(opt_levels):
        if level == BASELINE:
            modes[level] = Mode(level, level, torch.float32)
        else:
            for suffix, dtype in DTYPES.items():
                modes[f"{level}-{suffix}"] = Mode(f"{level}-{suffix}", level, dtype)
    for variant, (level, _) in VARIANTS.items():
        if level in opt_levels:
            name = f"{level}-bf16-{variant}"
            modes[name] = Mode(name, level, torch.bfloat16, variant)
    for suffix, dtype in DTYPES.items():  # autocast (+ torch.amp.GradScaler in fp16), the task's torch optimizer
        name = f"{TORCH_PREFIX}-{suffix}"
        modes[name] = Mode(name, TORCH_AMP, dtype)
    return modes


def default_modes(device: torch.device) -> list[str]:
    """On a GPU, every mode. On a CPU, O0 and the bf16 modes (torch-bf16 among them): bf16 is the
    low precision CPUs accelerate (AVX-512 BF16, AMX), while float16 has few fast CPU kernels (on a 2-core AVX-512
    machine, O1-fp16 ran about 4x slower than O1-bf16 on the embedded task) and says little
    about a GPU; ask for the fp16 modes with --modes. On CPUs without AMX and on small models,
    bf16 is often slower than fp32; the compare then says so and recommends O0. The lean bf16
    variants are in both; O2-bf16-fp8 only on a GPU (on a CPU it is an emulation)."""
    modes = all_modes()
    if device.type == "cuda":
        return list(modes)
    return [n for n, m in modes.items() if n == BASELINE or (m.dtype == torch.bfloat16 and
                                                             m.variant not in CPU_EXCLUDED_VARIANTS)]


def parse_modes(spec: str, device: torch.device) -> list[Mode]:
    """A comma-separated list of mode names, ``all`` or ``default`` (case-insensitive; ``O2``
    alone means both O2-fp16 and O2-bf16, not the lean variants, which are asked for by name). O0, the baseline, is always run first. Raises
    ValueError naming an unknown mode and listing the known ones."""
    known = all_modes()
    by_lower = {k.lower(): k for k in known}
    chosen: list[str] = []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        key = raw.lower()
        if key == "all":
            chosen += list(known)
        elif key == "default":
            chosen += default_modes(device)
        elif key in by_lower:
            chosen.append(by_lower[key])
        elif any(k.startswith(key + "-") for k in by_lower):
            chosen += [by_lower[k] for k in by_lower if k.startswith(key + "-") and not known[by_lower[k]].variant]
        else:
            raise ValueError(f"unknown mode {raw!r} (known: {', '.join(known)}, all, default)")
    if not chosen:
        raise ValueError("no mode given")
    names = [BASELINE] + [n for n in dict.fromkeys(chosen) if n != BASELINE]
    return [known[n] for n in names]
