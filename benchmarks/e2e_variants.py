"""The training variants of e2e_gpt2.py: torch's fp32 / autocast peers and mixprec's amp levels,
GradScaler and FusedAdam, each a Trainer that runs one step with its phases marked."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Optional

import torch

from e2e_phases import PHASES, PhaseClock
from gpt2_model import GPT, param_groups

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Hyper:
    lr: float = 3e-4  # the peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    # GPT-2's schedule (as nanoGPT trains it): a linear warm-up over the first lr_warmup_ratio of
    # the run, then a cosine decay to min_lr_ratio * lr at its last step. "constant" keeps lr flat:
    # without warm-up the first steps are chaotic, and a 300-step loss then differs by several
    # percent between correct runs (measured: torch.amp fp16 +4.4% vs fp32), hiding the precision.
    schedule: str = "cosine"
    lr_warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1

    def lr_at(self, step: int, total: int) -> float:
        """The learning rate of step ``step`` (0-based) of a ``total``-step run. Keyed to the step
        index, not to the updates applied: a step skipped for an overflow does not shift it."""
        if self.schedule == "constant":
            return self.lr
        warm = max(1, math.ceil(self.lr_warmup_ratio * total))
        if step < warm:
            return self.lr * (step + 1) / warm
        progress = (step - warm) / max(1, total - 1 - warm)  # 0 after the warm-up, 1 at the last step
        floor = self.min_lr_ratio * self.lr
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """One variant's model and optimizer. step() marks every phase of PhaseClock and returns the
    loss (a device tensor: reading it would sync); eval_loss() runs the forward without grads."""

    def __init__(self, model: GPT, autocast: Optional[torch.dtype], device: torch.device):
        self.model, self.device = model, device
        self.autocast = autocast
        self.optimizer: Optional[torch.optim.Optimizer] = None

    def _ctx(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def body(self, x: torch.Tensor, y: torch.Tensor, clock) -> torch.Tensor:
        """Forward, backward and optimizer step, marking forward, backward and loss_scale."""
        raise NotImplementedError

    def step(self, x: torch.Tensor, y: torch.Tensor, clock: PhaseClock) -> torch.Tensor:
        loss = self.body(x, y, clock)
        self.optimizer.zero_grad(set_to_none=True)
        clock.mark("optimizer")
        return loss

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._ctx():
            return self.model(x, y).float()

    def applied_steps(self) -> int:
        """Optimizer updates actually applied (a step skipped for inf/NaN gradients does not count);
        both torch's fused AdamW and mixprec's FusedAdam keep the count on the device. Syncs."""
        group = self.optimizer.param_groups[0]
        step = group.get("step")  # mixprec: per group
        if step is None:
            step = self.optimizer.state[group["params"][0]]["step"]  # torch: per param
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    def loss_scale(self) -> Optional[float]:
        return None


class AutocastTrainer(Trainer):
    """Plain fp32 (autocast None) or torch.autocast, with any optimizer and, for fp16, a GradScaler
    (torch's or mixprec's: both hand the scale to a fused optimizer's kernel)."""

    def __init__(self, model, autocast, device, optimizer, scaler=None):
        super().__init__(model, autocast, device)
        self.optimizer, self.scaler = optimizer, scaler

    def body(self, x, y, clock):
        with self._ctx():
            loss = self.model(x, y)
        clock.mark("forward")
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        clock.mark("backward")
        clock.mark("loss_scale")  # the scalers check inside step()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return loss.detach()

    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler is not None else None


class AmpTrainer(Trainer):
    """mixprec.amp.initialize at an opt level (Apex's API): under O2 the model is cast to the low
    dtype and FusedAdam keeps the fp32 masters, updating both in one kernel."""

    def __init__(self, model, device, optimizer, opt_level: str, dtype: torch.dtype,
                 layer_kernels: Optional[bool] = None, **amp_options):
        from mixprec import amp

        self.amp = amp
        # The model's own forward casts (O1 autocast, O2 input/output casts) are amp's, not ours;
        # so are its layer kernels (on by default where the model is cast). amp_options: more of
        # initialize's keywords (the lean variants' master_weights="remainder").
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0,
                                          layer_kernels=layer_kernels, **amp_options)
        super().__init__(model, None, device)
        self.optimizer = optimizer

    def body(self, x, y, clock):
        loss = self.model(x, y)
        clock.mark("forward")
        with self.amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
            clock.mark("backward")
        clock.mark("loss_scale")  # scale_loss's exit: the non-finite check and the scale update
        self.optimizer.step()
        return loss.detach()

    def loss_scale(self):
        return self.amp.loss_scale()


class _NoMarks:
    """A clock for a step being captured: nothing may be recorded between its kernels."""

    def mark(self, phase: str) -> None:
        pass


