"""amp.init and its handles (Apex's original API): AmpHandle patches torch with O1's cast rules
while active, scales losses and wraps optimizers; NoOpHandle does nothing; InitializeHandle is
the handle amp.initialize leaves in amp._amp_state.handle."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch

from . import _o1_lists, _o1_patch, _o1_scale
from ._casts import disable_casts
from ._o1_patch import STATE
from ._o1_scale import OptimWrapper
from ._scaler import LossScaler, _amp_state

_LOW_DTYPES = (torch.float16, torch.bfloat16)


class AmpHandle:
    """What ``amp.init()`` returns while torch is patched with O1's cast rules. Only one is
    active at a time; ``_deactivate()`` puts every patched attribute back (the same objects)."""

    def __init__(self, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
                 dtype: torch.dtype = torch.float16) -> None:
        self._loss_scale_arg = loss_scale
        self._enable_caching = bool(enable_caching)
        self._verbose = bool(verbose)
        self._dtype = dtype
        self._cache: dict = {}
        self._default_scaler: Optional[LossScaler] = LossScaler(loss_scale)
        self._patched: list = []
        self._is_active = False

    # -- activation ---------------------------------------------------------------------------------
    def _activate(self, allow_banned: bool) -> None:
        self._patched = _o1_patch.install(_o1_lists.patch_table(allow_banned))
        STATE.low, STATE.verbose = self._dtype, self._verbose
        STATE.cache = self._cache if self._enable_caching else None
        STATE.handle, STATE.on = self, True
        self._is_active = True

    def _deactivate(self) -> None:
        """Removes every patch this handle installed and turns its casts off for good. Optimizers
        whose next step is still guarded (a scale_loss block without its step yet) keep that
        guard until the step: it removes itself, and an overflow must not be applied."""
        _o1_patch.uninstall(self._patched)
        if STATE.handle is self:
            STATE.on, STATE.handle, STATE.cache, STATE.verbose = False, None, None, False
        self._is_active = False
        self._cache.clear()

    def is_active(self) -> bool:
        return self._is_active and STATE.handle is self and STATE.on

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        with _o1_patch.casts_off():
            yield

    # -- the cache ----------------------------------------------------------------------------------
    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> dict:
        return self._cache

    def _clear_cache(self) -> None:
        self._cache.clear()

    def remove_cache(self, param: torch.Tensor) -> None:
        self._cache.pop(id(param), None)

    @property
    def verbose(self) -> bool:
        return self._verbose

    # -- loss scaling -------------------------------------------------------------------------------
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        """Apex's OptimWrapper: ``with opt.scale_loss(loss) as s`` per loss, then ``opt.step()``.
        After it, this handle's own scale_loss is refused (as in Apex)."""
        wrapper = OptimWrapper(optimizer, self, num_loss)
        self._default_scaler = None
        return wrapper

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """Yields the loss times the handle's loss scale; on exit the optimizer's gradients are
        unscaled and checked, the scale is updated, and the optimizer's next ``step()`` does
        nothing if they held inf/NaN. The weight-cast cache is cleared. An optimizer that
        amp.initialize returned is scaled by ``amp.scale_loss`` instead (its own loss scaler)."""
        if not self.is_active():
            yield loss
            return
        if hasattr(optimizer, "_amp_stash"):
            from ._handle import scale_loss  # initialize's path (O0-O3), untouched
            try:
                with scale_loss(loss, optimizer) as scaled:
                    yield scaled
            finally:
                self._clear_cache()
            return
        if self._default_scaler is None:
            raise RuntimeError("AmpHandle.scale_loss: after handle.wrap_optimizer(), scale each loss with the "
                               "wrapper: `with optimizer.scale_loss(loss) as scaled_loss:`")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"AmpHandle.scale_loss: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")

        def done(found: torch.Tensor, finished: bool) -> None:
            _o1_scale.arm(optimizer, found)

        try:
            with _o1_scale.scaled_backward(loss, _o1_scale.params_of(optimizer), self._default_scaler,
                                           _o1_scale.is_armed(optimizer), done) as scaled:
                yield scaled
        finally:
            self._clear_cache()


class NoOpHandle:
    """``amp.init(enabled=False)``: nothing is patched, losses are not scaled."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def _clear_cache(self) -> None:
        pass

    def remove_cache(self, param: torch.Tensor) -> None:
        pass

    def _deactivate(self) -> None:
        pass


class InitializeHandle(NoOpHandle):
    """The handle amp.initialize sets as ``amp._amp_state.handle`` (Apex code reaches it there):
    scale_loss is ``amp.scale_loss``; it patches nothing (O1 runs under torch.autocast), so
    _deactivate and _clear_cache have nothing to undo; active while initialize's O1 casts are."""

    def is_active(self) -> bool:
        props = _amp_state.opt_properties
        return bool(props is not None and props.options.get("enabled") and props.options.get("patch_torch_functions"))

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        with disable_casts():
            yield

    def scale_loss(self, loss, optimizers, *args, **kwargs):
        from ._handle import scale_loss
        return scale_loss(loss, optimizers, *args, **kwargs)

    def wrap_optimizer(self, optimizer, num_loss: int = 1):
        raise RuntimeError("wrap_optimizer belongs to amp.init's handle; an optimizer from amp.initialize is "
                           "scaled with amp.scale_loss(loss, optimizer)")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"amp.init: {name} must be True or False, got {value!r}")


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False, *, dtype: Optional[torch.dtype] = None,
         patch_type: Optional[torch.dtype] = None):
    """Apex's ``amp.init()``: patches torch, torch.nn.functional and Tensor methods with O1's
    cast lists (matmul-like ops in float16, or bfloat16 with ``dtype=torch.bfloat16``; precision-
    sensitive ops in float32; mixed inputs promoted to the widest) and returns an
    :class:`AmpHandle` for loss scaling (``loss_scale``: "dynamic" or a number). Float16 casts of
    weights are cached within an iteration (``enable_caching``). ``verbose`` prints each cast;
    ``allow_banned`` runs F.binary_cross_entropy in float32 instead of refusing low precision.
    ``patch_type`` is Apex 25.04's name for ``dtype``.

    Only one handle may be active: a second ``init`` (enabled or not) raises until the first is
    given back with ``handle._deactivate()``. ``enabled=False`` returns a :class:`NoOpHandle`."""
    _check_flag("enabled", enabled)
    for name, value in (("enable_caching", enable_caching), ("verbose", verbose), ("allow_banned", allow_banned)):
        _check_flag(name, value)
    if not (loss_scale == "dynamic" if isinstance(loss_scale, str) else
            isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool)
            and math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"amp.init: loss_scale must be 'dynamic' or a positive finite number, got {loss_scale!r}")
    for name, value in (("dtype", dtype), ("patch_type", patch_type)):
        if value is not None and value not in _LOW_DTYPES:
            raise ValueError(f"amp.init: {name} must be torch.float16 or torch.bfloat16, got {value!r}")
    if dtype is not None and patch_type is not None and dtype != patch_type:
        raise ValueError(f"amp.init: dtype={dtype} conflicts with patch_type={patch_type}")
    if STATE.handle is not None:
        raise RuntimeError("amp.init: an AmpHandle from an earlier amp.init() is still active; only one handle "
                           "may patch torch at a time: call handle._deactivate() on it first")
    if not enabled:
        _amp_state.handle = NoOpHandle()
        return _amp_state.handle
    handle = AmpHandle(loss_scale, enable_caching, verbose, dtype or patch_type or torch.float16)
    handle._activate(bool(allow_banned))
    _amp_state.handle = handle  # where Apex-era code finds it
    return handle
