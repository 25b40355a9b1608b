"""Per-layer FP8 diagnostics: each FP8 Linear's last amax, scale and (while tracked) the share of
elements its casts saturated, for the input, the weight and the output gradient. Reads the
device state on the host: a debugging aid, not for every step of a production run."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .linear import Fp8Linear
from .state import ROLES


@dataclass
class Fp8TensorReport:
    role: str                         # "input", "weight" or "grad_output"
    dtype: torch.dtype
    amax: float                       # the most recent amax (0 before the first cast)
    scale: float                      # the scale the next cast uses (current scaling: the last one used)
    history_max: float                # max over the amax history (what delayed scaling divides by)
    saturated_share: Optional[float]  # clipped elements / elements cast while tracked; None if never tracked


@dataclass
class Fp8LayerReport:
    name: str
    tensors: list[Fp8TensorReport]
    fallbacks: int                    # calls that ran plain F.linear (token count not a multiple of 16)


def _layers(model: torch.nn.Module) -> Iterator[tuple[str, Fp8Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            yield name, module


def fp8_report(model: torch.nn.Module) -> list[Fp8LayerReport]:
    """One entry per :class:`~mixprec.fp8.Fp8Linear` of ``model`` (an empty list if it has none)."""
    reports = []
    for name, layer in _layers(model):
        st = layer.fp8_state
        amax, scale = st.last_amax().tolist(), st.scale.tolist()
        hist = st.amax_history.nan_to_num(nan=math.inf).amax(dim=1).tolist()
        sat = st.saturation.tolist()
        tensors = [Fp8TensorReport(role, st.dtype_of(i), amax[i], scale[i], hist[i],
                                   sat[i][1] / sat[i][0] if sat[i][0] else None) for i, role in enumerate(ROLES)]
        reports.append(Fp8LayerReport(name, tensors, st.fallbacks))
    return reports


@contextlib.contextmanager
def track_saturation(model: torch.nn.Module, reset: bool = True):
    """Counts, inside the block, the elements each FP8 cast of ``model`` clips (|x| * scale past
    the format's max); :func:`fp8_report` then gives their share. Costs a pass per cast."""
    layers = [layer for _, layer in _layers(model)]
    for layer in layers:
        if reset:
            layer.fp8_state.saturation.zero_()
        layer.fp8_state.track_saturation = True
    try:
        yield
    finally:
        for layer in layers:
            layer.fp8_state.track_saturation = False


def format_fp8_report(reports: list[Fp8LayerReport]) -> str:
    """The report as a table, one line per layer and tensor."""
    lines = [f"{'layer':30} {'tensor':12} {'dtype':14} {'amax':>11} {'scale':>11} {'saturated':>10}"]
    for r in reports:
        for t in r.tensors:
            share = "-" if t.saturated_share is None else f"{100 * t.saturated_share:.3f}%"
            lines.append(f"{r.name:30} {t.role:12} {str(t.dtype).replace('torch.', ''):14} {t.amax:11.4g} "
                         f"{t.scale:11.4g} {share:>10}")
        if r.fallbacks:
            lines.append(f"{r.name:30} ({r.fallbacks} calls in higher precision: shapes FP8 cannot take)")
    return "\n".join(lines)