class GraphedTrainer(Trainer):
    """Another trainer's step captured in one CUDA graph and replayed.

    Eager PyTorch issues a large GPT-2 step as thousands of launches; once O2 has made the
    kernels short enough (50.5 ms of them on large, H200) the host's issuing (15-17 ms for the
    forward alone) sets the pace. A replay is one launch. Capture needs a step that never waits
    for the host, which mixprec's amp, GradScaler and optimizers are built to be (and torch's
    GradScaler with a fused, capturable AdamW), and an lr the kernels read from the device:
    set_lr fills a tensor. The first WARMUP steps run eagerly on a side stream (lazy state,
    cuBLAS workspaces); the next step is captured, then replayed on a copy of each batch. The
    phases cannot be told apart inside a replay: the whole step is marked as "forward"."""

    WARMUP = 3

    def __init__(self, inner: Trainer):
        if inner.device.type != "cuda":
            raise RuntimeError("GraphedTrainer: CUDA graphs need a CUDA device")
        super().__init__(inner.model, inner.autocast, inner.device)
        self.inner, self.optimizer = inner, inner.optimizer
        for group in self.optimizer.param_groups:  # read by the captured kernels, refilled by set_lr
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=inner.device)
            if "capturable" in group:  # torch's optimizers refuse a capture without it
                group["capturable"] = True
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.eager_steps = 0
        self.static: tuple = ()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"].fill_(lr)

    def step(self, x, y, clock):
        if self.graph is None and self.eager_steps < self.WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.inner.body(x, y, _NoMarks())
                self.optimizer.zero_grad(set_to_none=True)  # None before the capture: see below
            torch.cuda.current_stream().wait_stream(side)
            self.eager_steps += 1
        else:
            if self.graph is None:
                # Gradients are None here, so the captured backward writes them (not accumulates)
                # into tensors of the graph's pool, which every replay rewrites.
                self.static = (x.clone(), y.clone())
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.static_loss = self.inner.body(*self.static, _NoMarks())
            self.static[0].copy_(x)
            self.static[1].copy_(y)
            self.graph.replay()
            loss = self.static_loss.clone()  # the next replay overwrites static_loss
        for phase in PHASES:
            clock.mark(phase)
        return loss

    def loss_scale(self):
        return self.inner.loss_scale()


def train(trainer: Trainer, batches, hyper: Hyper, clock: PhaseClock) -> list[torch.Tensor]:
    """Runs ``clock.n_steps`` steps of ``trainer`` on ``batches`` with the schedule of ``hyper``,
    marked on ``clock`` (finished: its times can be read); returns each step's loss on the device."""
    losses = []
    for i in range(clock.n_steps):
        clock.begin(i)
        trainer.set_lr(hyper.lr_at(i, clock.n_steps))
        losses.append(trainer.step(*batches.train(i), clock))
    clock.finish()
    return losses


# ---- the variants (the optimizer and scaler builders are shared with e2e_distributed.py) --------


def torch_adamw(model, h: Hyper):
    return torch.optim.AdamW(param_groups(model, h.weight_decay), lr=h.lr, betas=h.betas, eps=h.eps, fused=True)


def fused_adam(model, h: Hyper, **options):
    """mixprec's FusedAdam as AdamW; options: its keywords beyond torch's (state_dtype, rounding, seed)."""
    from mixprec.optimizers import FusedAdam

    return FusedAdam(param_groups(model, h.weight_decay), lr=h.lr, betas=h.betas, eps=h.eps, adam_w_mode=True,
                     **options)


def torch_scaler(device):
    return torch.amp.GradScaler(device.type)


def mixprec_scaler(device):
    import mixprec

    return mixprec.GradScaler(device.type)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    dtype: str  # fp32, fp16, bf16
    peer: Optional[str]  # the torch variant of the same dtype its ratios are taken against
    about: str
    make: Callable[[GPT, torch.device, Hyper], Trainer]
    cuda_only: bool = False  # not in the default list on the CPU


def _autocast(dtype: Optional[str], opt, scaler=None):
    def make(model, device, h):
        return AutocastTrainer(model, DTYPES[dtype] if dtype else None, device, opt(model, h),
                               scaler(device) if scaler else None)
    return make


def _amp(level: str, dtype: str, fused_loss: bool = False, layer_kernels: Optional[bool] = None):
    def make(model, device, h):
        model.fused_loss = fused_loss
        return AmpTrainer(model, device, fused_adam(model, h), level, DTYPES[dtype], layer_kernels)
    return make


def _lean(level: str, state_dtype: torch.dtype = torch.float32, **amp_options):
    """bf16 at ``level`` with a lean optimizer state (issue 24, docs/optimizers.md): the moments in
    ``state_dtype`` (float32, bfloat16, or int8 for 8-bit block-quantized moments), and amp's
    ``master_weights="remainder"`` or FusedAdam's stochastic rounding through ``amp_options``."""
    rounding = amp_options.pop("rounding", None)

    def make(model, device, h):
        extra = {"rounding": rounding, "seed": 1234} if rounding else {}
        return AmpTrainer(model, device, fused_adam(model, h, state_dtype=state_dtype, **extra), level,
                          torch.bfloat16, **amp_options)
    return make


def _graphed(make_inner):
    def make(model, device, h):
        return GraphedTrainer(make_inner(model, device, h))
    return make


