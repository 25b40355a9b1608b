# mixprec.integrations.transformers on the CPU: a tiny random Llama trained by MixprecTrainer under O2
# (no downloads): it learns, keeps fp16/bf16 params with fp32 masters, clips the masters, skips an inf step.
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mixprec import amp  # noqa: E402
from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402
from mixprec.optimizers import FusedAdam  # noqa: E402
from test_integrations_support import assert_o2_layout, assert_same, snapshot  # noqa: E402

MAX_NORM = 0.5
INJECT = 3  # the global step whose logits' gradient holds an inf


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def counting_data(n: int = 64, length: int = 16):
    """Each sequence counts up from a random token (mod the vocabulary): learnable in a few steps."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 32, (n, 1), generator=g)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in (starts + torch.arange(length)) % 32]


def training_args(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, max_grad_norm=MAX_NORM, seed=0,
                  lr_scheduler_type="constant", disable_tqdm=True, remove_unused_columns=False)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


class Recorder(transformers.TrainerCallback):
    """The state at each step's start (after the previous step) and the masters' gradient norm
    right before each optimizer step (after the Trainer clipped)."""

    def __init__(self):
        self.trainer, self.before, self.clipped = None, [], []

    def inner(self):
        return self.trainer.optimizer.optimizer  # accelerate's wrapper around the FusedAdam amp processed

    def on_step_begin(self, args, state, control, **kwargs):
        self.before.append({**snapshot(self.trainer.model, self.inner()), "scale": amp.loss_scale()})

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = [m.grad for m in amp.master_params(self.inner()) if m.grad is not None]
        self.clipped.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))


@pytest.mark.parametrize("dtype,loss_scale", [(torch.float16, None), (torch.bfloat16, "dynamic")],
                         ids=["fp16", "bf16-dynamic"])
def test_trainer_o2_learns_clips_masters_and_skips_an_inf_step(tmp_path, dtype, loss_scale):
    model, recorder = tiny_llama(), Recorder()

    def inject(module, inputs, logits):  # the loss stays finite, its gradient does not
        if trainer.state.global_step == INJECT and torch.is_grad_enabled():
            logits.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))

    # On lm_head, not the model: the model computes its loss inside forward, from these logits.
    model.lm_head.register_forward_hook(inject)
    trainer = MixprecTrainer(model=model, args=training_args(tmp_path), train_dataset=counting_data(),
                             optimizers=(FusedAdam(model.parameters(), lr=1e-2), None), callbacks=[recorder],
                             opt_level="O2", dtype=dtype, loss_scale=loss_scale, amp_kwargs={"verbosity": 0})
    recorder.trainer = trainer
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses, norms = [h["loss"] for h in logs], [h["grad_norm"] for h in logs]
    assert len(losses) == 12 and losses[-1] < 0.6 * losses[0], losses
    assert_o2_layout(model, recorder.inner(), dtype)
    # Clipping: the reported norm is the masters' unscaled one (finite, above MAX_NORM on most clean
    # steps) and what reaches the step is exactly MAX_NORM then; on the skipped step it is not finite.
    # (Clipping model.parameters() as the Trainer asks would see the fp16 grads, still scaled.)
    clean = [i for i in range(12) if i != INJECT]
    assert all(torch.isfinite(torch.tensor(norms[i])) for i in clean), norms
    assert sum(norms[i] > MAX_NORM for i in clean) > 6, norms
    for i in clean:
        assert recorder.clipped[i] == pytest.approx(min(norms[i], MAX_NORM), rel=1e-3), (i, recorder.clipped, norms)
    assert not torch.isfinite(torch.tensor(norms[INJECT]))
    # The overflowing step changed nothing and halved the scale; the next one trains.
    before, after, later = recorder.before[INJECT], recorder.before[INJECT + 1], recorder.before[INJECT + 2]
    assert after.pop("scale") == before.pop("scale") / 2
    later.pop("scale")
    assert_same(after, before, "the overflowing step")
    assert any(not torch.equal(after[k], later[k]) for k in after if k.startswith("model."))
    assert amp.skipped_steps() == 1


def test_trainer_checkpoint_resumes_bit_for_bit(tmp_path):
    def run(seed, max_steps, folder, resume=None, **overrides):
        model = tiny_llama(seed)

        def inject(module, inputs, logits):  # an overflow before the checkpoint: the scale halves
            if trainer.state.global_step == 1 and torch.is_grad_enabled():
                logits.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))

        model.lm_head.register_forward_hook(inject)
        trainer = MixprecTrainer(model=model, args=training_args(folder, max_steps=max_steps, **overrides),
                                 train_dataset=counting_data(), optimizers=(FusedAdam(model.parameters(), lr=1e-2), None),
                                 amp_kwargs={"verbosity": 0})
        trainer.train(resume_from_checkpoint=resume)
        return snapshot(model, trainer.optimizer.optimizer), amp.state_dict()

    full, full_scaler = run(0, 8, tmp_path / "full")
    run(0, 4, tmp_path / "half", save_strategy="steps", save_steps=4)
    saved = torch.load(tmp_path / "half" / "checkpoint-4" / "mixprec_amp.pt", weights_only=True)
    assert saved["loss_scaler0"]["loss_scale"] == 2.0 ** 15 and saved["loss_scaler0"]["_skipped_steps"] == 1
    resumed, scaler = run(1, 8, tmp_path / "half", resume=True)  # other initial weights
    assert_same(resumed, full, "resumed vs uninterrupted")
    assert scaler == full_scaler


def test_accelerates_own_mixed_precision_is_refused(tmp_path):
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"MixprecTrainer: args.fp16 and args.bf16 must be False"):
        MixprecTrainer(model=model, args=training_args(tmp_path, bf16=True), train_dataset=counting_data(),
                       opt_level="O2")
    with pytest.raises(ValueError, match=r"MixprecTrainer: opt_level must be one of"):
        MixprecTrainer(model=model, args=training_args(tmp_path), opt_level="o2")
    assert all(p.dtype == torch.float32 for p in model.parameters())
