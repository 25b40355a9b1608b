"""Trains the task under one precision mode (through mixprec.amp, or torch.amp for the baselines)
and measures it: time per epoch, throughput, peak memory, losses and metric, skipped steps and
loss scale, with mixprec's diagnostics watching. Any error becomes the mode's status and reason,
never a crash."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import amp, diagnostics
from ..fp8 import ALIGN as FP8_ALIGN
from ..fp8 import Fp8Linear
from ..amp._casts import applier
from ..amp._scaler import _amp_state
from .lean import FP8_EMULATED, ModeSkipped, lean_options, state_bytes
from .memory import MemoryMeter
from .modes import TORCH_AMP, Mode
from .report import DIVERGED, FAILED, OK, OOM, SKIPPED, ModeResult
from .task import Task, TaskError, build_task
from .torch_amp import NoTorchEquivalent, TorchAmpPrecision, optimizer_name

MAX_EVENTS_KEPT = 20


@dataclass
class RunConfig:
    epochs: int = 3
    steps_per_epoch: Optional[int] = None  # cap on batches per epoch (None: the whole loader)
    val_steps: Optional[int] = None  # cap on validation batches
    seed: int = 0
    patience: int = 20  # overflowing updates in a row at the scale floor, or NaN losses in a row
    debug_forward: bool = False
    progress: bool = True


class Diverged(Exception):
    pass


def is_oom(e: BaseException) -> bool:
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(e)
    return isinstance(e, (RuntimeError, MemoryError)) and (
        isinstance(e, MemoryError) or "out of memory" in text or "can't allocate memory" in text)


def one_line(e: BaseException, limit: int = 300) -> str:
    lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()]
    text = lines[0] if lines else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _batch_size(targets: Any, inputs: Any) -> int:
    for value in (targets, inputs):
        for t in diagnostics._tensors(value):
            if t.dim() > 0:
                return int(t.shape[0])
    return 1


def _num(value: Any) -> float:
    return float(value.detach().float()) if isinstance(value, torch.Tensor) else float(value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Averager:
    """Batch-size-weighted means of a loss and a metric over finite values."""

    def __init__(self) -> None:
        self.loss = self.metric = 0.0
        self.n_loss = self.n_metric = 0

    def add(self, loss: float, metric: Optional[float], n: int) -> None:
        if math.isfinite(loss):
            self.loss += loss * n
            self.n_loss += n
        if metric is not None and math.isfinite(metric):
            self.metric += metric * n
            self.n_metric += n

    def means(self, nonfinite_if_empty: bool) -> tuple[Optional[float], Optional[float]]:
        empty = math.nan if nonfinite_if_empty else None
        return (self.loss / self.n_loss if self.n_loss else empty,
                self.metric / self.n_metric if self.n_metric else empty)


def _capped(loader: Any, cap: Optional[int]):
    for i, batch in enumerate(loader):
        if cap is not None and i >= cap:
            break
        yield batch


def _steps_per_epoch(loader: Any, cap: Optional[int]) -> Optional[int]:
    try:
        n = len(loader)
    except TypeError:
        return cap
    return n if cap is None else min(n, cap)


def _unpack(batch: Any, where: str) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TaskError(f"{where}: each batch must be an (inputs, targets) pair, got {type(batch).__name__}"
                    f"{' of length %d' % len(batch) if isinstance(batch, (tuple, list)) else ''}")


def _to(device: torch.device, value: Any) -> Any:
    return applier(value, lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t)


@torch.no_grad()
def evaluate(task: Task, device: torch.device, cap: Optional[int],
             autocast: Callable[[], Any] = contextlib.nullcontext) -> tuple[Optional[float], Optional[float]]:
    task.model.eval()
    avg = _Averager()
    for batch in _capped(task.val_loader, cap):
        x, y = _unpack(batch, "val_loader")
        x, y = _to(device, x), _to(device, y)
        with autocast():
            out = task.model(x)
            loss = _num(task.loss_fn(out, y))
        metric = _num(task.metric_fn(out, y)) if task.metric_fn is not None else loss
        avg.add(loss, metric, _batch_size(y, x))
        if not math.isfinite(loss):  # a NaN batch makes the whole validation non-finite
            avg.n_loss = 0
            break
    task.model.train()
    if avg.n_loss == 0:
        return math.nan, math.nan
    return avg.means(nonfinite_if_empty=True)


def warm_up(factory: Callable, where: str, device: torch.device, cfg: RunConfig, init_state: dict) -> None:
    """Builds the task once and takes one plain fp32 step, outside every measurement, so that
    one-time costs (torch's lazy imports on the first optimizer, thread pools, the CUDA context
    and library handles) are not charged to O0. Fills ``init_state`` with the initial weights.
    Errors other than TaskError are left for the O0 run to meet and record."""
    torch.manual_seed(cfg.seed)
    try:
        task = build_task(factory, device, where)
        init_state.update({k: v.detach().to("cpu", copy=True) for k, v in task.model.state_dict().items()})
        for batch in _capped(task.train_loader, 1):
            x, y = _unpack(batch, "train_loader")
            x, y = _to(device, x), _to(device, y)
            task.loss_fn(task.model(x), y).backward()
            task.optimizer.step()
        _sync(device)
    except TaskError:
        raise
    except Exception:  # O0 will meet the same error and record it as its status and reason
        pass


class AmpPrecision:
    """One mixprec.amp mode's training step: amp.initialize at the mode's opt level and dtype,
    amp.scale_loss, and mixprec's diagnostics Monitor on the loss scale (it raises
    LossScaleStuckError when the scale is stuck at its floor)."""

    def __init__(self, mode: Mode, task: Task, device: torch.device, cfg: RunConfig, max_events: int) -> None:
        self.optimizer_name = optimizer_name(task.optimizer)
        lean = lean_options(mode, task, device, cfg.seed)
        # The remainder is asked for with cast_model_type, as amp.initialize documents it.
        dtype = {"cast_model_type": mode.dtype} if "master_weights" in lean else \
            {"dtype": None if mode.opt_level == "O0" else mode.dtype}
        task.model, task.optimizer = amp.initialize(task.model, task.optimizer, opt_level=mode.opt_level,
                                                    verbosity=0, **dtype, **lean)
        self.fp8_layers = [m for m in task.model.modules() if isinstance(m, Fp8Linear)]
        if lean.get("fp8") and not self.fp8_layers:  # it would be O2-bf16 under another name
            raise ModeSkipped(f"no nn.Linear of the model is eligible for FP8 (in_features and out_features "
                              f"multiples of {FP8_ALIGN})")
        self.optimizer = task.optimizer
        self.scaler = _amp_state.loss_scalers[0]
        self.monitor = diagnostics.Monitor(task.model, patience=cfg.patience, max_events=max_events)
        self.watch_loss = self.monitor.watch_loss
        self.stuck: Optional[diagnostics.LossScaleStuckError] = None
        self.autocast = contextlib.nullcontext  # O1 puts the model's own forward under autocast

    def backward_step(self, loss: torch.Tensor) -> None:
        try:
            with amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
            self.optimizer.step()
        except diagnostics.LossScaleStuckError as e:  # raised by check(), once the step is counted
            self.stuck = e

    def loss_scale(self) -> float:
        return self.scaler.loss_scale()

    def check(self) -> None:
        if self.stuck is not None:
            raise self.stuck

    @property
    def skipped(self) -> int:
        return self.monitor.overflows

    @property
    def events(self) -> list:
        return self.monitor.events

    def close(self) -> None:
        self.monitor.close()


def make_precision(mode: Mode, task: Task, device: torch.device, cfg: RunConfig):
    """The object that trains ``task`` in ``mode``: autocast(), watch_loss(loss),
    backward_step(loss), check() (raises once the mode is stuck), loss_scale(), skipped, events,
    optimizer_name, close(). For a torch.amp mode whose task optimizer torch cannot express it
    raises NoTorchEquivalent, which fails that mode alone; for a lean variant this task or device
    cannot take, ModeSkipped."""
    if mode.opt_level == TORCH_AMP:
        return TorchAmpPrecision(mode, task, device, cfg.patience, MAX_EVENTS_KEPT)
    return AmpPrecision(mode, task, device, cfg, MAX_EVENTS_KEPT)


def run_mode(mode: Mode, factory: Callable, where: str, device: torch.device, cfg: RunConfig,
             init_state: dict, sink: Any = None, metric_info: Optional[dict] = None) -> ModeResult:
    """Trains one mode from the initial weights in ``init_state`` (filled by warm_up, or by this
    run when it is empty) and returns its ModeResult. Errors become the result's status and reason, except
    KeyboardInterrupt and TaskError (the task is malformed, so every mode would fail alike:
    raised with the partial result as ``e.result``). ``sink`` (optional) gets
    ``on_step(step, scalars)`` and ``on_epoch(epoch, scalars)`` (TensorBoard); ``metric_info``
    receives the task's metric ``name`` and ``higher`` (is better)."""
    r = ModeResult(mode.name, mode.opt_level, mode.dtype_name)
    meter = MemoryMeter(device)
    r.memory_kind = meter.kind
    meter.start()
    precision = debugger = bar = None
    epoch_samples_seen: list[int] = []
    try:
        torch.manual_seed(cfg.seed)
        task = build_task(factory, device, where)
        if metric_info is not None:
            metric_info.update(name=task.metric_name, higher=task.higher_is_better)
        if not init_state:
            init_state.update({k: v.detach().to("cpu", copy=True) for k, v in task.model.state_dict().items()})
        else:
            try:
                task.model.load_state_dict(init_state)
            except RuntimeError as e:
                raise TaskError(f"{where}: the model differs between calls, so modes cannot start from the same "
                                f"weights: {one_line(e)}") from e
        precision = make_precision(mode, task, device, cfg)
        r.optimizer = precision.optimizer_name
        if mode.variant == "fp8" and device.type != "cuda":
            r.emulated, r.note = True, FP8_EMULATED
        if cfg.debug_forward:
            debugger = diagnostics.ForwardDebugger(task.model)
        per_epoch = _steps_per_epoch(task.train_loader, cfg.steps_per_epoch)
        from tqdm.auto import tqdm
        bar = tqdm(total=None if per_epoch is None else per_epoch * cfg.epochs, desc=f"{mode.name:8}",
                   unit="step", disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True, leave=True)
        nan_run = 0
        for epoch in range(cfg.epochs):
            task.model.train()
            avg = _Averager()
            epoch_samples = 0
            _sync(device)
            t0 = time.perf_counter()
            for batch in _capped(task.train_loader, cfg.steps_per_epoch):
                ts = time.perf_counter()
                x, y = _unpack(batch, "train_loader")
                x, y = _to(device, x), _to(device, y)
                task.optimizer.zero_grad(set_to_none=True)
                with precision.autocast():
                    out = task.model(x)
                    loss = precision.watch_loss(task.loss_fn(out, y))
                precision.backward_step(loss)
                loss_value = _num(loss)  # one host read per step, as most training loops log
                metric = _num(task.metric_fn(out.detach(), y)) if task.metric_fn is not None else None
                step_ms = 1e3 * (time.perf_counter() - ts)
                n = _batch_size(y, x)
                avg.add(loss_value, metric, n)
                epoch_samples += n
                r.steps += 1
                r.loss_curve.append(loss_value)
                r.scale_curve.append(precision.loss_scale())
                r.step_time_ms.append(step_ms)
                r.skipped_steps = precision.skipped
                if not math.isfinite(loss_value):
                    r.nan_loss_steps += 1
                    nan_run += 1
                    if nan_run >= cfg.patience:
                        raise Diverged(f"loss non-finite for {nan_run} steps in a row (since step {r.steps - nan_run})")
                else:
                    nan_run = 0
                precision.check()
                if sink is not None:
                    sink.on_step(r.steps, {"train/loss": loss_value, "loss_scale": r.scale_curve[-1],
                                           "skipped_steps": r.skipped_steps, "step_time_ms": step_ms,
                                           "memory_mb": meter.current_mb()})
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", scale=f"{r.scale_curve[-1]:g}", refresh=False)
            _sync(device)
            elapsed = time.perf_counter() - t0
            r.epoch_times.append(elapsed)
            epoch_samples_seen.append(epoch_samples)
            r.samples += epoch_samples
            r.epochs = epoch + 1
            r.train_loss, r.train_metric = avg.means(nonfinite_if_empty=avg.n_loss == 0 and epoch_samples > 0)
            r.val_loss, r.val_metric = evaluate(task, device, cfg.val_steps, precision.autocast)
            r.val_loss_curve.append(r.val_loss)
            r.val_metric_curve.append(r.val_metric)
            if sink is not None:
                sink.on_epoch(r.epochs, {"val/loss": r.val_loss, "val/metric": r.val_metric,
                                         "train/epoch_loss": r.train_loss, "epoch_time_s": elapsed})
        r.status = OK
        if r.val_loss is not None and not math.isfinite(r.val_loss):
            r.status, r.error = DIVERGED, "validation loss is NaN/inf at the end"
    except KeyboardInterrupt:
        r.status, r.error = FAILED, "interrupted"
        raise
    except (diagnostics.LossScaleStuckError, Diverged) as e:
        r.status, r.error = DIVERGED, str(e).replace("mixprec: ", "")
    except TaskError as e:
        r.status, r.error = FAILED, str(e)
        e.result = r
        raise
    except NoTorchEquivalent as e:  # this mode cannot run on this task; the others can
        r.status, r.error = FAILED, str(e)
    except ModeSkipped as e:  # nothing went wrong: the mode does not apply to this task or device
        r.status, r.error = SKIPPED, str(e)
    except Exception as e:  # an op without a kernel for this dtype, a user bug, ...: recorded, not fatal
        r.status, r.error = (OOM if is_oom(e) else FAILED), one_line(e)
    finally:
        if bar is not None:
            bar.close()
        _finish(r, meter, precision, debugger, epoch_samples_seen)
    return r