VARIANTS = {v.name: v for v in (
    Variant("fp32", "fp32", None, "fp32, TF32 matmuls; torch AdamW(fused=True)", _autocast(None, torch_adamw)),
    Variant("torch-fp16", "fp16", None, "torch.autocast fp16 + torch GradScaler + AdamW(fused=True)",
            _autocast("fp16", torch_adamw, torch_scaler)),
    Variant("torch-bf16", "bf16", None, "torch.autocast bf16 + AdamW(fused=True)", _autocast("bf16", torch_adamw)),
    Variant("mixprec-o2-fp16", "fp16", "torch-fp16", "mixprec amp O2 fp16, FusedAdam(adam_w_mode) with fp32 masters, "
            "mixprec's Linear and LayerNorm kernels", _amp("O2", "fp16")),
    Variant("mixprec-o2-bf16", "bf16", "torch-bf16", "mixprec amp O2 bf16, FusedAdam(adam_w_mode) with fp32 masters, "
            "mixprec's Linear and LayerNorm kernels", _amp("O2", "bf16")),
    Variant("mixprec-o2-fp16-xent", "fp16", "torch-fp16", "mixprec-o2-fp16 with the loss by mixprec.cross_entropy "
            "(fp32 softmax math, no fp32 copy of the logits)", _amp("O2", "fp16", fused_loss=True)),
    Variant("mixprec-o2-bf16-xent", "bf16", "torch-bf16", "mixprec-o2-bf16 with the loss by mixprec.cross_entropy",
            _amp("O2", "bf16", fused_loss=True)),
    Variant("torch-fp16-graph", "fp16", "torch-fp16", "torch-fp16 with its step captured in a CUDA graph and "
            "replayed (AdamW capturable)", _graphed(_autocast("fp16", torch_adamw, torch_scaler)), cuda_only=True),
    Variant("mixprec-o2-fp16-graph", "fp16", "torch-fp16", "mixprec-o2-fp16 with its step captured in a CUDA graph "
            "and replayed: no host launches left", _graphed(_amp("O2", "fp16")), cuda_only=True),
    Variant("mixprec-o2-fp16-xent-graph", "fp16", "torch-fp16", "mixprec-o2-fp16-xent in a CUDA graph",
            _graphed(_amp("O2", "fp16", fused_loss=True)), cuda_only=True),
    Variant("mixprec-o2-fp16-torch-layers", "fp16", "torch-fp16", "mixprec-o2-fp16 with torch's Linear and "
            "LayerNorm kernels (amp.initialize(layer_kernels=False))", _amp("O2", "fp16", layer_kernels=False)),
    Variant("mixprec-o2-bf16-torch-layers", "bf16", "torch-bf16", "mixprec-o2-bf16 with torch's Linear and "
            "LayerNorm kernels", _amp("O2", "bf16", layer_kernels=False)),
    Variant("mixprec-o3-fp16", "fp16", "torch-fp16", "mixprec amp O3 fp16 (pure fp16, no masters, loss scale 1 as "
            "Apex's O3), FusedAdam", _amp("O3", "fp16")),
    Variant("mixprec-o3-bf16", "bf16", "torch-bf16", "mixprec amp O3 bf16 (pure bf16, no masters), FusedAdam",
            _amp("O3", "bf16")),
    Variant("mixprec-o1-fp16", "fp16", "torch-fp16", "mixprec amp O1 fp16 (autocast), FusedAdam", _amp("O1", "fp16")),
    Variant("mixprec-o1-bf16", "bf16", "torch-bf16", "mixprec amp O1 bf16 (autocast), FusedAdam", _amp("O1", "bf16")),
    Variant("mixprec-scaler-fp16", "fp16", "torch-fp16", "torch.autocast fp16 + mixprec GradScaler + FusedAdam",
            _autocast("fp16", fused_adam, mixprec_scaler)),
    Variant("mixprec-adam-bf16", "bf16", "torch-bf16", "torch.autocast bf16 + mixprec FusedAdam",
            _autocast("bf16", fused_adam)),
    # Issue 24's lean O2 (optimizer state bytes per param, FusedAdam: O2 fp32 masters + fp32 moments 12).
    Variant("mixprec-o2-bf16-rem", "bf16", "torch-bf16", "mixprec-o2-bf16 with remainder masters (bf16 weight + "
            "int16 remainder, bit-exact fp32 masters; 10 bytes/param of state)",
            _lean("O2", master_weights="remainder")),
    Variant("mixprec-o2-bf16-rem-bf16m", "bf16", "torch-bf16", "mixprec-o2-bf16-rem with bf16 moments (6 bytes/param "
            "of state)", _lean("O2", torch.bfloat16, master_weights="remainder")),
    Variant("mixprec-o2-bf16-rem-q8", "bf16", "torch-bf16", "mixprec-o2-bf16-rem with 8-bit block-quantized moments "
            "(about 4 bytes/param of state)", _lean("O2", torch.int8, master_weights="remainder")),
    Variant("mixprec-o3-bf16-sr", "bf16", "torch-bf16", "mixprec amp O3 bf16 (no masters), FusedAdam rounding the "
            "weights stochastically (8 bytes/param of state)", _lean("O3", rounding="stochastic")),
)}
