# mixprec under FSDP2 (fully_shard), 2 gloo ranks on the CPU (marked cuda: 2 gloo ranks on the
# GPUs, NCCL on every GPU; dist_support.BACKENDS):
# fused optimizers on sharded DTensor parameters with sharded master weights (LAMB and NovoGrad
# with norms of whole tensors reduced across ranks), GradScaler's found_inf agreed over the
# shards, the MixedPrecisionPolicy route to O2 against amp's O2 in one process,
# torch.distributed.checkpoint round trips, and clear errors where sharding cannot work.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from dist_support import (BACKENDS, full_params, gather_full, loss_fn, make_batches, make_model, rel_update_err,
                          run_ranks, shard_of)
from mixprec import amp
from mixprec.distributed import LOCAL, CheckpointState, mixed_precision_policy
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

pytestmark = pytest.mark.distributed

STEPS = 5
INJECT = 2
OPTIMIZERS = {
    "adam": lambda ps, mw: FusedAdam(ps, lr=1e-2, eps=1e-4, weight_decay=0.01, master_weights=mw),
    "sgd": lambda ps, mw: FusedSGD(ps, lr=0.05, momentum=0.9, master_weights=mw),
    "adagrad": lambda ps, mw: FusedAdagrad(ps, lr=0.05, master_weights=mw),
    # Norms of whole tensors: LAMB's global gradient norm (clipping active: max_grad_norm below
    # this model's gradient norm) and trust ratios, NovoGrad's per-tensor second moments.
    "lamb": lambda ps, mw: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.05, master_weights=mw),
    "nvlamb": lambda ps, mw: FusedLAMB(ps, lr=1e-2, weight_decay=0.0, adam_w_mode=False, use_nvlamb=True,
                                       max_grad_norm=0.0, master_weights=mw),
    "novograd": lambda ps, mw: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01, master_weights=mw),
    "novograd_inf": lambda ps, mw: FusedNovoGrad(ps, lr=1e-2, norm_type=0, master_weights=mw),
    "torch_adamw": lambda ps, mw: torch.optim.AdamW(ps, lr=1e-2, eps=1e-4),  # the StepGuard path
}


def _shard(model, policy=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy or MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _build(mode, kind, dtype, seed, device, local=False):
    """mode "fp32": fp32 throughout; "o2": fp32 sharded params (the masters), computed in
    ``dtype`` through FSDP2's MixedPrecisionPolicy; "masters": a ``dtype`` model whose fp32
    masters the fused optimizer keeps, sharded alongside. Both scale the loss with
    mixprec.GradScaler (fp16 gradients of this model underflow without it)."""
    model = make_model(seed).to(device)
    if mode == "masters":
        model = model.to(dtype)
    _shard(model, mixed_precision_policy("O2", dtype) if mode == "o2" else None)
    opt = OPTIMIZERS[kind](model.parameters(), mode == "masters")
    scaler = None
    if mode != "fp32":
        scaler = mixprec.GradScaler(device.type, init_scale=2.0**8, process_group=LOCAL if local else None)
    return model, opt, scaler


def _train(model, opt, scaler, batches, steps, rank, world, device, inject=False, snapshots=None):
    for step in steps:
        x, y = shard_of(batches[step], rank, world, device)
        x = x.to(next(model.parameters()).dtype)  # a "masters" model is low precision itself
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if inject and step == INJECT and rank == 1:
            # This rank's shard of the first layer's gradient: rank 0 cannot see it.
            model[0].weight.grad.to_local().view(-1)[3] = math.inf
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if snapshots is not None:
            snapshots.append(full_params(model))


def _state_layout(opt, param):
    return {k: (type(v).__name__, str(getattr(v, "placements", None)), str(v.dtype))
            for k, v in opt.state[param].items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def _fsdp_rank(rank, world, device, mode, kind, dtype, seed, inject, local):
    model, opt, scaler = _build(mode, kind, dtype, seed, device, local)
    snapshots = []
    _train(model, opt, scaler, make_batches(seed, STEPS, world), range(STEPS), rank, world, device, inject, snapshots)
    masters = [gather_full(opt.state[p]["master_param"]).cpu() for p in model.parameters()] if mode == "masters" else None
    return {"snapshots": snapshots, "masters": masters, "layout": _state_layout(opt, model[0].weight),
            "skipped": scaler.skipped_steps if scaler else 0, "scale": scaler.get_scale() if scaler else 1.0}


def _reference(mode, kind, dtype, seed, world, device):
    """One process on the concatenated batch: the plain model, or amp's O2 for the FSDP2 routes.
    Returns the fp32 parameters (masters) at the start and at the end."""
    model = make_model(seed).to(device)
    if mode == "masters":  # those masters start from the low-precision model's values
        model = model.to(dtype).float()
    start = full_params(model)
    if mode == "fp32":
        opt = OPTIMIZERS[kind](model.parameters(), False)
    else:
        opt = OPTIMIZERS[kind](model.parameters(), False)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, loss_scale="dynamic",
                                    max_loss_scale=2.0**8, verbosity=0)
    for x, y in make_batches(seed, STEPS, world):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        if mode == "fp32":
            loss_fn(model(x), y).backward()
        else:
            with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
                scaled.backward()
        opt.step()
    return start, [m.detach().float().cpu() for m in amp.master_params(opt)] if mode != "fp32" else full_params(model)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,kind,dtype", [
    ("fp32", "adam", torch.float32), ("fp32", "sgd", torch.float32), ("fp32", "adagrad", torch.float32),
    ("fp32", "lamb", torch.float32), ("fp32", "nvlamb", torch.float32), ("fp32", "novograd", torch.float32),
    ("fp32", "novograd_inf", torch.float32), ("o2", "sgd", torch.float16), ("o2", "sgd", torch.bfloat16),
    ("masters", "sgd", torch.float16), ("masters", "sgd", torch.bfloat16), ("masters", "lamb", torch.bfloat16)])
