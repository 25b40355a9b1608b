# A CPU param group beside CUDA ones under one CUDA GradScaler: the CPU kernels must read the
# scale, found_inf and LAMB's global norm as they are after the GPU's queued work, not a pinned
# copy still in flight (torch's non-blocking device-to-CPU copy), on the checked and held paths.
from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.optimizers import FusedAdam, FusedLAMB

pytestmark = pytest.mark.cuda

SCALE = 2.0**10  # a power of two: scaled grads unscale exactly, so the reference needs no scaler


def busy_gpu():
    """Queues ~tens of ms of GPU work, so that a copy queued behind it is still in flight when the
    host goes on."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(30):
        x = torch.tanh(x @ x)
    return x


@pytest.mark.parametrize("family", [FusedAdam, FusedLAMB], ids=lambda f: f.__name__)
def test_cpu_group_steps_with_the_scalers_current_scale_and_flag(family, gen):
    cpu = torch.nn.Parameter(torch.randn(4099, generator=gen))
    gpu = torch.nn.Parameter(torch.randn(3, 1 << 16, generator=gen).cuda())
    ref_cpu = torch.nn.Parameter(cpu.detach().clone())
    ref_gpu = torch.nn.Parameter(gpu.detach().clone())
    opt = family([{"params": [gpu]}, {"params": [cpu]}], lr=1e-2)
    ref = family([{"params": [ref_gpu]}, {"params": [ref_cpu]}], lr=1e-2)
    scaler = mixprec.GradScaler("cuda", init_scale=SCALE, growth_interval=1000)
    for step in range(5):  # step 0 is checked, the later ones held
        g_cpu, g_gpu = torch.randn(4099, generator=gen), torch.randn(3, 1 << 16, generator=gen).cuda()
        skip = step == 3
        if skip:
            g_gpu[1, 7] = float("inf")  # an inf gradient on the GPU group
        opt.zero_grad()
        # d loss / d p = g exactly, times the scale (a power of two): one loss over both devices.
        loss = (gpu * g_gpu).sum() + (cpu * g_cpu).sum().to("cuda")
        scaler.scale(loss).backward()
        before = (cpu.detach().clone(), gpu.detach().clone())
        busy_gpu()
        scaler.step(opt)
        scaler.update()
        torch.cuda.synchronize()
        if skip:  # the inf was on the GPU: the CPU group must see the flag and skip too
            assert torch.equal(cpu.detach(), before[0]) and torch.equal(gpu.detach(), before[1]), f"step {step}"
            continue
        ref_cpu.grad, ref_gpu.grad = g_cpu, g_gpu
        ref.step()
        assert torch.equal(cpu.detach(), ref_cpu.detach()), f"step {step}: the CPU group"
        assert torch.equal(gpu.detach(), ref_gpu.detach()), f"step {step}: the CUDA group"
