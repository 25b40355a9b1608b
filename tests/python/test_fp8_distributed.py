# FP8 scales agreed across ranks: 2 gloo ranks on the CPU training different shards under DDP end
# with identical scales and histories, equal to one process on the concatenated batch; delayed
# scaling reduces in one collective per step, current scaling in one per layer and direction;
# non-finite amaxes reach every rank; on CUDA (NCCL) the reduction never syncs the host.
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import random_tensor
from dist_support import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import fp8

pytestmark = pytest.mark.distributed

STEPS = 3
PER_RANK = 16  # tokens per rank: FP8 GEMMs need a multiple of 16


def _model(seed: int, recipe) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", g, 0.3))
    converted, _ = fp8.convert(model, recipe)
    assert converted == ["0", "2"]
    return model


def _batches(seed: int, world: int):
    # Rank r's shard is scaled by 4**r: the ranks' amaxes differ by far more than rounding.
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(STEPS):
        x = torch.cat([random_tensor((PER_RANK, 32), torch.float32, "cpu", g) * 4.0 ** r for r in range(world)])
        out.append((x, random_tensor((world * PER_RANK, 16), torch.float32, "cpu", g)))
    return out


def _states(model):
    # Delayed scaling's pending "amax" is this rank's own until the next step reduces it.
    return [{k: v.clone() for k, v in m.fp8_state.state_dict().items()
             if k != "amax" or m.fp8_state.recipe.scaling == "current"}
            for m in model.modules() if isinstance(m, fp8.Fp8Linear)]


def _train(model, runner, batches, rows, lr):
    """SGD on the rows of each batch; the loss is normalized by the whole batch, so each rank's
    output gradient equals the one-process run's rows (DDP then averages: lr carries the world)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for x, y in batches:
        opt.zero_grad()
        loss = (runner(x[rows]) - y[rows]).pow(2).sum() / x.shape[0]
        loss.backward()
        opt.step()
        history.append(_states(model))
    return history


class _CountOpCollectives(TorchDispatchMode):
    """Sizes of the all-reduces mixprec::fp8_linear runs itself (torch's functional collectives,
    called from C++): DDP's buckets and the Python reducer's go through other ops."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def _count_collectives(monkeypatch_target):
    calls = []
    real = torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    monkeypatch_target.all_reduce = counting
    return calls


def _rank(rank, world, device, scaling, seed):
    from mixprec.fp8 import distributed as fp8_dist

    model = _model(seed, fp8.Fp8Recipe(scaling=scaling))
    runner = DDP(model)
    # Counts the FP8 collectives only (DDP's bucket all-reduces go through the C++ reducer): the
    # Python reducer's (delayed scaling) and the op's own (current scaling).
    calls = _count_collectives(fp8_dist.dist)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    with _CountOpCollectives() as op_calls:
        history = _train(model, runner, _batches(seed, world), rows, lr=0.05 * world)
    # A model whose recipe names a group deep-copies (the recipe is shared: groups do not copy).
    named = _model(seed, fp8.Fp8Recipe(scaling=scaling, process_group=torch.distributed.group.WORLD))
    assert copy.deepcopy(named)[0].fp8_state.recipe is named[0].fp8_state.recipe
    return {"history": history, "calls": calls, "op_calls": op_calls.sizes}


@pytest.mark.parametrize("scaling", ("current", "delayed"))
def test_ranks_agree_and_match_one_process_on_the_concatenated_batch(scaling, seed):
    results = run_ranks(_rank, scaling, seed)
    world = len(results)
    # Without the reduction the ranks' input scales differ by 4x (their shards' ranges).
    for r in results[1:]:
        for step, (a, b) in enumerate(zip(results[0]["history"], r["history"])):
            for la, lb in zip(a, b):
                for key in la:
                    assert torch.equal(la[key], lb[key]), f"step {step}: ranks differ in {key}"
    ref_model = _model(seed, fp8.Fp8Recipe(scaling=scaling))
    ref = _train(ref_model, ref_model, _batches(seed, world), slice(None), lr=0.05)
    for step, (a, b) in enumerate(zip(results[0]["history"], ref)):
        for layer, (la, lb) in enumerate(zip(a, b)):
            for key in la:
                # Equal up to the rounding in which DDP's averaged gradients differ from one process's.
                torch.testing.assert_close(la[key], lb[key], rtol=1e-4 * step + 1e-6, atol=0,
                                           msg=lambda m: f"step {step} layer {layer} {key}: {m}")
    calls, op_calls = results[0]["calls"], results[0]["op_calls"]
    if scaling == "current":
        # Inside the op: per layer, the input's and the weight's amaxes together in the forward,
        # the output gradient's in the backward (layer 2's first there); nothing in Python.
        assert calls == [] and op_calls == [2, 2, 1, 1] * STEPS
    else:
        # One flattened buffer per step (nothing pending at the first step), in the next step's
        # first forward: the 2 layers' forward rows (input, weight) and backward rows (grad).
        assert op_calls == [] and calls == [6] * (STEPS - 1)


