# mixprec.amp O2 under Hugging Face accelerate on the CPU: trains exactly as amp by hand through
# accelerator.prepare/backward/clip, skips an overflowing step, and save_state/load_state restore it all.
from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from mixprec import amp  # noqa: E402
from mixprec.integrations import accelerate as mp_accelerate  # noqa: E402
from test_integrations_support import (  # noqa: E402
    CLIP,
    assert_o2_layout,
    assert_same,
    make_optimizer,
    reference_run,
    snapshot,
    tiny_data,
    tiny_net,
)

F = torch.nn.functional


def prepared(seed: int = 0, **amp_kwargs):
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    model = tiny_net(seed)
    model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), opt_level="O2", verbosity=0,
                                      **amp_kwargs)
    accelerator.register_for_checkpointing(amp)  # the loss scalers, beside the model and optimizer
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train(accelerator, model, optimizer, batches, epochs=1, inject_at=-1, before=None):
    losses = []
    for step, (x, y) in enumerate(batches * epochs):
        if before is not None:
            before.append({**snapshot(model, optimizer.optimizer), "scale": amp.loss_scale()})
        optimizer.zero_grad()
        out = model(x)
        if step == inject_at:
            out.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        loss = F.cross_entropy(out, y)
        mp_accelerate.backward(accelerator, loss, optimizer)
        mp_accelerate.clip_grad_norm_(accelerator, optimizer, CLIP)
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_accelerate_o2_trains_exactly_like_amp_by_hand(dtype):
    batches = tiny_data()
    accelerator, model, optimizer = prepared(dtype=dtype)
    losses = train(accelerator, model, optimizer, batches, epochs=3)
    assert isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer)
    assert_o2_layout(model, optimizer.optimizer, dtype)
    trained = snapshot(model, optimizer.optimizer)
    ref_model, ref_opt, ref_losses, norms = reference_run(tiny_net(0), batches, 3, "O2", dtype, clip=CLIP)
    assert sum(n > CLIP for n in norms) > len(norms) // 2
    assert losses == ref_losses and sum(losses[-4:]) < 0.8 * sum(losses[:4])
    assert_same(trained, snapshot(ref_model, ref_opt), "accelerate vs amp by hand")


def test_accelerate_skips_an_overflowing_step_and_resumes_bit_for_bit(tmp_path):
    batches, before = tiny_data(), []
    accelerator, model, optimizer = prepared()
    train(accelerator, model, optimizer, batches, epochs=3, inject_at=2, before=before)
    assert before[3].pop("scale") == before[2].pop("scale") / 2
    assert_same(before[3], before[2], "the overflowing step")
    assert any(not torch.equal(before[3][k], before[4][k]) for k in before[3] if k.startswith("model."))
    assert amp.skipped_steps() == 1
    full, full_scaler = snapshot(model, optimizer.optimizer), amp.state_dict()

    accelerator, model, optimizer = prepared()
    train(accelerator, model, optimizer, batches, epochs=2, inject_at=2)
    half, half_scaler = snapshot(model, optimizer.optimizer), amp.state_dict()
    accelerator.save_state(str(tmp_path / "state"))

    accelerator, model, optimizer = prepared(seed=1)  # other weights, a fresh scale
    accelerator.load_state(str(tmp_path / "state"))
    assert_same(snapshot(model, optimizer.optimizer), half, "accelerate load_state")
    assert amp.state_dict() == half_scaler and half_scaler["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    train(accelerator, model, optimizer, batches)
    assert_same(snapshot(model, optimizer.optimizer), full, "resumed vs uninterrupted")
    assert amp.state_dict() == full_scaler


def test_helpers_refuse_an_optimizer_amp_did_not_see():
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    model = tiny_net(0)
    plain = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.randn(2, 8)).sum()
    with pytest.raises(TypeError, match=r"accelerate.clip_grad_norm_: optimizer must be one that went through "
                                        r"amp.initialize.*AcceleratedOptimizer"):
        mp_accelerate.clip_grad_norm_(accelerator, plain, 1.0)
    with pytest.raises(TypeError, match=r"accelerate.backward: optimizer must be"):
        mp_accelerate.backward(accelerator, loss, plain)
    assert all(p.grad is None for p in model.parameters())