def test_fsdp2_matches_one_process_on_the_concatenated_batch(backend, mode, kind, dtype, seed):
    results = run_ranks(_fsdp_rank, mode, kind, dtype, seed, False, False, backend=backend[0], device=backend[1])
    start, ref = _reference(mode, kind, dtype, seed, len(results), torch.device(backend[1]))
    # fp32: reduction order only (seen 1.5e-7). The low-precision routes round gradients
    # differently from amp's O2 in one process (per-rank gradients rounded to the low dtype,
    # then reduced), by a few ulps (seen 0.3 eps in fp16, up to 2.4 eps in bf16). SGD, not
    # Adam: Adam's normalization turns rounding in near-zero gradients into whole updates.
    tol = 1e-5 if mode == "fp32" else 10 * torch.finfo(dtype).eps
    for r in results:
        err = rel_update_err(r["masters"] or r["snapshots"][-1], ref, start)
        assert err < tol, f"{mode}/{kind}/{dtype}: FSDP2 vs one process differ by {err:.3g} of the update"
        assert r["skipped"] == 0
        # State and masters are DTensors sharded like the parameter.
        for key, (cls, placements, state_dtype) in r["layout"].items():
            assert cls == "DTensor" and "Shard(dim=0)" in placements, (key, cls, placements)
        if mode == "masters":
            assert r["layout"]["master_param"][2] == "torch.float32"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["adam", "torch_adamw"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fsdp2_overflow_in_one_shard_skips_on_every_rank(backend, kind, dtype, seed):
    results = run_ranks(_fsdp_rank, "o2", kind, dtype, seed, True, False, backend=backend[0], device=backend[1])
    for r in results:
        assert r["skipped"] == 1 and r["scale"] == 2.0**7
        assert all(torch.equal(a, b) for a, b in zip(r["snapshots"][INJECT - 1], r["snapshots"][INJECT]))
        assert any(not torch.equal(a, b) for a, b in zip(r["snapshots"][INJECT], r["snapshots"][INJECT + 1]))


def test_fsdp2_without_agreement_the_clean_shards_step(seed):
    # The control: rank 0 sees no overflow in its shard and steps, rank 1 skips.
    results = run_ranks(_fsdp_rank, "o2", "adam", torch.float16, seed, True, True)
    assert [r["skipped"] for r in results] == [0, 1]
    before, after = results[0]["snapshots"][INJECT - 1], results[0]["snapshots"][INJECT]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def _amp_o1_rank(rank, world, device, dtype, seed):
    # O1 casts per op (autocast), not the parameters, so amp.initialize takes a sharded model;
    # the overflow checks of the DTensor gradients' shards are agreed over the ranks.
    model = _shard(make_model(seed).to(device))
    model, opt = amp.initialize(model, FusedAdam(model.parameters(), lr=1e-2, eps=1e-4), opt_level="O1", dtype=dtype,
                                loss_scale="dynamic", max_loss_scale=2.0**8, verbosity=0)
    batches, snapshots = make_batches(seed, STEPS, world), []
    for step in range(STEPS):
        x, y = shard_of(batches[step], rank, world, device)
        opt.zero_grad()
        with amp.scale_loss(loss_fn(model(x), y), opt) as scaled:
            scaled.backward()
            if step == INJECT and rank == 1:
                model[0].weight.grad.to_local().view(-1)[3] = math.nan
        opt.step()
        snapshots.append(full_params(model))
    return {"snapshots": snapshots, "skipped": amp.skipped_steps()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fsdp2_amp_o1_overflow_in_one_shard_skips_on_every_rank(backend, dtype, seed):
    for r in run_ranks(_amp_o1_rank, dtype, seed, backend=backend[0], device=backend[1]):
        assert r["skipped"] == 1
        assert all(torch.equal(a, b) for a, b in zip(r["snapshots"][INJECT - 1], r["snapshots"][INJECT]))
        assert any(not torch.equal(a, b) for a, b in zip(r["snapshots"][INJECT], r["snapshots"][INJECT + 1]))


def _dcp_rank(rank, world, device, mode, kind, dtype, seed, path):
    import torch.distributed.checkpoint as dcp

    batches = make_batches(seed, 4, world)
    model, opt, scaler = _build(mode, kind, dtype, seed, device)
    _train(model, opt, scaler, batches, [0, 1], rank, world, device)
    dcp.save({"train": CheckpointState(model, opt, scaler)}, checkpoint_id=path)
    masters = [gather_full(opt.state[p]["master_param"]) for p in model.parameters()] if mode == "masters" else []
    _train(model, opt, scaler, batches, [2, 3], rank, world, device)
    run_a = full_params(model)

    model, opt, scaler = _build(mode, kind, dtype, seed, device)
    dcp.load({"train": CheckpointState(model, opt, scaler)}, checkpoint_id=path)
    loaded = [gather_full(opt.state[p]["master_param"]) for p in model.parameters()] if mode == "masters" else []
    _train(model, opt, scaler, batches, [2, 3], rank, world, device)
    return {"a": run_a, "b": full_params(model), "masters": (masters, loaded)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,kind,dtype", [("o2", "adam", torch.float16), ("masters", "adam", torch.bfloat16),
                                             ("fp32", "sgd", torch.float32), ("masters", "lamb", torch.float16),
                                             ("fp32", "novograd", torch.float32)])
def test_fsdp2_dcp_checkpoint_round_trip_continues_identically(backend, mode, kind, dtype, seed, tmp_path):
    results = run_ranks(_dcp_rank, mode, kind, dtype, seed, str(tmp_path), backend=backend[0], device=backend[1])
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["a"], r["b"])), "the resumed run differs"
        saved, loaded = r["masters"]
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded))


