"""Which model gradients amp has accounted for under O2, so that a step or a scale_loss block can
refuse gradients it never unscaled (a backward outside scale_loss, an in-place change after it)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

PLAIN, SWAP, FUSED_MASTERS = "plain", "swap", "fused_masters"


def stray_message(stray: str) -> str:
    return (f"{stray} has a gradient amp did not unscale: a backward outside `with amp.scale_loss(loss, "
            "optimizer) as scaled_loss: scaled_loss.backward()`, or an in-place change after it (clip "
            "amp.master_params(optimizer), not model.parameters()); under amp's O2 its fp32 master receives "
            "gradients only through scale_loss")


class GradMarks:
    """AmpStash's marks: each watched param's gradient as amp last saw it (a weak reference and its
    version counter). Expects ``kind``, ``optimizer``, ``low_params`` and ``grad_marks``."""

    def _watched(self) -> list[torch.Tensor]:
        """The model params whose gradients amp marks: every low-precision one under SWAP; under
        FUSED_MASTERS, whose hot path must not loop over params each step, the first and last
        low-precision ones (a stray backward reaches both, as a rule)."""
        if self.kind == SWAP:
            return self.low_params
        if self.kind != FUSED_MASTERS:
            return []
        groups = self.optimizer.param_groups
        first = next((p for g in groups for p in g["params"] if p.dtype != torch.float32 and p.requires_grad), None)
        if first is None:
            return []
        last = next(p for g in reversed(groups) for p in reversed(g["params"])
                    if p.dtype != torch.float32 and p.requires_grad)
        return [first] if last is first else [first, last]

    def note_grads(self) -> None:
        """The watched gradients are the ones amp has accounted for (unscaled, checked or zeroed)."""
        if self.kind != PLAIN:
            self.grad_marks = {id(p): (weakref.ref(p.grad), p.grad._version) if p.grad is not None else None
                               for p in self._watched()}

    def stray_gradient(self) -> Optional[str]:
        """Which watched param holds a gradient amp has not seen (a backward outside scale_loss, an
        in-place change after it, or a GradScaler's), if any."""
        for p in self._watched():
            g = p.grad
            if g is None:
                continue
            mark = self.grad_marks.get(id(p))
            if mark is None or mark[0]() is not g or mark[1] != g._version:
                return f"the model's {p.dtype} parameter of shape {tuple(p.shape)}"
        return None