def _finish(r: ModeResult, meter: MemoryMeter, precision, debugger, epoch_samples: list[int]) -> None:
    if r.epoch_times:
        skip = 1 if len(r.epoch_times) > 1 else 0  # the first of several epochs is warm-up
        timed = sum(r.epoch_times[skip:])
        r.time_per_epoch = timed / (len(r.epoch_times) - skip)
        r.samples_per_s = sum(epoch_samples[skip:]) / timed if timed > 0 else None
    if precision is not None:
        r.skipped_steps = precision.skipped
        r.overflow_events = [vars(e) for e in precision.events]
        r.nonfinite_params = sorted({p for e in precision.events for p in e.params})
        if r.steps:
            r.final_loss_scale = precision.loss_scale()
            r.state_bytes_per_param, r.master_bytes_per_param = state_bytes(precision.optimizer)
        layers = getattr(precision, "fp8_layers", None)
        if layers:  # calls whose token count broke the tile rule ran plain F.linear: counted
            r.fp8_linears, r.fp8_fallbacks = len(layers), sum(m.fp8_state.fallbacks for m in layers)
        precision.close()
    if debugger is not None:
        if debugger.first is not None:
            r.first_nonfinite_module = str(debugger.first)
            if r.status != OK:
                r.error = f"{r.error}; first non-finite forward output: {r.first_nonfinite_module}"
        debugger.close()
    r.peak_memory_mb, r.peak_rss_mb = meter.peak()