def _amp_refusal_rank(rank, world, device, seed):
    model = _shard(make_model(seed).to(device))
    before = full_params(model)
    try:
        amp.initialize(model, FusedAdam(model.parameters()), opt_level="O2", verbosity=0)
        message = None
    except RuntimeError as e:
        message = str(e)
    return {"amp": message, "unchanged": all(torch.equal(a, b) for a, b in zip(before, full_params(model)))}


def test_fsdp2_amp_initialize_refuses_to_cast_a_sharded_model(seed):
    # FSDP2 owns the storage of its parameters: O2 goes through its MixedPrecisionPolicy instead.
    for r in run_ranks(_amp_refusal_rank, seed):
        assert "mixed_precision_policy" in r["amp"] and r["unchanged"]


class _Stack(torch.nn.Module):
    """Residual blocks, then a LayerNorm and a head that stay in the root unit (a GPT's ln_f and
    LM head): what the inner units hand over must be in the low dtype."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)) for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def _root_and_inner_rank(rank, world, device, seed):
    from torch.distributed.fsdp import fully_shard

    model = _Stack(seed).to(device)
    for block in model.blocks:
        fully_shard(block, mp_policy=mixed_precision_policy("O2", torch.bfloat16, root=False))
    fully_shard(model, mp_policy=mixed_precision_policy("O2", torch.bfloat16))
    seen = {}

    def note_input(module, args):  # returns None: the input goes on unchanged
        seen.setdefault("norm_input", args[0].dtype)

    model.norm.register_forward_pre_hook(note_input)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    losses = []
    x, y = shard_of(make_batches(seed, 1, world)[0], rank, world, device)
    for _ in range(5):  # one batch again and again: its loss must fall
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"norm_input": seen["norm_input"], "out": out.dtype, "losses": losses,
            "params": {p.dtype for p in model.parameters()}}


def test_docs_fsdp2_recipe_root_and_inner_policies(seed):
    # docs/distributed.md's O2 recipe on a model with layers after its blocks: the blocks' outputs
    # stay bf16 into the root's LayerNorm (an fp32 output there failed: "mixed dtype"), the model's
    # output is fp32, the sharded params stay fp32 (the masters), and training runs.
    for r in run_ranks(_root_and_inner_rank, seed):
        assert r["norm_input"] == torch.bfloat16 and r["out"] == torch.float32
        assert r["params"] == {torch.float32}
        assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0]


def test_mixed_precision_policy_maps_opt_levels():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    o2 = mixed_precision_policy("O2", torch.float16)
    assert (o2.param_dtype, o2.reduce_dtype, o2.output_dtype) == (torch.float16, torch.float32, torch.float32)
    inner = mixed_precision_policy("O2", torch.float16, root=False)
    assert (inner.param_dtype, inner.reduce_dtype, inner.output_dtype) == (torch.float16, torch.float32, None)
    o3 = mixed_precision_policy("O3", torch.bfloat16)
    assert (o3.param_dtype, o3.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert mixed_precision_policy("O0") == MixedPrecisionPolicy()
    with pytest.raises(ValueError, match="torch.autocast"):
        mixed_precision_policy("O1")
    with pytest.raises(ValueError, match="dtype"):
        mixed_precision_policy("O2", torch.float32)
    with pytest.raises(ValueError, match="opt_level"):
        mixed_precision_policy("O4")


def _dtensor_inputs_rank(rank, world, device, seed):
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(6, 4, generator=g).to(device) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    full[3] = full[3].abs()
    out = {}

    def adam(tensors):
        p, gr, m, v = tensors
        mixprec.adam_([p], [gr], [m], [v], lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, step=1)

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except (ValueError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    # Sharded alike: the local op equals the op on whole tensors.
    sharded = [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in full]
    adam(sharded)
    whole = [t.clone() for t in full]
    adam(whole)
    out["sharded_matches"] = all(torch.equal(s.full_tensor(), w) for s, w in zip(sharded, whole))
    out["changed"] = not torch.equal(whole[0], full[0])
    mixed = [distribute_tensor(t.clone(), mesh, [Shard(1) if i == 2 else Shard(0)]) for i, t in enumerate(full)]
    attempt("placements", lambda: adam(mixed))
    partial = [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in full]
    partial[1] = type(partial[1]).from_local(full[1].clone(), mesh, [Partial()])  # a gradient not yet summed
    attempt("partial", lambda: adam(partial))
    replicated = distribute_tensor(full[0].clone(), mesh, [Replicate()])
    out["norm_replicated"] = torch.equal(mixprec.multi_tensor_norm([replicated])[0], mixprec.multi_tensor_norm([full[0]])[0])
    # Norms of whole tensors from shards: unevenly sharded (a 1-row tensor leaves rank 1 an empty
    # shard), mixed with replicated and plain ones, L2 and infinity norms.
    odd = torch.randn(1, 4, generator=g).to(device)
    mixed_norm_inputs = [sharded[0], distribute_tensor(odd.clone(), mesh, [Shard(0)]), replicated, full[1]]
    whole_inputs = [sharded[0].full_tensor(), odd, full[0], full[1]]  # sharded[0] took the Adam step above
    out["norms"] = {}
    for ord in (2.0, math.inf):
        total, per = mixprec.multi_tensor_norm(mixed_norm_inputs, ord, per_tensor=True)
        want_total, want_per = mixprec.multi_tensor_norm(whole_inputs, ord, per_tensor=True)
        out["norms"][ord] = (float(total), float(want_total), per.cpu(), want_per.cpu())
    # LAMB (split step, trust ratios) and NovoGrad (second moments) on shards = on whole tensors.
    out["lamb"] = _fused_on_shards_vs_whole(mesh, g, device, "lamb")
    out["novograd"] = _fused_on_shards_vs_whole(mesh, g, device, "novograd")
    plain_state = [sharded[0], sharded[1], full[2].clone(), sharded[3]]
    attempt("plain_state", lambda: adam(plain_state))
    return out


def _fused_on_shards_vs_whole(mesh, g, device, op):
    """The largest relative difference between ``op`` (lamb or novograd, with fp32 masters of
    bf16 params) stepped on Shard(0) DTensors, some sharded unevenly, and on the whole tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    shapes = [(6, 4), (1, 4), (5, 3), (2,)]
    params = [torch.randn(s, generator=g).to(device, torch.bfloat16) for s in shapes]
    lists = dict(params=params, grads=[torch.randn(s, generator=g).to(device, torch.bfloat16) for s in shapes],
                 exp_avgs=[0.1 * torch.randn(s, generator=g).to(device) for s in shapes],
                 masters=[p.float() for p in params])
    if op == "lamb":
        lists["exp_avg_sqs"] = [0.01 * torch.rand(s, generator=g).to(device) for s in shapes]
    whole = {k: [t.clone() for t in v] for k, v in lists.items()}
    shards = {k: [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in v] for k, v in lists.items()}
    for ls in (whole, shards):
        if op == "lamb":
            mixprec.lamb_(ls["params"], ls["grads"], ls["exp_avgs"], ls["exp_avg_sqs"], lr=0.1, beta1=0.9,
                          beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0, master_params=ls["masters"],
                          step=2, grad_scale=torch.full((1,), 4.0, device=device))
        else:
            moments = torch.full((len(shapes),), 3.0, device=device)
            mixprec.novograd_(ls["params"], ls["grads"], ls["exp_avgs"], moments, lr=0.1, beta1=0.9, beta2=0.98,
                              eps=1e-8, weight_decay=0.01, master_params=ls["masters"], step=2)
            ls["moments"] = [moments]
    worst = 0.0
    for key, wants in whole.items():
        for got, want in zip(shards[key], wants):
            got = gather_full(got)
            scale = float(want.double().norm()) or 1.0
            worst = max(worst, float((got.double() - want.double()).norm()) / scale)
    return worst


def test_fused_ops_take_dtensor_shards_and_refuse_what_would_be_wrong(seed):
    for r in run_ranks(_dtensor_inputs_rank, seed):
        assert r["changed"] and r["sharded_matches"] and r["norm_replicated"]
        assert "ValueError: mixprec::adam_: list 2 index 0 is laid out as" in r["placements"]
        assert r["partial"].startswith("ValueError: mixprec::adam_: list 1 index 0 is a DTensor with Partial")
        assert "plain tensor but the parameter is a DTensor" in r["plain_state"]
        for ord, (total, want_total, per, want_per) in r["norms"].items():
            assert math.isclose(total, want_total, rel_tol=1e-6), (ord, total, want_total)
            assert torch.allclose(per, want_per, rtol=1e-6, atol=0.0), (ord, per, want_per)
        # Reduction order only; a shard's own norms in place of the whole tensor's differ by O(1).
        assert r["lamb"] < 1e-6 and r["novograd"] < 1e-6, (r["lamb"], r["novograd"])
