"""amp's global state and its per-loss scalers (Apex's LossScaler on mixprec's device-side scale),
with the rate-limited, rank-0, sync-free "skipping step" log."""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from .._loss_scale import INT32_MAX, ScaleState, _check_number, check_scale
from ..distributed import is_rank0

logger = logging.getLogger("mixprec.amp")

#: At most one overflow message per this many seconds per loss scaler (tests lower it).
LOG_INTERVAL_S = 10.0


_is_rank0 = is_rank0  # the name amp's modules use


class _OverflowReporter:
    """Learns of skipped steps without waiting for the device: the skipped-step counter and the
    scale are copied to pinned host memory behind a CUDA event, and read once the event has
    passed, at a later step. One copy per LOG_INTERVAL_S at most; the message says how many steps
    were skipped since the last one."""

    def __init__(self, loss_id: int) -> None:
        self.loss_id = loss_id
        self.reported = 0
        self.next_poll = 0.0
        self.pending: Optional[tuple] = None
        self.host: Optional[tuple] = None

    def poll(self, state: ScaleState, verbosity: int) -> None:
        if verbosity == 0 or state.skipped is None or not _is_rank0():
            return
        if self.pending is not None:
            skipped, scale, event = self.pending
            if event is not None and not event.query():
                return
            self.pending = None
            self._report(int(skipped), float(scale))
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + LOG_INTERVAL_S
        if state.skipped.device.type != "cuda":
            # Host memory: the values are already final, reading them waits for nothing.
            self._report(int(state.skipped), float(state.scale))
            return
        if self.host is None:  # pinned once, so the copies below are truly asynchronous
            self.host = (torch.empty((), dtype=torch.int64, pin_memory=True),
                         torch.empty((), dtype=torch.float32, pin_memory=True))
        skipped, scale = self.host
        skipped.copy_(state.skipped, non_blocking=True)
        scale.copy_(state.scale, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending = (skipped, scale, event)

    def _report(self, skipped: int, scale: float) -> None:
        if skipped > self.reported:
            n = skipped - self.reported
            self.reported = skipped
            logger.warning("Gradient overflow.  Skipping step, loss scaler %d reducing loss scale to %s "
                           "(%d step%s skipped since the last message, %d in total)",
                           self.loss_id, scale, n, "" if n == 1 else "s", skipped)


class LossScaler:
    """One loss's scale (Apex's LossScaler): dynamic (starting at min(max_loss_scale, 2**16),
    halved on overflow down to min_loss_scale, doubled after 2000 clean steps up to
    max_loss_scale) or static. The values live on the device of the first scaled loss."""

    def __init__(self, loss_scale, loss_id: int = 0, min_loss_scale: Optional[float] = None,
                 max_loss_scale: float = 2.0**24, history_size: int = 0) -> None:
        self.dynamic = loss_scale == "dynamic"
        init = min(max_loss_scale, 2.0**16) if self.dynamic else float(loss_scale)
        self.state = ScaleState(init, 2.0, 0.5, 2000, 1, min_loss_scale if self.dynamic else None,
                                max_loss_scale if self.dynamic else None, history_size)
        self.reporter = _OverflowReporter(loss_id)
        self.loss_id = loss_id
        self.last_found: Optional[torch.Tensor] = None

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        self.state.lazy_init(device)
        return self.state.scale

    def follow(self, device: torch.device) -> None:
        """Moves the scale's device values to ``device``, where the loss now is: a model moved after
        amp.initialize (O0, O1, O3: its optimizer holds the same params, which keep training), whose
        scale was made beside the first loss. Apex's scale was a host number, which went anywhere."""
        state = self.state
        for name, value in list(vars(state).items()):
            if isinstance(value, torch.Tensor):
                setattr(state, name, value.to(device))

    def update(self, found: torch.Tensor, verbosity: int) -> None:
        if self.dynamic:
            self.state.update(found)
            self.last_found = found  # a reference (no copy, no sync) for _has_overflow
            if verbosity:  # poll() does nothing at verbosity 0: skip the call on every step
                self.reporter.poll(self.state, verbosity)

    # Apex's API (these synchronize).
    def loss_scale(self) -> float:
        return self.state.get_scale()

    @property
    def _loss_scale(self) -> float:
        return self.state.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        # Apex-era code sets the scale directly (e.g. to restart after a divergence); it takes
        # effect on the next scaled loss. A fill on the device: no sync.
        value = check_scale(f"amp loss scaler {self.loss_id}: _loss_scale", value)
        state = self.state
        state.init_scale = value
        if state.scale is not None:
            state.scale.fill_(state.init_scale)

    @property
    def _unskipped(self) -> int:
        return self.state.get_growth_tracker()

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        # Apex's load_state_dict sets it, and resume code written after it does too: the clean steps
        # counted toward the next growth (an int32 on the device). A fill: no sync.
        value = int(_check_number(f"amp loss scaler {self.loss_id}: _unskipped", value, integer=True, lo=0,
                                  hi=INT32_MAX))
        state = self.state
        state.init_growth_tracker = value
        if state.growth_tracker is not None:
            state.growth_tracker.fill_(value)

    @property
    def _has_overflow(self) -> bool:
        """Whether the last scale update (the last scale_loss block, or the step after delayed
        ones) saw an inf/NaN, as Apex's attribute said after each unscale; False for a static
        scale, which Apex did not check either. Syncs."""
        found = self.last_found
        return False if found is None else bool(found.item())

    def clear_overflow_state(self) -> None:
        """Apex's: forgets the last overflow (``_has_overflow`` reads False until the next update)."""
        self.last_found = None


class AmpState:
    """What amp.initialize sets up, module-global as in Apex (one initialize at a time)."""

    def __init__(self) -> None:
        self.opt_properties = None
        self.loss_scalers: list[LossScaler] = []
        self.verbosity = 1
        self.dtype = torch.float16
        self.min_loss_scale: Optional[float] = None
        self.max_loss_scale = 2.0**24
        self.deferred_updates: list[tuple[LossScaler, torch.Tensor]] = []
        self.hard_override = False
        self.process_group = None  # found_inf is agreed over it (mixprec.distributed.agree_found_inf_)
        # Apex's switch for models that arrive in fp16/bf16 on purpose (set it before initialize).
        self.allow_incoming_model_not_fp32 = False
        self.handle = None  # Apex's _amp_state.handle: set by initialize and by amp.init

    def reset(self, opt_properties, verbosity: int, process_group) -> None:
        """The fresh state of an initialize call, set only once its arguments were validated."""
        self.opt_properties = opt_properties
        self.verbosity = verbosity
        self.deferred_updates = []
        self.process_group = process_group
        self.loss_scalers = []

    @property
    def initialized(self) -> bool:
        return self.opt_properties is not None

    def flush_deferred_updates(self) -> None:
        """Scale updates postponed by scale_loss(delay_overflow_check=True), applied at the step."""
        pending, self.deferred_updates = self.deferred_updates, []
        for scaler, found in pending:
            scaler.update(found, self.verbosity)


_amp_state = AmpState()
