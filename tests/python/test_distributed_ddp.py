# mixprec under DistributedDataParallel, 2 gloo ranks on the CPU (marked cuda: 2 gloo ranks on
# the GPUs, NCCL on every GPU; dist_support.BACKENDS): amp at every opt level and
# mixprec.GradScaler keep the ranks identical when an overflow hits one rank only, match one
# process on the concatenated batch, and resume from checkpoints.
from __future__ import annotations

import math
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import mixprec
from dist_support import BACKENDS, full_params, loss_fn, make_batches, make_model, rel_update_err, run_ranks, shard_of
from mixprec import amp
from mixprec.distributed import LOCAL
from mixprec.optimizers import FusedAdam, FusedSGD

pytestmark = pytest.mark.distributed

STEPS = 5
INJECT = 2  # the step whose gradient goes non-finite on rank 1 only
#: (opt_level, dtype): O0 runs in fp32 whatever the dtype, so once.
LEVELS = [pytest.param(level, dtype, id=f"{level}-{str(dtype)[6:]}") for level, dtype in (
    ("O0", torch.float16), ("O1", torch.float16), ("O1", torch.bfloat16), ("O2", torch.float16),
    ("O2", torch.bfloat16), ("O3", torch.float16), ("O3", torch.bfloat16))]


def _wrap(model, device):
    return DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)


def _make_opt(kind: str, model):
    if kind == "fused_adam":
        return FusedAdam(model.parameters(), lr=1e-2, eps=1e-4)
    if kind == "fused_sgd":
        return FusedSGD(model.parameters(), lr=0.05, momentum=0.9)
    # torch's Adam: amp keeps O2's masters in its param groups and skips through the StepGuard.
    return torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)


def _train_amp(model, runner, opt, batches, rank, world, device, inject):
    snapshots = []
    for step, batch in enumerate(batches):
        x, y = shard_of(batch, rank, world, device)
        opt.zero_grad()
        with amp.scale_loss(loss_fn(runner(x), y), opt) as scaled:
            scaled.backward()
            if inject and step == INJECT and rank == 1:
                # After DDP's all-reduce: only this rank sees it.
                next(model.parameters()).grad.view(-1)[3] = math.inf
        opt.step()
        snapshots.append(full_params(model))
    return snapshots