def _microbatch_steps(model, batches, rows):
    """Two forwards, then one backward through both graphs (gradient accumulation keeping both):
    each layer casts twice before a backward, so the backward finds its own rows still pending."""
    history = []
    for (x, y), (x2, y2) in zip(batches, batches[1:]):
        out, out2 = model(x[rows]), model(x2[rows])
        ((out - y[rows]).pow(2).sum() + (out2 - y2[rows]).pow(2).sum()).div(x.shape[0]).backward()
        history.append(_states(model))
    return history


def _microbatch_rank(rank, world, device, scaling, seed):
    from mixprec.fp8 import distributed as fp8_dist

    model = _model(seed, fp8.Fp8Recipe(scaling=scaling, amax_history_len=4))
    calls = _count_collectives(fp8_dist.dist)
    history = _microbatch_steps(model, _batches(seed, world), slice(rank * PER_RANK, (rank + 1) * PER_RANK))
    return {"history": history, "calls": calls}


@pytest.mark.parametrize("scaling", ("current", "delayed"))
def test_casts_out_of_step_order_still_reduce_before_every_update(scaling, seed):
    results = run_ranks(_microbatch_rank, scaling, seed)
    ref_model = _model(seed, fp8.Fp8Recipe(scaling=scaling, amax_history_len=4))
    ref = _microbatch_steps(ref_model, _batches(seed, len(results)), slice(None))
    for r in results:
        for step, (a, b) in enumerate(zip(r["history"], ref)):
            for layer, (la, lb) in enumerate(zip(a, b)):
                for key in la:
                    torch.testing.assert_close(la[key], lb[key], rtol=1e-5, atol=0,
                                               msg=lambda m: f"step {step} layer {layer} {key}: {m}")
    if scaling == "delayed":
        # A row is reduced just before an update would consume it while pending, together with
        # every other pending row: the second forward (the first one's 4 rows, and from then on
        # the previous backward's 2 as well) and the backward of the micro-batch that comes second
        # (the 4 forward rows and the first backward's 2 grad rows); never one per cast.
        assert results[0]["calls"] == [4, 6] + [6, 6] * (STEPS - 2)


def _non_finite_rank(rank, world, device, scaling, seed):
    model = _model(seed, fp8.Fp8Recipe(scaling=scaling))
    x = random_tensor((PER_RANK, 32), torch.float32, "cpu", torch.Generator().manual_seed(seed + rank))
    if rank == 1:
        x[3, 5] = math.nan
    outs = [model(x) for _ in range(2)]  # delayed scaling reduces the first call's amaxes in the second
    state = model[0].fp8_state
    return {"finite": [bool(o.isfinite().all()) for o in outs], "scale": state.scale.clone(),
            "history": state.amax_history.clone()}


@pytest.mark.parametrize("scaling", ("current", "delayed"))
def test_a_nan_on_one_rank_reaches_every_rank(scaling, seed):
    results = run_ranks(_non_finite_rank, scaling, seed)
    assert torch.equal(results[0]["scale"], results[1]["scale"])
    assert torch.equal(results[0]["history"], results[1]["history"])
    if scaling == "current":
        # Rank 0's own data are finite; its GEMM output is NaN because the reduced amax is not.
        assert [r["finite"] for r in results] == [[False, False], [False, False]]
    else:
        # Delayed scaling: the NaN (as inf, which a MAX cannot drop) enters every rank's history
        # and keeps every rank's input scale where it was; the output shows the local cast's own.
        for r in results:
            assert r["history"][0, 0] == math.inf and r["scale"][0] == 1.0
        assert [r["finite"] for r in results] == [[True, True], [False, False]]


def test_recipe_refuses_a_process_group_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"Fp8Recipe: process_group must be None or a torch.distributed.ProcessGroup"):
        fp8.Fp8Recipe(process_group="world")


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", ("current", "delayed"))
def test_cuda_reduction_never_syncs_the_host(scaling, seed, tmp_path, monkeypatch):
    """One NCCL rank with the group given in the recipe: the collective runs, and a training step
    (forward, backward, twice so that delayed scaling reduces) makes no synchronizing CUDA call."""
    dist = torch.distributed
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the lent GPU machines lack NVLink multicast
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        model = _model(seed, fp8.Fp8Recipe(scaling=scaling, process_group=dist.group.WORLD)).cuda()
        x = torch.randn(PER_RANK, 32, device="cuda", requires_grad=True)
        dist.all_reduce(torch.zeros(1, device="cuda"))  # the communicator is set up lazily (it syncs)
        model(x).sum().backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                model(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert model[0].fp8_state.scale.isfinite().all()
    finally:
        dist.destroy_process_group()
