"""The scaling state of one FP8 Linear: for each of its three cast tensors (input, weight, output
gradient) a scale, the amax collected since the last update and an amax history, all on the
device so that no step waits on the host; plus optional saturation counters for diagnostics.
The op mixprec::fp8_linear updates these tensors in place as it casts."""

from __future__ import annotations

import torch

from .recipe import Fp8Recipe

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
        # role, counted only for calls made while track_saturation is on (their backward included;
        # it costs a pass over each cast).
        self.track_saturation = False
        self.register_buffer("saturation", torch.zeros(3, 2, dtype=torch.float64, device=device), persistent=False)

    def dtype_of(self, role: int) -> torch.dtype:
        return self.recipe.backward_dtype if role == 2 else self.recipe.forward_dtype

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
