"""mixprec.amp in the Hugging Face Trainer: MixprecTrainer, a Trainer that runs amp at an O-level on its
model and optimizer (pass a mixprec fused optimizer through ``optimizers=(...)`` for O2's fused masters)."""

from __future__ import annotations

from typing import Any, Optional

import torch

try:
    from transformers import Trainer
except ImportError as err:  # an optional dependency: say what to install
    raise ImportError("mixprec.integrations.transformers needs the `transformers` package "
                      "(pip install transformers accelerate)") from err

from ._session import AmpSession


class MixprecTrainer(Trainer):
    """``transformers.Trainer`` trained under ``mixprec.amp``.

    ``MixprecTrainer(model, args, ..., optimizers=(FusedAdam(model.parameters(), lr=...), None),
    opt_level="O2", dtype=torch.float16, loss_scale=None, amp_kwargs=None)``: every Trainer
    argument as usual; ``opt_level``, ``dtype`` and ``loss_scale`` are amp.initialize's
    (``amp_kwargs`` holds its other keywords). Leave ``args.fp16``/``args.bf16`` off: amp does
    the casting and scaling, and accelerate's autocast and GradScaler would add theirs on top.

    amp.initialize runs when the Trainer creates (or takes) its optimizer, before
    ``accelerator.prepare``. Each backward is scaled and then unscaled into the fp32 masters;
    an overflowing step is skipped on the device and the scale backs off; ``max_grad_norm``
    clips (and ``grad_norm`` reports) the masters' unscaled gradients. Not covered: amp's scale is
    not in the Trainer's checkpoints (a resumed run starts from the initial scale), the LR
    scheduler still advances on a skipped step, and DeepSpeed/FSDP (which create the optimizer
    after wrapping the model) are refused by amp.initialize.
    """

    def __init__(self, *args: Any, opt_level: str = "O2", dtype: torch.dtype = torch.float16, loss_scale: Any = None,
                 amp_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        session = AmpSession("MixprecTrainer", opt_level, dtype, loss_scale, **(amp_kwargs or {}))
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "fp16", False) or getattr(training_args, "bf16", False):
            raise ValueError("MixprecTrainer: args.fp16 and args.bf16 must be False: mixprec.amp casts and scales "
                             f"(opt_level={opt_level!r}, dtype={dtype}); accelerate's autocast and GradScaler on top "
                             "would scale twice")
        self._mixprec = session
        super().__init__(*args, **kwargs)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        self._mixprec.initialize(self.model, [optimizer])
        return optimizer

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator, session = self.accelerator, self._mixprec
        backward, clip = accelerator.backward, accelerator.clip_grad_norm_

        # The Trainer's backward and its clipping both go through these two accelerator calls
        # (a public API it has used for years); wrapped on this instance, they scale the loss and
        # clip the masters' unscaled gradients, whatever the Trainer's own loop looks like.
        def scaled_backward(loss: torch.Tensor, **kw: Any) -> None:
            session.backward(loss, self.optimizer, lambda scaled: backward(scaled, **kw), "training_step")

        def clip_masters(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
            # The Trainer passes model.parameters(): under O2 those are the fp16 copies, whose
            # gradients the step never reads.
            return clip(list(session.master_params(self.optimizer)), max_norm, norm_type=norm_type)

        accelerator.backward = scaled_backward
        accelerator.clip_grad_norm_ = clip_masters


__all__ = ["MixprecTrainer"]
