"""What amp checks of the model's params under O2 before a scale_loss block or a step changes
anything: which gradients it has accounted for, so that it can refuse ones it never unscaled (a
backward outside scale_loss, an in-place change after it), and that the model was not moved away
from the masters amp.initialize made."""

from __future__ import annotations

from collections import deque
from functools import partial
from itertools import repeat
from operator import attrgetter, is_not
from typing import Optional

import torch

PLAIN, SWAP, FUSED_MASTERS = "plain", "swap", "fused_masters"

_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")
_is_tensor = partial(is_not, None)  # (filter(None, ...) would ask a tensor for its truth value)
#: The attribute amp's mark is kept in, on the gradient tensor.
_MARK = "_mixprec_amp_seen_version"


def clear_grads(tensors: list[torch.Tensor]) -> None:
    """``t.grad = None`` for each, in one C-level pass."""
    deque(map(setattr, tensors, repeat("grad"), repeat(None)), maxlen=0)


def stray_message(stray: str) -> str:
    return (f"{stray} has a gradient amp did not unscale: a backward outside `with amp.scale_loss(loss, "
            "optimizer) as scaled_loss: scaled_loss.backward()`, or an in-place change after it (clip "
            "amp.master_params(optimizer), not model.parameters()); under amp's O2 its fp32 master receives "
            "gradients only through scale_loss")


class GradMarks:
    """AmpStash's marks: each watched param's gradient carries, as a Python attribute of the tensor
    itself, its version counter as amp last saw it. A gradient amp has not seen is a new tensor
    (no mark: a backward into a gradient set to None, a replaced ``.grad``) or the same one
    changed since (a backward accumulating into it, an in-place clip): its mark is missing or
    behind its version. Marking and checking are one C-level pass each (``map`` over attribute
    getters, tens of nanoseconds a param): no Python code runs per param on the hot path, and the
    mark dies with the gradient. Expects ``kind``, ``optimizer`` and ``low_params``."""

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
            grads = list(filter(_is_tensor, map(_GRAD, self._watched())))
            deque(map(setattr, grads, repeat(_MARK), map(_VERSION, grads)), maxlen=0)

    def stray_gradient(self) -> Optional[str]:
        """Which watched param holds a gradient amp has not seen (a backward outside scale_loss, an
        in-place change after it, or a GradScaler's), if any."""
        watched = self._watched()
        grads = list(map(_GRAD, watched))
        if not any(map(_is_tensor, grads)):
            return None  # (after zero_grad: nothing to read)
        # A missing gradient reads -1 on both sides; an unmarked one -1 against its version (>= 0).
        if list(map(getattr, grads, repeat(_MARK), repeat(-1))) == list(map(getattr, grads, repeat("_version"),
                                                                             repeat(-1))):
            return None
        for p, g in zip(watched, grads):
            if g is not None and getattr(g, _MARK, -1) != g._version:
                return f"the model's {p.dtype} parameter of shape {tuple(p.shape)}"
        return None

    def moved_param(self) -> Optional[str]:
        """A model param no longer on its fp32 master's device (the model was moved after
        amp.initialize, which made the masters where the params were), described; None if none.
        The first and last low-precision params: ``model.to(device)`` and ``model.cuda()`` move
        every one (the ops refuse a partial move's mixed devices themselves)."""
        if self.kind == PLAIN:
            return None
        if self.kind == SWAP:
            pairs = [(self.low_params[0], self.low_masters[0]), (self.low_params[-1], self.low_masters[-1])] \
                if self.low_params else []
        else:
            state = self.optimizer.state
            pairs = [(p, state[p].get("master_param", state[p].get("master_remainder")))
                     for p in self._watched() if p in state]
        for p, m in pairs:
            if m is not None and p.device != m.device:
                return (f"the model's {p.dtype} parameter of shape {tuple(p.shape)} is on {p.device}, but its fp32 "
                        f"master weight is on {m.device}, where amp.initialize made it: the model was moved after "
                        "amp.initialize (model.cuda(), .to(device)), and under O2 the optimizer steps the masters "
                        "(with its state) where they are. Move the model before amp.initialize, as Apex requires: "
                        "amp.initialize(model.cuda(), optimizer, ...)")
        return None
