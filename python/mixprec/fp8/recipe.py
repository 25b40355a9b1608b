"""What an FP8 Linear casts to and how it picks its scales: the formats of the forward (input and
weight) and backward (output gradient) operands, and current or delayed per-tensor scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALINGS = ("current", "delayed")
REDUCTIONS = ("max", "most_recent")


@dataclass(frozen=True)
class Fp8Recipe:
    """How an :class:`~mixprec.fp8.Fp8Linear` runs its three GEMMs in FP8.

    - ``forward_dtype``: input and weight (default ``torch.float8_e4m3fn``: 3 mantissa bits).
    - ``backward_dtype``: the output gradient (default ``torch.float8_e5m2``: gradients need the
      range more than the precision); ``Fp8Recipe.e4m3()`` uses E4M3 everywhere.
    - ``scaling``: ``"current"`` (default) scales each tensor by ``fp8_max / amax`` of that very
      tensor (an extra read of it, never a saturated element); ``"delayed"`` uses the amax
      history of earlier steps (one read; an element past the history's max saturates).
    - ``amax_history_len`` and ``amax_reduction`` (``"max"`` or ``"most_recent"``): delayed
      scaling's window; current scaling keeps only the last amax.
    - ``margin``: scales are divided by ``2**margin`` (headroom for delayed scaling).
    - ``process_group``: the ranks whose amaxes are all-reduced with MAX before they become
      scales, so that every rank casts with the same scales. None (default): the default group
      when torch.distributed is initialized with more than one rank, else no reduction.
    """

    forward_dtype: torch.dtype = torch.float8_e4m3fn
    backward_dtype: torch.dtype = torch.float8_e5m2
    scaling: str = "current"
    amax_history_len: int = 16
    amax_reduction: str = "max"
    margin: float = 0.0
    process_group: Optional[Any] = None

    def __post_init__(self) -> None:
        for name in ("forward_dtype", "backward_dtype"):
            if getattr(self, name) not in FP8_DTYPES:
                raise TypeError(f"mixprec.fp8.Fp8Recipe: {name} must be torch.float8_e4m3fn or torch.float8_e5m2, "
                                f"got {getattr(self, name)!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"mixprec.fp8.Fp8Recipe: scaling must be 'current' or 'delayed', got {self.scaling!r}")
        if self.amax_reduction not in REDUCTIONS:
            raise ValueError(f"mixprec.fp8.Fp8Recipe: amax_reduction must be 'max' or 'most_recent', got "
                             f"{self.amax_reduction!r}")
        n = self.amax_history_len
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 65536:
            raise ValueError(f"mixprec.fp8.Fp8Recipe: amax_history_len must be an int in [1, 65536], got {n!r}")
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or not 0 <= m <= 64:
            raise ValueError(f"mixprec.fp8.Fp8Recipe: margin must be a number in [0, 64], got {m!r}")
        g = self.process_group
        if g is not None and not isinstance(g, torch.distributed.ProcessGroup):
            raise TypeError(f"mixprec.fp8.Fp8Recipe: process_group must be None or a torch.distributed.ProcessGroup, "
                            f"got {type(g).__name__}")

    def __deepcopy__(self, memo) -> "Fp8Recipe":
        # Immutable, and a process group cannot be copied: a copied model shares its recipe.
        return self

    @classmethod
    def e4m3(cls, **kwargs) -> "Fp8Recipe":
        """E4M3 for the gradients too (more precision, 448 of range: scaling does the rest)."""
        return cls(forward_dtype=torch.float8_e4m3fn, backward_dtype=torch.float8_e4m3fn, **kwargs)

    @property
    def history_len(self) -> int:
        """The length of the amax history kept: 1 under current scaling."""
        return self.amax_history_len if self.scaling == "delayed" else 1
