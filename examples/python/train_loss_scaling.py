"""Trains a small MLP with mixprec's dynamic loss scaling, printing loss and loss scale per step.

Runs on the GPU in float16 autocast when there is one, else on the CPU in bfloat16 autocast. The
loss scale lives on the device: the unscale, the overflow check, the skip and the scale update
never wait on the host. A few steps have an inf injected into a gradient on purpose, so the log
shows a skipped step and the scale backing off.
"""

from __future__ import annotations

import argparse

import torch

import mixprec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inject-inf-at", type=int, nargs="*", default=[7, 19], help="steps whose grads get an inf")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).to(device)
    # A fused torch optimizer takes the loss scale and found_inf on the device and skips there.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    params = [p for p in model.parameters()]

    # Loss-scaler state, all on the device.
    scale = torch.full((1,), 2.0**16, device=device)
    growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
    skipped = torch.zeros(1, dtype=torch.int64, device=device)
    found_inf = torch.zeros(1, device=device)

    inputs = torch.randn(512, 64, device=device)
    targets = (inputs[:, :10] * 3).argmax(dim=1)
    for step in range(args.steps):
        with torch.autocast(device.type, dtype=amp_dtype):
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        (loss.float() * scale).backward()
        if step in args.inject_inf_at:
            params[0].grad.view(-1)[0] = float("inf")

        # One read-only pass finds inf/NaN; the fused step unscales in its kernel and does nothing
        # at all when found_inf is set. No host synchronization decides anything.
        found_inf.zero_()
        mixprec.non_finite_check_and_unscale_([p.grad for p in params], found_inf)
        optimizer.grad_scale, optimizer.found_inf = scale, found_inf  # how torch's fused steps take them
        optimizer.step()
        mixprec.update_scale_(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=10, skipped_steps=skipped)
        # Printing is the only host read, and it is for the log.
        print(f"step {step:3d}  loss {loss.item():.4f}  loss scale {scale.item():9.1f}  "
              f"skipped {int(skipped.item())}", flush=True)


if __name__ == "__main__":
    main()
