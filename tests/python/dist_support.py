# Runs a test function on several ranks of a torch.distributed process group (gloo on the CPU,
# gloo with CUDA tensors on one GPU or more, NCCL on two GPUs or more), each in its own process,
# and hands each rank's result back to the test; plus the small model, data and comparisons the
# distributed tests share.
from __future__ import annotations

import datetime
import importlib
import os
import tempfile
import time
from typing import Any, Callable

import pytest
import torch

#: Children of CUDA tests must not use NVLink multicast (NVLS), which the lent GPU machines lack.
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

#: (backend, device) pairs: gloo on the CPU in CI; gloo with CUDA tensors, two ranks sharing the
#: GPUs round-robin (one GPU is enough: mixprec's CUDA kernels, DDP and FSDP2 run on device while
#: gloo moves each collective through the host); NCCL on as many GPUs as the machine has.
BACKENDS = (
    pytest.param(("gloo", "cpu"), id="gloo"),
    pytest.param(("gloo", "cuda"), marks=pytest.mark.cuda, id="gloo-cuda"),
    pytest.param(("nccl", "cuda"), marks=pytest.mark.cuda, id="nccl"),
)


def world_size(backend: str, device: str) -> int:
    """2 ranks on the CPU and for gloo on GPUs; every GPU for NCCL (skipped below 2: NCCL refuses
    two ranks on one GPU)."""
    if device == "cpu" or backend == "gloo":
        return 2
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, found {n}")
    return n


def rank_device(rank: int, device: str) -> torch.device:
    """The device of ``rank``: the CPU, or GPU rank mod the GPU count."""
    return torch.device("cuda", rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")


def _entry(rank: int, fn: Callable, world: int, backend: str, device: str, tmp: str, args: tuple) -> None:
    os.environ.update(CHILD_ENV)
    torch.set_num_threads(1)  # tiny models; two ranks share this machine's cores
    kwargs: dict[str, Any] = {}
    dev = rank_device(rank, device)
    if device == "cuda":
        torch.cuda.set_device(dev)
        if backend == "nccl":  # binds the communicator to the rank's GPU at once
            kwargs["device_id"] = dev
    # A file store: no port to pick, none to collide with another test run on the machine.
    torch.distributed.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=120), **kwargs)
    try:
        result = fn(rank, world, dev, *args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(fn: Callable, *args: Any, backend: str = "gloo", device: str = "cpu", timeout: float = 240.0) -> list:
    """Calls ``fn(rank, world_size, device, *args)`` on every rank; returns their results (anything
    torch.save takes), rank 0 first. An exception on any rank fails the test with its traceback;
    the other ranks are ended. CPU ranks are forked (no second import of torch: each test stays a
    few seconds); CUDA ranks are spawned, as CUDA requires."""
    world = world_size(backend, device)
    if device == "cpu":
        # DDP's forward imports torch._dynamo (seconds): once here, every forked rank inherits it.
        importlib.import_module("torch._dynamo")  # (an `import torch._dynamo` here would make torch a local)
    old_env = {k: os.environ.get(k) for k in CHILD_ENV}
    os.environ.update(CHILD_ENV)  # spawned children start from the parent's environment
    try:
        with tempfile.TemporaryDirectory(prefix="mixprec-dist-") as tmp:
            ctx = torch.multiprocessing.start_processes(
                _entry, args=(fn, world, backend, device, tmp, args), nprocs=world, join=False,
                start_method="fork" if device == "cpu" else "spawn")
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    pytest.fail(f"the {world} ranks did not finish within {timeout} s (a collective hung?)")
            return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- model, data, comparisons ---------------------------------------------------------------------


def make_model(seed: int) -> torch.nn.Module:
    """No BatchNorm: its statistics are per rank under DDP, so the concatenated-batch comparison
    would not hold (SyncBatchNorm is a separate question). Tanh, not ReLU: a unit whose input sits
    near ReLU's kink can switch on in one run and off in the other after a rounding difference,
    which once (seed 2620487972, O1 fp16) put DDP 40x further from one process than rounding does
    (1.1e-2 of the update against 2-3e-4 at other seeds); with Tanh that seed gives 2.3e-4."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def make_batches(seed: int, steps: int, world: int, per_rank: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of ``world * per_rank`` samples; rank r trains on rows [r*per_rank, (r+1)*per_rank)."""
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(world * per_rank, 8, generator=g), torch.randn(world * per_rank, 4, generator=g))
            for _ in range(steps)]


def shard_of(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int, device) -> tuple:
    x, y = batch
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # A mean over the batch: DDP's and FSDP2's averaged gradients then equal the full batch's.
    return torch.nn.functional.mse_loss(out.float(), y)


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank (a collective), or ``t`` itself. Over gloo the
    shards are gathered from CPU copies: torch's functional collectives, which full_tensor()
    uses, crash the process with SIGSEGV on gloo with CUDA tensors (torch 2.11, H200; plain
    FSDP2, no mixprec: tmp repro of 2026-12-03), though c10d's own collectives work there."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device.type == "cuda" and torch.distributed.get_backend() == "gloo":
        return gather_full_through_cpu(t).to(t.device)
    return t.full_tensor()


_cpu_meshes: dict = {}


def gather_full_through_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t.full_tensor()`` computed on a CPU copy of the local shard over a CPU mesh of the same
    ranks (made once per mesh: a mesh can create process groups, which every rank must do alike)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    ranks = t.device_mesh.mesh.cpu()
    key = tuple(ranks.flatten().tolist()), tuple(ranks.shape)
    if key not in _cpu_meshes:
        _cpu_meshes[key] = DeviceMesh("cpu", ranks)
    on_cpu = DTensor.from_local(t.to_local().cpu(), _cpu_meshes[key], t.placements, run_check=False,
                                shape=t.shape, stride=t.stride())
    return on_cpu.full_tensor()


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter as a whole fp32 CPU tensor (DTensor shards gathered: a collective)."""
    return [gather_full(p.detach()).float().cpu().clone() for p in model.parameters()]


def rel_update_err(got: list[torch.Tensor], ref: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """‖got − ref‖ / ‖ref − start‖ over all parameters in float64: the difference of two
    training runs measured against how far training moved the parameters."""
    num = sum(float((g.detach().double() - r.detach().double()).pow(2).sum()) for g, r in zip(got, ref))
    den = sum(float((r.detach().double() - s.detach().double()).pow(2).sum()) for r, s in zip(ref, start))
    return (num / den) ** 0.5
