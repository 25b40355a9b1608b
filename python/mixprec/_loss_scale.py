"""Loss-scale state on the device (scale, growth and hysteresis trackers, skipped steps, history)
and the per-device non-finite check / unscale of gradient lists: shared by mixprec.GradScaler
and mixprec.amp's loss scalers."""

from __future__ import annotations

import math
import numbers
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch

from . import _ops
from ._device_copy import to_device

_OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
F32_MAX = torch.finfo(torch.float32).max
INT32_MAX = 2**31 - 1


def _flat_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` as mixprec's ops take it: itself when contiguous; one flat run of its memory when
    dense but permuted (channels_last grads: the check and unscale are element-wise, so the
    order does not matter); None otherwise."""
    if t.is_contiguous():
        return t
    if t.layout != torch.strided:
        return None
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,))


def check_and_unscale_(grads: Iterable[torch.Tensor], found_per_device: dict[torch.device, torch.Tensor],
                       inv_scale: Optional[Callable[[torch.device], torch.Tensor]] = None) -> None:
    """Sets ``found_per_device[d]`` (created as a zero device scalar when missing) if any grad
    on device ``d`` holds inf/NaN; with ``inv_scale`` (device -> scalar) also multiplies the
    grads by it in place. One mixprec pass per device for every float32/float16/bfloat16 grad,
    whatever the mix of dtypes; other dtypes and non-dense layouts go through torch's op."""
    grads = grads if isinstance(grads, list) else list(grads)
    if not grads:
        return
    # The common case, on the hot path of every step: one device, contiguous grads of the op's
    # dtypes. One look at each grad, then the op (the sorting below costs a small model's step
    # several percent). A plain loop: all() over a generator costs a Python call per grad.
    device = grads[0].device
    for g in grads:
        if not (g.dtype in _OP_DTYPES and g.is_contiguous() and g.device == device):
            break
    else:
        found = found_per_device.get(device)
        if found is None:
            found = found_per_device[device] = torch.zeros((), dtype=torch.float32, device=device)
        _ops.non_finite_check_and_unscale_(grads, found, inv_scale(device) if inv_scale is not None else None)
        return
    ours: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    others: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        v = _flat_view(g) if g.dtype in _OP_DTYPES else None
        if v is None:
            others[(g.device, g.dtype)].append(g)
        else:
            ours[g.device].append(v)
    devices = list(ours) + [d for d, _ in others if d not in ours]
    for device in dict.fromkeys(devices):
        found = found_per_device.get(device)
        if found is None:
            found = found_per_device[device] = torch.zeros((), dtype=torch.float32, device=device)
        inv = inv_scale(device) if inv_scale is not None else None
        if ours.get(device):
            _ops.non_finite_check_and_unscale_(ours[device], found, inv)
        for (d, _), lst in others.items():
            if d == device:
                one = inv if inv is not None else torch.ones((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(lst, found, one)


def combine_found(found: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One device scalar that is non-zero iff any of ``found`` is, with no host sync."""
    found = [f if f.device == device else to_device(f, device) for f in found]
    if not found:
        raise AssertionError("No inf checks were recorded.")
    if len(found) == 1:
        return found[0]
    return torch.stack([f.reshape(()) for f in found]).sum()


def flag_unusable_scale_(found_per_device: dict[torch.device, torch.Tensor], scale: torch.Tensor) -> None:
    """Sets every found_inf of ``found_per_device`` to 1 when ``scale`` cannot unscale: its float32
    reciprocal (taken in float64, as torch's scaler does) is inf, NaN, 0 or negative, as after a
    hand edit of the scale tensor. Counted as an overflow, so the step is skipped and update()
    backs off (a NaN scale stays NaN), on the device: a fused optimizer divides by the scale in its
    kernel, and the read-only check before it never sees the scale."""
    if not found_per_device:
        return
    inv = scale.double().reciprocal().float()
    bad = torch.logical_and(torch.isfinite(inv), inv > 0).logical_not().float()
    for found in {id(f): f for f in found_per_device.values()}.values():
        torch.maximum(found, to_device(bad, found.device), out=found)


class Replicator:
    """A device scalar served to each device that asks, copied once per device (_device_copy's rule)."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self._copies: dict[torch.device, torch.Tensor] = {master.device: master}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self._copies.get(device)
        if t is None:
            t = self._copies[device] = to_device(self.master, device, copy=True)
        return t


def _as_number(value: Any, integer: bool) -> Any:
    """``value`` as a Python int (``integer``) or float, or None when it is not one: numbers.Integral
    / numbers.Real (numpy scalars included) and 0-dim tensors of a matching dtype (torch's scaler
    loads those), never bool."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        if integer and value.is_floating_point():
            return None
        value = value.item()
    if isinstance(value, (bool, torch.Tensor)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if not integer and isinstance(value, numbers.Real):
        return float(value)
    return None


def _check_number(name: str, value: Any, *, integer: bool = False, lo: float | None = None,
                  lo_open: bool = False, hi: float | None = None, hi_open: bool = False,
                  error: type = ValueError) -> Any:
    """``value`` converted to int/float after checking it (``name`` says who asks for what);
    raises ``error`` naming what is expected otherwise."""
    v = _as_number(value, integer)
    ok = v is not None and (integer or math.isfinite(v))
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        bounds = [f"{op} {b!r}" for op, b in ((">" if lo_open else ">=", lo), ("<" if hi_open else "<=", hi))
                  if b is not None]
        expected = ("an integer" if integer else "a finite number") + (" " + " and ".join(bounds) if bounds else "")
        raise error(f"{name} must be {expected}, got {value!r}")
    return v


#: The smallest normal float32: a smaller scale rounds toward 0 in the float32 scale tensor.
F32_TINY = torch.finfo(torch.float32).tiny


def check_scale(name: str, value: Any, error: type = ValueError) -> float:
    """A loss scale as a float, checked to survive the float32 scale tensor: positive, normal and
    finite (a scale that rounds to 0 or inf would turn every unscaled gradient into inf/NaN)."""
    return _check_number(name, value, lo=F32_TINY, hi=F32_MAX, error=error)


#: The growth interval update_scale_ gets for ``growth_interval=0``, which torch's scaler accepts and
#: then never grows (its tracker never equals 0): the int32 maximum, 2**31 - 1 clean steps away.
NEVER_GROW = INT32_MAX

#: Callbacks ``fn(state, found)`` run after each update of a ScaleState (mixprec.diagnostics'
#: hook). Kept outside the state, so pickling and checkpoints never see them.
update_observers: "weakref.WeakKeyDictionary[ScaleState, list]" = weakref.WeakKeyDictionary()


class ScaleState:
    """A dynamic loss scale living on one device: scale (float32), growth tracker (int32),
    hysteresis tracker (int32), skipped-step counter (int64), and an optional ring of the last
    ``history_size`` (scale used, overflow) pairs. Tensors are created lazily on the device of
    the first loss; nothing here reads a device value unless asked."""

    def __init__(self, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int,
                 hysteresis: int = 1, min_scale: Optional[float] = None, max_scale: Optional[float] = None,
                 history_size: int = 0) -> None:
        _check_number("hysteresis", hysteresis, integer=True, lo=1)
        _check_number("history_size", history_size, integer=True, lo=0)
        if min_scale is not None:
            _check_number("min_scale", min_scale, lo=0)
        if max_scale is not None:
            _check_number("max_scale", max_scale, lo=0, lo_open=True)
            if min_scale is not None and max_scale < min_scale:
                raise ValueError(f"max_scale ({max_scale}) must be >= min_scale ({min_scale})")
        self.init_scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.history_size = history_size
        # Host copies used until the device tensors exist (and by pickling, like torch).
        self.init_growth_tracker = 0
        self.init_hysteresis_tracker = hysteresis
        self.init_skipped = 0
        self.scale: Optional[torch.Tensor] = None
        self.growth_tracker: Optional[torch.Tensor] = None
        self.hysteresis_tracker: Optional[torch.Tensor] = None
        self.skipped: Optional[torch.Tensor] = None
        self.history: Optional[torch.Tensor] = None
        self.history_count = 0  # updates recorded so far (host-side: we know when we record)

    # -- lifecycle -----------------------------------------------------------------------------
    def lazy_init(self, device: torch.device) -> None:
        if self.scale is not None:
            return
        self.scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), self.init_growth_tracker, dtype=torch.int32, device=device)
        self.init_extra(device)

    def init_extra(self, device: torch.device) -> None:
        """Creates whichever of mixprec's own device fields is missing, beside a scale and growth
        tracker that code written for torch's scaler (a subclass's lazy init) may have set alone."""
        if self.hysteresis_tracker is None:
            self.hysteresis_tracker = torch.full((), self.init_hysteresis_tracker, dtype=torch.int32, device=device)
        if self.skipped is None:
            self.skipped = torch.full((), self.init_skipped, dtype=torch.int64, device=device)
        if self.history_size and self.history is None:
            self.history = torch.zeros((self.history_size, 2), dtype=torch.float32, device=device)

    def inv_scale(self) -> torch.Tensor:
        # Like torch.amp.GradScaler: the reciprocal in float64, then rounded (bit-equal unscaling).
        return self.scale.double().reciprocal().float()

    def update(self, found: torch.Tensor) -> None:
        """One dynamic update on the device from the combined ``found`` (a device scalar)."""
        # Every step: a copy to the same device is skipped. The hyper-parameters are converted here,
        # not once: GradScaler's setters and checkpoints change them.
        scale = self.scale
        if found.device != scale.device:
            found = to_device(found, scale.device)
        self._record(found)
        _ops.update_scale_(
            scale, self.growth_tracker, found, float(self.growth_factor), float(self.backoff_factor),
            int(self.growth_interval) or NEVER_GROW, hysteresis=int(self.hysteresis), hysteresis_tracker=self.hysteresis_tracker,
            skipped_steps=self.skipped, min_scale=float(self.min_scale or 0.0),
            max_scale=float(self.max_scale or 0.0),
        )
        for fn in update_observers.get(self, ()):
            fn(self, found)

    def count_skip(self, found: torch.Tensor) -> None:
        """Counts an overflow without updating the scale (a user-set new scale)."""
        found = to_device(found, self.scale.device)
        self._record(found)
        self.skipped.add_((found != 0).to(torch.int64))
        for fn in update_observers.get(self, ()):
            fn(self, found)

    def _record(self, found: torch.Tensor) -> None:
        if self.history is None:
            return
        row = self.history[self.history_count % self.history_size]
        row[0].copy_(self.scale)
        row[1].copy_(found != 0)
        self.history_count += 1

    # -- reading (these synchronize) -------------------------------------------------------------
    def get_scale(self) -> float:
        return self.init_scale if self.scale is None else float(self.scale.item())

    def get_growth_tracker(self) -> int:
        return self.init_growth_tracker if self.growth_tracker is None else int(self.growth_tracker.item())

    def get_hysteresis_tracker(self) -> int:
        return self.init_hysteresis_tracker if self.hysteresis_tracker is None else int(self.hysteresis_tracker.item())

    def get_skipped(self) -> int:
        return self.init_skipped if self.skipped is None else int(self.skipped.item())

    def scale_history(self, with_overflow: bool = False) -> list:
        """The scale each recorded step used, oldest first (at most ``history_size`` steps); with
        ``with_overflow`` as (scale, overflowed) pairs. Materializes the device ring once."""
        if self.history is None or self.history_count == 0:
            return []
        n = min(self.history_count, self.history_size)
        start = self.history_count % self.history_size if self.history_count > self.history_size else 0
        rows = torch.roll(self.history, -start, dims=0)[:n].cpu().tolist()
        return [(s, bool(f)) for s, f in rows] if with_overflow else [s for s, _ in rows]

    # -- checkpoints -------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """mixprec's keys beside torch's (hysteresis, bounds, trackers, skipped steps)."""
        return {
            "hysteresis": self.hysteresis,
            "_hysteresis_tracker": self.get_hysteresis_tracker(),
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "_skipped_steps": self.get_skipped(),
        }

    def set_values(self, scale: float, growth_tracker: int, hysteresis_tracker: Optional[int] = None,
                   skipped: Optional[int] = None) -> None:
        """Sets validated values, on the device if the tensors exist (no sync: fills)."""
        self.init_scale = float(scale)
        self.init_growth_tracker = int(growth_tracker)
        if hysteresis_tracker is not None:
            self.init_hysteresis_tracker = int(hysteresis_tracker)
        if skipped is not None:
            self.init_skipped = int(skipped)
        if self.scale is not None:
            self.scale.fill_(self.init_scale)
            self.growth_tracker.fill_(self.init_growth_tracker)
            self.hysteresis_tracker.fill_(self.init_hysteresis_tracker)
            self.skipped.fill_(self.init_skipped)

    def freeze_for_pickle(self) -> None:
        """Moves device values to the host fields and drops the tensors (lazily recreated)."""
        self.init_scale = self.get_scale()
        self.init_growth_tracker = self.get_growth_tracker()
        self.init_hysteresis_tracker = self.get_hysteresis_tracker()
        self.init_skipped = self.get_skipped()
        self.scale = self.growth_tracker = self.hysteresis_tracker = self.skipped = self.history = None
        self.history_count = 0


def validate_extra_state(state: dict[str, Any], where: str) -> dict[str, Any]:
    """Checks mixprec's optional scaler keys; returns those present, converted."""
    out: dict[str, Any] = {}
    if "hysteresis" in state:
        out["hysteresis"] = _check_number(f"{where}['hysteresis']", state["hysteresis"], integer=True, lo=1,
                                          hi=INT32_MAX)
    if "_hysteresis_tracker" in state:
        out["_hysteresis_tracker"] = _check_number(f"{where}['_hysteresis_tracker']", state["_hysteresis_tracker"],
                                                   integer=True, lo=0, hi=INT32_MAX)
    for key in ("min_scale", "max_scale"):
        if key in state:
            out[key] = None if state[key] is None else _check_number(f"{where}[{key!r}]", state[key], lo=0,
                                                                     hi=F32_MAX)
    if out.get("min_scale") is not None and out.get("max_scale") is not None and out["max_scale"] < out["min_scale"]:
        raise ValueError(f"{where}: max_scale {out['max_scale']} < min_scale {out['min_scale']}")
    if "_skipped_steps" in state:
        out["_skipped_steps"] = _check_number(f"{where}['_skipped_steps']", state["_skipped_steps"], integer=True,
                                              lo=0, hi=2**63 - 1)
    return out
