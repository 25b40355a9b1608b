"""The recipes of docs/amp.md, runnable: mixprec.amp (Apex's API) and mixprec.GradScaler (torch's),
each on a small regression problem, each checking what the guide claims about it.

    python examples/python/amp_guide.py                  # every recipe (CUDA if available, else CPU)
    python examples/python/amp_guide.py --recipe checkpoint --device cpu
"""

from __future__ import annotations

import argparse
import io
import math

import torch

import mixprec
from mixprec import amp
from mixprec.optimizers import FusedAdam


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8)).to(device)


def batches(device: torch.device, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 8, generator=gen)
    out = []
    for _ in range(n):
        x = torch.randn(64, 32, generator=gen)
        out.append((x.to(device), (x @ w).to(device)))
    return out


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def migrate(device: torch.device) -> None:
    """Apex's loop, with `from apex import amp` replaced by `from mixprec import amp`."""
    model = make_model(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    data = batches(device, 30)
    first = None
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
    print(f"  O2 fp16: loss {first:.3f} -> {loss.item():.3f}, loss scale {amp.loss_scale()}")
    assert loss.item() < first / 2
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32  # BN kept fp32


def bf16(device: torch.device) -> None:
    """The same loop in bfloat16: no loss scaling by default, fp32 masters kept."""
    model = make_model(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    for x, y in batches(device, 10):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    master = optimizer.state[model[0].weight]["master_param"]
    print(f"  O2 bf16: loss {loss.item():.3f}, model {model[0].weight.dtype}, master {master.dtype}, "
          f"loss scale {amp.loss_scale()}")
    assert model[0].weight.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert amp.loss_scale() == 1.0


def accumulation(device: torch.device) -> None:
    """Gradient accumulation over 4 micro-batches with delay_unscale, against one big batch."""
    accum = 4
    model = make_model(device)
    reference = make_model(device)
    for m in (model, reference):
        m.eval()  # no BatchNorm batch statistics: the micro-batches' gradients then sum to the batch's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=torch.float16, verbosity=0)
    x, y = batches(device, 1)[0]
    optimizer.zero_grad()
    for i, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        loss = loss_fn(model(xs), ys) / accum
        with amp.scale_loss(loss, optimizer, delay_unscale=i < accum - 1) as scaled_loss:
            scaled_loss.backward()
    grad = model[0].weight.grad.clone()
    optimizer.step()
    with torch.autocast(device.type, dtype=torch.float16):
        loss_fn(reference(x).float(), y).backward()
    err = ((grad - reference[0].weight.grad).norm() / reference[0].weight.grad.norm()).item()
    print(f"  4 micro-batches vs one batch: relative gradient difference {err:.1e}")
    assert err < 1e-2


def two_losses(device: torch.device) -> None:
    """Two losses (each with its own scale) and two optimizers, one overflow on loss 1."""
    model = make_model(device)
    body = FusedAdam(list(model[0].parameters()) + list(model[1].parameters()), lr=1e-2)
    head = torch.optim.SGD(model[3].parameters(), lr=1e-2, momentum=0.9)
    model, [body, head] = amp.initialize(model, [body, head], opt_level="O2", num_losses=2, verbosity=0)
    for step, (x, y) in enumerate(batches(device, 6)):
        for opt in (body, head):
            opt.zero_grad()
        out = model(x)
        with amp.scale_loss(loss_fn(out, y), [body, head], loss_id=0) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
        with amp.scale_loss(1e-3 * out.abs().mean(), [body, head], loss_id=1) as scaled_loss:
            scaled_loss.backward()
            if step == 3:  # as if loss 1 overflowed: the whole step is skipped
                model[3].weight.grad.view(-1)[0] = math.inf
        for opt in (body, head):
            opt.step()
    print(f"  scales {amp.loss_scale(0)} / {amp.loss_scale(1)}, skipped {amp.skipped_steps(0)} / "
          f"{amp.skipped_steps(1)}")
    assert amp.skipped_steps(0) == 0 and amp.skipped_steps(1) == 1 and amp.loss_scale(1) == 2.0**15


def checkpoint(device: torch.device) -> None:
    """Save and resume with master weights; the resumed run matches one that never stopped."""
    data = batches(device, 8)

    def setup():
        model = make_model(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # Apex-style masters in the groups
        return amp.initialize(model, optimizer, opt_level="O2", verbosity=0)

    def train(model, optimizer, part):
        for x, y in part:
            optimizer.zero_grad()
            with amp.scale_loss(loss_fn(model(x), y), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()

    model, optimizer = setup()
    train(model, optimizer, data)
    straight = [p.detach().clone() for p in model.parameters()]

    model, optimizer = setup()
    train(model, optimizer, data[:4])
    buffer = io.BytesIO()  # a file path works the same way
    torch.save(amp.checkpoint_state(model, optimizer), buffer)
    buffer.seek(0)
    model, optimizer = setup()  # a new process would start here
    amp.load_checkpoint_state(torch.load(buffer, weights_only=True), model, optimizer)
    train(model, optimizer, data[4:])
    same = all(torch.equal(a, b) for a, b in zip(straight, model.parameters()))
    print(f"  resumed run bit-identical to the uninterrupted one: {same}")
    assert same


def skipped_steps(device: torch.device) -> None:
    """Overflows skip the step on the device; counts and the scale history on request."""
    model = make_model(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=torch.float16, scale_history=8,
                                      verbosity=0)
    for step, (x, y) in enumerate(batches(device, 6)):
        optimizer.zero_grad()
        with amp.scale_loss(loss_fn(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
            if step in (1, 2):
                model[0].weight.grad.view(-1)[0] = math.nan
        optimizer.step()
    history = amp.scale_history(with_overflow=True)
    print(f"  skipped {amp.skipped_steps()}, history {history}")
    assert amp.skipped_steps() == 2 and [o for _, o in history] == [False, True, True, False, False, False]
    assert amp.loss_scale() == 2.0**14


def grad_scaler(device: torch.device) -> None:
    """mixprec.GradScaler where torch.amp.GradScaler was, with hysteresis and a history."""
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = mixprec.GradScaler(device.type, hysteresis=2, min_scale=1.0, history_size=16)
    for step, (x, y) in enumerate(batches(device, 8)):
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=low):
            loss = loss_fn(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in (2, 5):
            model[0].weight.grad.view(-1)[0] = math.inf
        scaler.step(optimizer)
        scaler.update()
    print(f"  scale {scaler.get_scale()}, skipped {scaler.skipped_steps}, "
          f"history {scaler.scale_history()}")
    # Two overflows, hysteresis 2: one backoff, on the second.
    assert scaler.skipped_steps == 2 and scaler.get_scale() == 2.0**15
    checkpointed = scaler.state_dict()
    torch_scaler = torch.amp.GradScaler(device.type)
    torch_scaler.load_state_dict(checkpointed)  # torch's scaler reads ours, ignoring the extras
    assert torch_scaler.get_scale() == scaler.get_scale()


def fused_loss(device: torch.device) -> None:
    """O2 with low-precision logits and mixprec.cross_entropy: no float32 copy of the logits."""
    vocab = 512
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 64), torch.nn.Linear(64, vocab)).to(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    # The outputs stay float16: mixprec.cross_entropy computes in float32 from them directly.
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", cast_model_outputs=torch.float16,
                                      verbosity=0)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (8, 33), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    first = None
    for _ in range(20):
        optimizer.zero_grad()
        logits = model(x)
        loss = mixprec.cross_entropy(logits, y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
    reference = torch.nn.functional.cross_entropy(logits.detach().float().flatten(0, 1), y.flatten())
    print(f"  logits {logits.dtype}, loss {first:.3f} -> {loss.item():.3f} "
          f"(F.cross_entropy on float32 logits: {reference.item():.3f})")
    assert logits.dtype == torch.float16 and loss.dtype == torch.float32
    assert abs(loss.item() - reference.item()) <= 1e-5 * reference.item()
    assert loss.item() < first * 0.8


RECIPES = {f.__name__: f for f in (migrate, bf16, accumulation, two_losses, checkpoint, skipped_steps, grad_scaler,
                                   fused_loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), nargs="*", default=list(RECIPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    for name in args.recipe:
        print(f"{name}: {RECIPES[name].__doc__.splitlines()[0]}")
        RECIPES[name](device)
    print("all recipes ran as documented")


if __name__ == "__main__":
    main()
