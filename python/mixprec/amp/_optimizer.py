"""How amp.initialize processes an optimizer: fp32 master weights (Apex's swap of masters into the
param groups, or a mixprec fused optimizer's own masters), the gradient stash and unscale around
each scaled backward, and a patched step() that skips an overflowing step on the device."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from .. import _ops
from ..apex_compat.larc import LARC
from .._loss_scale import check_and_unscale_, combine_found
from .._step_guard import StepGuard
from ..distributed import agree_found_inf_
from ._grad_marks import FUSED_MASTERS, PLAIN, SWAP, GradMarks, clear_grads
from ._scaler import _amp_state

#: What amp takes as an optimizer: torch's, and apex.parallel.LARC, which wraps one without being
#: one (Apex's initialize, scale_loss and master_params take it too).
OPTIMIZER_TYPES = (torch.optim.Optimizer, LARC)

# Grad mode off around the work on gradients, as torch.no_grad() does (grads made by a
# create_graph backward require grad), without its decorator's ~10 Python calls per use: these
# run on every step. Use: prev = _grad_enabled(); _set_grad_enabled(False); try/finally restore.
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def _by_device(*lists):
    out: dict[torch.device, tuple[list, ...]] = {}
    for items in zip(*lists):
        d = items[0].device
        if d not in out:
            out[d] = tuple([] for _ in lists)
        for dst, x in zip(out[d], items):
            dst.append(x)
    return out


def _unscale_into(srcs: list[torch.Tensor], outs: list[torch.Tensor], found: Optional[dict],
                  inv: Optional[torch.Tensor]) -> None:
    """outs[i] = srcs[i] * inv in one pass per device (any float dtypes on both sides), setting
    found[device] when a source holds inf/NaN (found None: no check)."""
    for device, (s, o) in _by_device(srcs, outs).items():
        f = None
        if found is not None:
            f = found.get(device)
            if f is None:
                f = found[device] = torch.zeros((), dtype=torch.float32, device=device)
        scale = inv.to(device, non_blocking=True) if inv is not None else torch.ones((), device=device)
        pairs = [(a, b) for a, b in zip(s, o) if a.is_contiguous() and b.is_contiguous()]
        odd = [(a, b) for a, b in zip(s, o) if not (a.is_contiguous() and b.is_contiguous())]
        if pairs:
            _ops.non_finite_check_and_unscale_([a for a, _ in pairs], f, scale, out=[b for _, b in pairs])
        for a, b in odd:  # rare layouts: through a contiguous fp32 temporary
            tmp = a.float().contiguous()
            _ops.non_finite_check_and_unscale_([tmp], f, scale)
            b.copy_(tmp)


class AmpStash(GradMarks):
    """Per-optimizer amp state (Apex's ``optimizer._amp_stash``).

    ``kind``: PLAIN (models are masters: O0, O1, O3), SWAP (O2 with any optimizer that is not a
    mixprec fused one: fp32 masters replace the fp16/bf16 params in the param groups, as in
    Apex), FUSED_MASTERS (O2 with a mixprec fused optimizer: its ``master_weights`` keep the
    masters and its kernel writes the fp16/bf16 copy in the same pass).

    Under FUSED_MASTERS the model's low-precision gradients stay scaled after scale_loss (as
    Apex's fp16 model grads did) and the kernel unscales them: one read-only check per backward,
    no unscale pass. Fp32 master gradients (Apex's) are materialized only when something needs
    them: ``amp.master_params(optimizer)`` between backward and step (e.g. to clip), or a second
    backward before the step (several losses); the step then writes them back as scaled
    low-precision gradients (a power of two below the smallest scale involved, so nothing
    overflows) and checks them again.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str) -> None:
        self.kind = kind
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.optimizer = optimizer
        self.low_params: list[torch.Tensor] = []  # SWAP: the model's fp16/bf16 params
        self.low_masters: list[torch.Tensor] = []  # SWAP: their fp32 masters (in the param groups)
        self.master_ids: set[int] = set()
        self.stashed: dict[torch.Tensor, torch.Tensor] = {}
        self.params_have_scaled_gradients = False
        # The scale_loss block whose gradients are still scaled (open, or closed with
        # delay_unscale=True): step() and master_params() complete it before reading gradients.
        self.unfinished = None
        # Why the gradients hold scaled values amp can no longer unscale (None: they do not): an
        # exception after delay_unscale=True blocks, or a backward of a scaled loss after its block
        # ended. step() and scale_loss refuse until zero_grad() clears them.
        self.poisoned: Optional[str] = None
        self.guard = StepGuard()
        self._reset_step()

    def _reset_step(self) -> None:
        self.found: Optional[torch.Tensor] = None
        self.pending = False  # FUSED_MASTERS: model grads scaled by grad_scale, checked
        self.grad_scale: Optional[torch.Tensor] = None
        self.materialized = False  # FUSED_MASTERS: fp32 master grads hold the (unscaled) grads
        self.wb_scale: Optional[torch.Tensor] = None
        self.contributions = 0

    # -- the params, by role ------------------------------------------------------------------
    def _group_params(self) -> Iterator[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    # The lists below are comprehensions over the param groups rather than over _group_params():
    # a generator costs a Python call per param, several times per step.
    def low_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, fp32 master) for every param that has a separate master."""
        if self.kind == SWAP:
            return list(zip(self.low_params, self.low_masters))
        if self.kind == FUSED_MASTERS:
            state = self.optimizer.state
            return [(p, state[p]["master_param"]) for group in self.optimizer.param_groups for p in group["params"]
                    if p.dtype != torch.float32 and "master_param" in state.get(p, {})]
        return []

    def own_params(self) -> list[torch.Tensor]:
        """Params that are their own master (fp32 params, or every param without masters)."""
        groups = self.optimizer.param_groups
        if self.kind == PLAIN:
            return [p for group in groups for p in group["params"]]
        if self.kind == SWAP:
            ids = self.master_ids
            return [p for group in groups for p in group["params"] if id(p) not in ids]
        # FUSED_MASTERS: fp32 params, and bf16 ones with remainder masters (their grads are the masters').
        state = self.optimizer.state
        return [p for group in groups for p in group["params"]
                if p.dtype == torch.float32 or "master_remainder" in state.get(p, {})]

    def master_params(self) -> Iterator[torch.Tensor]:
        if self.unfinished is not None:
            self.unfinished.complete()  # the caller reads .grad (to clip): it must be unscaled
        if self.kind == FUSED_MASTERS:
            if self.pending:
                self.materialize()
            state = self.optimizer.state
            for p in self._group_params():
                yield state[p]["master_param"] if "master_param" in state.get(p, {}) else p
        else:
            yield from self._group_params()

    # -- around a scaled backward ---------------------------------------------------------------
    def prepare_backward(self) -> None:
        """Before a backward that is unscaled at its end: set aside the grads that hold unscaled
        values, so the backward produces fresh scaled ones (Apex's grad stash)."""
        if self.kind == FUSED_MASTERS and self.pending:
            self.materialize()
        for p in self.own_params():
            if p.grad is not None:
                self.stashed[p] = p.grad
                p.grad = None
        if self.kind != PLAIN:  # PLAIN has no low pairs
            for p, _ in self.low_pairs():
                p.grad = None  # scaled leftovers, or already carried by the master grads

    def abort_backward(self) -> None:
        """The block's backward, or code after it, raised: put every gradient back as it was
        before the block (the block's own, scaled, contributions are dropped). After
        delay_unscale blocks the scaled gradients of those blocks and of this one are summed
        and cannot be separated: the stash is poisoned until zero_grad()."""
        self.unfinished = None
        if self.params_have_scaled_gradients:
            self.poisoned = ("an exception interrupted `with amp.scale_loss(...)` after delay_unscale=True blocks, "
                             "so the gradients hold scaled values of unknown extent")
            return
        stashed = self.stashed
        # SWAP's masters keep their grads: they hold earlier blocks' unscaled sums, which this block
        # (unscaled into them only when it completes) never touched.
        masters = self.master_ids if self.kind == SWAP else ()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in masters:
                    p.grad = stashed.get(p)  # None where the block started without a gradient
        for p in self.low_params:  # SWAP: the model's own params (their values are in the master grads)
            p.grad = None
        stashed.clear()
        self.note_grads()

    def has_sparse_gradient(self) -> bool:
        """Whether any param this stash unscales (the optimizer's, and under SWAP the model's) has
        a sparse gradient, which amp's dense unscale and master copy cannot take."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]] + self.low_params
        return any(p.grad is not None and p.grad.is_sparse for p in params)

    def poisoned_message(self, call: str) -> str:
        return (f"{call}: {self.poisoned}: the gradients of {type(self.optimizer).__name__} cannot be used; call "
                "optimizer.zero_grad() and redo the backward passes (nothing was stepped)")

    def post_backward(self, scale: Optional[torch.Tensor], inv: Optional[torch.Tensor],
                      found: Optional[dict]) -> None:
        """After the backward: check (``found`` not None) and unscale (``scale`` not None: None
        means a static scale of 1) the new grads, and add the stashed ones."""
        prev = _grad_enabled()
        _set_grad_enabled(False)
        try:
            if self.kind == FUSED_MASTERS and not self.materialized:
                if self.pending or not self.stashed:
                    # The fast path: check only; the kernel unscales at the step.
                    grads = [p.grad for group in self.optimizer.param_groups for p in group["params"]
                             if p.grad is not None]
                    if found is not None:
                        check_and_unscale_(grads, found)
                    if not self.pending:
                        self.pending = True
                        self.grad_scale = scale.clone() if scale is not None else None
                    self.note_grads()
                    return
                self.materialized = True  # unscaled fp32 grads were stashed: merge them eagerly
            # Low-precision model grads into fp32 master grads (SWAP, or materialized FUSED_MASTERS).
            pairs = [(p, m) for p, m in self.low_pairs() if p.grad is not None] if self.kind != PLAIN else ()
            if pairs:
                fresh = [(p, m) for p, m in pairs if m.grad is None]
                accum = [(p, m) for p, m in pairs if m.grad is not None]
                for _, m in fresh:
                    m.grad = torch.empty_like(m)
                if fresh:
                    _unscale_into([p.grad for p, _ in fresh], [m.grad for _, m in fresh], found, inv)
                if accum:
                    tmps = [torch.empty_like(m) for _, m in accum]
                    _unscale_into([p.grad for p, _ in accum], tmps, found, inv)
                    torch._foreach_add_([m.grad for _, m in accum], tmps)
            own = [p.grad for p in self.own_params() if p.grad is not None]
            if own and (found is not None or inv is not None):
                check_and_unscale_(own, found if found is not None else {},
                                   (lambda d: inv.to(d, non_blocking=True)) if inv is not None else None)
            if self.stashed:
                self._merge_stash()
            if self.kind == FUSED_MASTERS:
                if scale is not None:
                    self.wb_scale = scale.clone() if self.wb_scale is None else torch.minimum(self.wb_scale, scale)
                self.contributions += 1
            self.note_grads()
        finally:
            _set_grad_enabled(prev)

    def _merge_stash(self) -> None:
        add_to, add_from = [], []
        for p, g in self.stashed.items():
            if p.grad is None:
                p.grad = g
            else:
                add_to.append(p.grad)
                add_from.append(g)
        if add_to:
            torch._foreach_add_(add_to, add_from)
        self.stashed.clear()

    def add_found(self, found: torch.Tensor) -> None:
        self.found = found if self.found is None else self.found + found.to(self.found.device, non_blocking=True)

    @torch.no_grad()
    def materialize(self) -> None:
        """FUSED_MASTERS: turn the pending scaled model grads into unscaled fp32 master grads (and
        unscale the fp32 params' grads in place), as Apex's O2 holds them after scale_loss."""
        inv = self.grad_scale.double().reciprocal().float() if self.grad_scale is not None else None
        pairs = [(p, m) for p, m in self.low_pairs() if p.grad is not None]
        for _, m in pairs:
            m.grad = torch.empty_like(m)
        if pairs:
            _unscale_into([p.grad for p, _ in pairs], [m.grad for _, m in pairs], None, inv)
        own = [p.grad for p in self.own_params() if p.grad is not None]
        if own and inv is not None:
            check_and_unscale_(own, {}, lambda d: inv.to(d, non_blocking=True))
        self.wb_scale = self.grad_scale
        self.contributions = 1
        self.pending, self.materialized, self.grad_scale = False, True, None
        self.note_grads()  # the fp32 params' gradients were unscaled in place

    # -- the step ---------------------------------------------------------------------------------
    def prepare_step(self) -> Optional[torch.Tensor]:
        """The grad_scale the optimizer's kernel must divide by (FUSED_MASTERS), after writing
        materialized master grads back into the model's grads."""
        if self.kind != FUSED_MASTERS:
            return None
        if self.pending:
            return self.grad_scale
        if not self.materialized:
            return None
        prev = _grad_enabled()
        _set_grad_enabled(False)
        try:
            return self._write_back()
        finally:
            _set_grad_enabled(prev)

    def _write_back(self) -> Optional[torch.Tensor]:
        s = self.wb_scale
        if s is not None and self.contributions > 1:
            # Each contribution fits the low dtype at its own scale; their sum fits at this one.
            s = s * (0.5 ** math.ceil(math.log2(self.contributions)))
        pairs = [(p, m) for p, m in self.low_pairs() if m.grad is not None]
        for p, _ in pairs:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if pairs:
            _unscale_into([m.grad for _, m in pairs], [p.grad for p, _ in pairs], None, s)
            for _, m in pairs:
                m.grad = None
        own = [p.grad for p in self.own_params() if p.grad is not None]
        if own and s is not None:
            check_and_unscale_(own, {}, lambda d: s.to(d, non_blocking=True))
        if self.found is not None and pairs:
            # A clipped or summed gradient rescaled: make sure nothing overflowed on the way back.
            found: dict = {}
            check_and_unscale_([p.grad for p, _ in pairs], found)
            rescaled = combine_found(found.values(), self.found.device)
            agree_found_inf_(rescaled, _amp_state.process_group)
            self.add_found(rescaled)
        return s

    def after_step(self) -> None:
        if self.kind == SWAP and self.low_params:
            prev = _grad_enabled()
            _set_grad_enabled(False)  # an in-place copy into the model's leaf params
            try:
                torch._foreach_copy_(self.low_params, self.low_masters)
            finally:
                _set_grad_enabled(prev)
            clear_grads(self.low_masters)  # Apex: master grads are not zeroed by model.zero_grad()
            self._reset_step()
            return  # the step read the masters' gradients, not the model's: their marks still hold
        if self.kind == FUSED_MASTERS:
            clear_grads([m for _, m in self.low_pairs()])
        self._reset_step()
        self.note_grads()  # a fused kernel handed amp's scale writes the unscaled gradients back


_refresh_suspended = False


@contextlib.contextmanager
def refresh_suspended() -> Iterator[None]:
    """Within it, model loads leave the masters alone (a checkpoint restores them exactly)."""
    global _refresh_suspended
    before, _refresh_suspended = _refresh_suspended, True
    try:
        yield
    finally:
        _refresh_suspended = before


def refresh_masters_from_model(optimizers: list, model: torch.nn.Module) -> None:
    """After ``model.load_state_dict``: masters of that model's params follow the loaded values
    (as Apex's lazily created masters did); an optimizer checkpoint loaded later overrides them."""
    if _refresh_suspended:
        return
    params = {id(p) for p in model.parameters()}
    with torch.no_grad():
        for opt in optimizers:
            stash = getattr(opt, "_amp_stash", None)
            if stash is None:
                continue
            for p, m in stash.low_pairs():
                if id(p) in params:
                    m.copy_(p)
            for p in stash.own_params():  # remainder masters: the loaded weight, exactly
                state = opt.state.get(p, {})
                if id(p) in params and "master_remainder" in state:
                    state["master_remainder"].zero_()


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The params the optimizer updates in fp32: the masters under O2, the model's params
    otherwise. Between scale_loss and step, their ``.grad`` hold the unscaled gradients (clip
    them here: ``clip_grad_norm_(amp.master_params(optimizer), max_norm)``)."""
    if not isinstance(optimizer, OPTIMIZER_TYPES):
        raise TypeError(f"amp.master_params: optimizer must be a torch.optim.Optimizer (as returned by "
                        f"amp.initialize), got {type(optimizer).__name__}; the masters belong to the optimizer, "
                        "e.g. clip_grad_norm_(amp.master_params(optimizer), max_norm)")
    # Checked here, not on the first next(): the error then points at the call.
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is None:
        return (p for group in optimizer.param_groups for p in group["params"])
    return stash.master_params()
