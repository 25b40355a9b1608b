"""The scaling state of one FP8 Linear: for each of its three cast tensors (input, weight, output
gradient) a scale, the amax collected since the last update and an amax history, all on the
device so that no step waits on the host; plus optional saturation counters for diagnostics."""

from __future__ import annotations

import torch

from .. import _ops_fp8
from . import distributed
from .recipe import FP8_MAX, Fp8Recipe

#: The cast tensors of a Linear, in the order of the state's rows.
ROLES = ("input", "weight", "grad_output")


class Fp8ScalingState(torch.nn.Module):
    """Buffers ``scale`` [3], ``amax`` [3] and ``amax_history`` [3, history_len] (float32; rows
    in :data:`ROLES` order). Its ``state_dict()`` holds tensors only (``torch.load(...,
    weights_only=True)`` reads it back); loading checks the shapes against this recipe's."""

    def __init__(self, recipe: Fp8Recipe, device=None) -> None:
        super().__init__()
        self.recipe = recipe
        self.register_buffer("scale", torch.ones(3, device=device))
        self.register_buffer("amax", torch.zeros(3, device=device))
        self.register_buffer("amax_history", torch.zeros(3, recipe.history_len, device=device))
        # Diagnostics (mixprec.diagnostics.fp8_report): element and saturated-element counts per
        # role, counted only while track_saturation is on (it costs a pass over each cast).
        self.track_saturation = False
        self.register_buffer("saturation", torch.zeros(3, 2, dtype=torch.float64, device=device), persistent=False)

    def dtype_of(self, role: int) -> torch.dtype:
        return self.recipe.backward_dtype if role == 2 else self.recipe.forward_dtype

    def _row(self, role: int):
        return self.scale[role:role + 1], self.amax[role:role + 1], self.amax_history[role]

    def quantize(self, x: torch.Tensor, role: int, transpose: bool):
        """``x`` (2-D, contiguous) cast to its role's FP8 dtype, with its transpose when asked;
        returns ``(x_fp8, x_fp8_t or None, inverse scale)``. Current scaling measures x first;
        delayed scaling uses the history and records x's amax during the cast. Under a process
        group (:func:`distributed.group_of`) the amaxes are the max over its ranks: current scaling
        reduces each one before its cast (it exists only then), delayed scaling reduces all
        pending ones of a direction in one collective before the first of them is used."""
        scale, amax, history = self._row(role)
        dtype = self.dtype_of(role)
        r = self.recipe
        group = distributed.group_of(r)
        if r.scaling == "current":
            _ops_fp8.fp8_amax_(x, amax)
            if group is not None:
                distributed.all_reduce_max_(amax, group)
            _ops_fp8.fp8_update_scale_(scale, history, amax, dtype, r.margin, "most_recent")
            out, out_t = _ops_fp8.fp8_quantize(x, scale, dtype, transpose=transpose)
        else:
            reducer = distributed.delayed_reducer(group) if group is not None else None
            if reducer is not None:
                reducer.before_update(self, role)
            _ops_fp8.fp8_update_scale_(scale, history, amax, dtype, r.margin, r.amax_reduction)
            out, out_t = _ops_fp8.fp8_quantize(x, scale, dtype, transpose=transpose, amax=amax)
            if reducer is not None:
                reducer.after_cast(self, role)
        if self.track_saturation:
            # Clipped, not merely at the max: under current scaling the amax element lands exactly there.
            clipped = (x.float().abs() * scale > FP8_MAX[dtype]).sum().double()
            counts = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), clipped])
            self.saturation[role].add_(counts)
        # The inverse is the dequantization factor _scaled_mm multiplies in (a device op, no sync).
        # It is NaN when x held inf or NaN: the cast saturated those, and the GEMM's output must
        # still show them (a loss scaler's overflow check, the NaN that stops a diverged run).
        seen = amax if r.scaling == "delayed" else history[0:1]
        return out, out_t, torch.where(seen.isfinite(), scale.reciprocal(), torch.nan)

    def last_amax(self) -> torch.Tensor:
        """The most recent amax of each role (history row 0, or the amax not yet pushed)."""
        pending = self.amax
        return torch.where(pending != 0, pending, self.amax_history[:, 0])

    def check_state_dict(self, state_dict, where: str) -> None:
        """Raises, naming ``where`` and the key, unless ``state_dict`` is one this state can load:
        exactly its three float tensors, shaped as this recipe keeps them, scales finite and > 0."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where}: expected a dict of tensors, got {type(state_dict).__name__}")
        expected = dict(self.state_dict())
        if set(state_dict) != set(expected):
            raise KeyError(f"{where}: keys {sorted(state_dict)} != the expected {sorted(expected)}")
        for key, mine in expected.items():
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != mine.shape:
                got = f"shape {tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)
                raise ValueError(f"{where}[{key!r}]: expected a float tensor of shape {tuple(mine.shape)} (recipe "
                                 f"scaling={self.recipe.scaling!r}, amax_history_len="
                                 f"{self.recipe.amax_history_len}), got {got}")
        scale = state_dict["scale"].detach().double()
        if not bool(((scale > 0) & scale.isfinite()).all()):
            raise ValueError(f"{where}['scale']: every scale must be finite and > 0, got {scale.tolist()}")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Checks all of ``state_dict`` first (a refused one changes nothing), then loads it."""
        self.check_state_dict(state_dict, "mixprec.fp8.Fp8ScalingState.load_state_dict: state_dict")
        with torch.no_grad():
            for key, mine in self.state_dict().items():
                mine.copy_(state_dict[key])
        return torch.nn.modules.module._IncompatibleKeys([], [])
