"""mixprec.amp in the Hugging Face Trainer: MixprecTrainer, a Trainer that runs amp at an O-level on its
model and optimizer (pass a mixprec fused optimizer through ``optimizers=(...)`` for O2's fused masters)."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as err:  # an optional dependency: say what to install
    raise ImportError("mixprec.integrations.transformers needs the `transformers` package "
                      "(pip install transformers accelerate)") from err

from ._session import AmpSession

AMP_STATE_FILE = "mixprec_amp.pt"  # amp's loss scalers, beside the Trainer's optimizer.pt in each checkpoint


class _SaveAmpState(TrainerCallback):
    """Writes amp's scalers into the checkpoint folder the Trainer has just written (on_save)."""

    def __init__(self, session: AmpSession) -> None:
        self.session = session

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.session.initialized:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            torch.save(self.session.state_dict(), os.path.join(folder, AMP_STATE_FILE))


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
    clips (and ``grad_norm`` reports) the masters' unscaled gradients. Checkpoints hold amp's
    scalers (``mixprec_amp.pt``, beside ``optimizer.pt``, whose FusedAdam state has the masters)
    and ``train(resume_from_checkpoint=...)`` restores them. Not covered: the LR scheduler still
    advances on a skipped step, and DeepSpeed/FSDP (which create the optimizer after wrapping the
    model) and hyper-parameter search (other checkpoint folders) are untested.
    """

    def __init__(self, *args: Any, opt_level: str = "O2", dtype: torch.dtype = torch.float16, loss_scale: Any = None,
                 amp_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        session = AmpSession("MixprecTrainer", opt_level, dtype, loss_scale, **(amp_kwargs or {}))
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "fp16", False) or getattr(training_args, "bf16", False):
            raise ValueError("MixprecTrainer: args.fp16 and args.bf16 must be False: mixprec.amp casts and scales "
                             f"(opt_level={opt_level!r}, dtype={dtype}); accelerate's autocast and GradScaler on top "
                             "would scale twice")
        self._mixprec, self._mixprec_resume = session, None
        super().__init__(*args, **kwargs)
        self.add_callback(_SaveAmpState(session))

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        folder = resume_from_checkpoint
        if isinstance(folder, bool):
            folder = get_last_checkpoint(self.args.output_dir) if folder else None
        self._mixprec_resume = folder  # read once amp is initialized, in create_optimizer
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        self._mixprec.initialize(self.model, [optimizer])
        path = os.path.join(self._mixprec_resume, AMP_STATE_FILE) if self._mixprec_resume else None
        if path is not None and os.path.isfile(path):  # a plain Trainer's checkpoint has none: the scale starts fresh
            self._mixprec.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
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