def _amp_rank(rank, world, device, level, dtype, kind, seed, inject, local):
    model = make_model(seed).to(device)
    opt = _make_opt(kind, model)
    # Dynamic scaling at every level, starting at 2**8 so that only the injected step overflows.
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=dtype, loss_scale="dynamic",
                                max_loss_scale=2.0**8, verbosity=0, process_group=LOCAL if local else None)
    snapshots = _train_amp(model, _wrap(model, device), opt, make_batches(seed, STEPS, world), rank, world, device,
                           inject)
    return {"snapshots": snapshots, "skipped": amp.skipped_steps(), "scale": amp.loss_scale(),
            "param_dtype": str(next(model.parameters()).dtype)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level,dtype", LEVELS)
def test_amp_overflow_on_one_rank_skips_on_every_rank(backend, level, dtype, seed):
    results = run_ranks(_amp_rank, level, dtype, "fused_adam", seed, True, False, backend=backend[0],
                        device=backend[1])
    first = results[0]
    for r in results[1:]:
        for step, (a, b) in enumerate(zip(first["snapshots"], r["snapshots"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"ranks differ after step {step}"
        assert r["scale"] == first["scale"]
    for r in results:
        assert r["skipped"] == 1
        before, after = r["snapshots"][INJECT - 1], r["snapshots"][INJECT]
        assert all(torch.equal(x, y) for x, y in zip(before, after)), "the injected step was not skipped"
        assert any(not torch.equal(x, y) for x, y in zip(after, r["snapshots"][INJECT + 1])), "training stopped"
    assert first["scale"] == 2.0**7  # backed off once, from 2**8, on both ranks


@pytest.mark.parametrize("kind", ["torch_adam", "fused_sgd"])
def test_amp_o2_overflow_agreement_with_other_optimizers(kind, seed):
    results = run_ranks(_amp_rank, "O2", torch.float16, kind, seed, True, False)
    for a, b in zip(results[0]["snapshots"], results[1]["snapshots"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert results[0]["skipped"] == results[1]["skipped"] == 1


def test_local_process_group_lets_ranks_drift(seed):
    # The control: without agreement the injected rank alone skips, so the test above can fail.
    results = run_ranks(_amp_rank, "O2", torch.float16, "fused_adam", seed, True, True)
    assert [r["skipped"] for r in results] == [0, 1]
    assert any(not torch.equal(x, y) for x, y in zip(results[0]["snapshots"][-1], results[1]["snapshots"][-1]))


# Bounds on ‖DDP − one process‖ / ‖update‖ after STEPS steps. The runs differ only in how the
# gradient mean is summed (two half-batch means averaged, in the model's dtype under O2/O3, vs
# one full-batch mean), i.e. by rounding: ~1e-7 relative in fp32, a few ulps of the low dtype
# otherwise, carried through the steps. Seen: fp32 2e-7, fp16 1.3e-3, bf16 1e-2; a gradient
# mean off by the world size gives about 1.
def _tol(dtype: torch.dtype) -> float:
    return 10 * torch.finfo(dtype).eps


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level,dtype", LEVELS)
def test_amp_ddp_matches_one_process_on_the_concatenated_batch(backend, level, dtype, seed):
    # SGD, whose update is proportional to the gradient: Adam would hide a wrongly scaled mean.
    results = run_ranks(_amp_rank, level, dtype, "fused_sgd", seed, False, False, backend=backend[0],
                        device=backend[1])
    device = torch.device(backend[1])
    model = make_model(seed).to(device)
    start = full_params(model)
    opt = _make_opt("fused_sgd", model)
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=dtype, loss_scale="dynamic",
                                max_loss_scale=2.0**8, verbosity=0)
    ref = _train_amp(model, model, opt, make_batches(seed, STEPS, len(results)), 0, 1, device, False)
    tol = _tol(torch.float32 if level == "O0" else dtype)
    for r in results:
        assert r["skipped"] == 0
        err = rel_update_err(r["snapshots"][-1], ref[-1], start)
        assert err < tol, f"{level}/{dtype}: DDP vs one process differ by {err:.3g} of the update (bound {tol})"
    if level in ("O2", "O3"):
        assert results[0]["param_dtype"] == str(dtype)  # so are its gradients, which DDP all-reduces


def _scaler_rank(rank, world, device, kind, dtype, seed, local):
    model = make_model(seed).to(device)
    opt = _make_opt(kind, model)
    scaler = mixprec.GradScaler(device.type, init_scale=2.0**8, process_group=LOCAL if local else None)
    ddp = _wrap(model, device)
    snapshots = []
    for step, batch in enumerate(make_batches(seed, STEPS, world)):
        x, y = shard_of(batch, rank, world, device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            out = ddp(x)
        scaler.scale(loss_fn(out, y)).backward()
        if step == INJECT and rank == 1:
            model[2].weight.grad.view(-1)[5] = math.nan
        if kind == "torch_adam":  # the unscale_ path: clip, then a step that skips on the device
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        snapshots.append(full_params(model))
    return {"snapshots": snapshots, "skipped": scaler.skipped_steps, "scale": scaler.get_scale()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["fused_adam", "torch_adam"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_overflow_on_one_rank_skips_on_every_rank(backend, kind, dtype, seed):
    results = run_ranks(_scaler_rank, kind, dtype, seed, False, backend=backend[0], device=backend[1])
    for a, b in zip(results[0]["snapshots"], results[1]["snapshots"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for r in results:
        assert r["skipped"] == 1 and r["scale"] == 2.0**7
        assert all(torch.equal(x, y) for x, y in zip(r["snapshots"][INJECT - 1], r["snapshots"][INJECT]))


def test_grad_scaler_local_process_group_lets_ranks_drift(seed):
    results = run_ranks(_scaler_rank, "fused_adam", torch.float16, seed, True)
    assert [r["skipped"] for r in results] == [0, 1]
    assert any(not torch.equal(x, y) for x, y in zip(results[0]["snapshots"][-1], results[1]["snapshots"][-1]))


def _checkpoint_rank(rank, world, device, how, seed, path):
    """Trains 2 steps, checkpoints, trains 2 more (run A); then builds everything afresh, loads
    the checkpoint and trains the same 2 steps (run B). Returns both runs' parameters."""
    batches = make_batches(seed, 4, world)

    def build():
        model = make_model(seed).to(device)
        if how == "amp":
            opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-4)
            model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, max_loss_scale=2.0**8,
                                        verbosity=0)
            return model, opt, None
        opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-4)
        return model, opt, mixprec.GradScaler(device.type, init_scale=2.0**8, growth_interval=1)

    def train(model, ddp, opt, scaler, steps):
        for step in steps:
            x, y = shard_of(batches[step], rank, world, device)
            opt.zero_grad()
            if scaler is None:
                with amp.scale_loss(loss_fn(ddp(x), y), opt) as scaled:
                    scaled.backward()
                opt.step()
            else:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = ddp(x)
                scaler.scale(loss_fn(out, y)).backward()
                scaler.step(opt)
                scaler.update()

    model, opt, scaler = build()
    ddp = _wrap(model, device)
    train(model, ddp, opt, scaler, [0, 1])
    if how == "amp":  # masters, moments, step counts and the loss scale, from every rank alike
        state = amp.checkpoint_state(ddp, opt)
    elif how == "torch_save":
        state = {"model": ddp.state_dict(), "optim": opt.state_dict(), "scaler": scaler.state_dict()}
    if how == "dcp":
        import torch.distributed.checkpoint as dcp
        dcp.save({"train": mixprec.distributed.CheckpointState(ddp, opt, scaler)}, checkpoint_id=path)
    elif rank == 0:
        torch.save(state, os.path.join(path, "ckpt.pt"))
    torch.distributed.barrier()
    train(model, ddp, opt, scaler, [2, 3])
    run_a = full_params(model)
    saved_scale = amp.loss_scale() if how == "amp" else scaler.get_scale()

    model, opt, scaler = build()
    ddp = _wrap(model, device)
    if how == "dcp":
        import torch.distributed.checkpoint as dcp
        dcp.load({"train": mixprec.distributed.CheckpointState(ddp, opt, scaler)}, checkpoint_id=path)
    else:
        state = torch.load(os.path.join(path, "ckpt.pt"), map_location=device, weights_only=True)
        if how == "amp":
            amp.load_checkpoint_state(state, ddp, opt)
        else:
            ddp.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            scaler.load_state_dict(state["scaler"])
    train(model, ddp, opt, scaler, [2, 3])
    run_b = full_params(model)
    return {"a": run_a, "b": run_b, "scales": (saved_scale, amp.loss_scale() if how == "amp" else scaler.get_scale())}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["amp", "torch_save", "dcp"])
def test_checkpoint_round_trip_continues_identically(backend, how, seed, tmp_path):
    results = run_ranks(_checkpoint_rank, how, seed, str(tmp_path), backend=backend[0], device=backend[1])
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["a"], r["b"])), f"{how}: the resumed run differs"
        assert r["scales"][0] == r["scales"][1]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["b"], results[1]["b"]))


def _messages_rank(rank, world, device, seed):
    import logging
    import warnings

    from mixprec.amp import _scaler

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("mixprec.amp").addHandler(handler)
    logging.getLogger("mixprec.amp").setLevel(logging.INFO)  # initialize's messages too
    _scaler.LOG_INTERVAL_S = 0.0  # report every overflow
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixprec.GradScaler("cuda")  # no CUDA here: warns that it disables itself
    model = make_model(seed)
    model, opt = amp.initialize(model, FusedAdam(model.parameters()), opt_level="O1", verbosity=1)
    ddp = DDP(model)
    x, y = shard_of(make_batches(seed, 1, world)[0], rank, world, device)
    with amp.scale_loss(loss_fn(ddp(x), y), opt) as scaled:
        scaled.backward()
        next(model.parameters()).grad.view(-1)[0] = math.inf
    opt.step()
    return {"warnings": [str(w.message) for w in caught], "logs": records, "skipped": amp.skipped_steps()}


def test_warnings_and_logs_come_from_rank0_only(seed):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA, where GradScaler('cuda') warns")
    rank0, rank1 = run_ranks(_messages_rank, seed)
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert any("CUDA is not available" in w for w in rank0["warnings"])
    assert any("Gradient overflow" in m for m in rank0["logs"])
    assert any("Selected optimization level" in m for m in rank0["logs"])
    assert not any("CUDA is not available" in w for w in rank1["warnings"])
    assert rank1["logs"] == []  # nothing at all from mixprec.amp, initialize's messages included


def test_checkpoint_state_refuses_what_dcp_cannot_map(seed):
    model = make_model(seed)
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters()), opt_level="O2", verbosity=0)
    with pytest.raises(ValueError, match="amp.checkpoint_state"):
        mixprec.distributed.CheckpointState(model, opt)  # O2's masters live in the param groups
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        mixprec.distributed.CheckpointState(opt, opt)
    with pytest.raises(TypeError, match=r"optimizers\[1\]"):
        mixprec.distributed.CheckpointState(model, [FusedAdam(model.parameters()), model])
    state = mixprec.distributed.CheckpointState(make_model(seed), FusedAdam(make_model(seed).parameters()),
                                                mixprec.GradScaler("cpu"))
    with pytest.raises(KeyError, match="'scaler'"):
        state.load_state_dict({"model": {}, "optim": {}})
