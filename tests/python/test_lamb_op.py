# Tests of the fused LAMB op mixprec.lamb_ on CPU and CUDA: edge sizes and launch boundaries,
# clipping, trust ratios, skipped steps, loss scale, masters, bad inputs, against the float64 reference.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import (
    CHUNK,
    FLOAT_DTYPES,
    MANY_TENSORS,
    NON_FINITE,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    check_rejected,
    inject_non_finite,
    poison_,
    random_tensor,
    scalar,
    snapshot,
    sync,
    unaligned_view,
)
from mixprec.optimizers.fused_lamb import FusedLAMB
from test_lamb import OP, Track, clip_factor, lamb_args, reference_step  # shared helpers


# ---- the op: edge cases ---------------------------------------------------------------------------


def hp_for_reference(hp):
    return dict(step=hp["step"], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                weight_decay=hp["weight_decay"], bias_correction=hp["bias_correction"],
                grad_averaging=hp["grad_averaging"], adam_w_mode=hp["adam_w_mode"], use_nvlamb=hp["use_nvlamb"])


def test_many_tensors_mixed_dtypes_masters_and_empty_ones(device, gen, rng):
    # More tensors than one launch table (and one finalize table) holds, params and grads of all
    # three dtypes in one call (several groups sharing the chunk numbering), zero-size tensors,
    # fp32 masters, and poisoned model params that every element of the step must overwrite.
    sizes = [rng.randint(1, 40) for _ in range(MANY_TENSORS)]
    for i in rng.sample(range(MANY_TENSORS), 5):
        sizes[i] = 0
    sizes[7] = CHUNK + 2
    pdt = [FLOAT_DTYPES[i % 3] for i in range(len(sizes))]
    gdt = [FLOAT_DTYPES[(i // 3) % 3] for i in range(len(sizes))]
    masters = [random_tensor(s, torch.float32, device, gen) for s in sizes]
    params = [poison_(torch.empty(s, dtype=d, device=device)) for s, d in zip(sizes, pdt)]
    grads = [random_tensor(s, d, device, gen) for s, d in zip(sizes, gdt)]
    ms = [random_tensor(s, torch.float32, device, gen, 0.1) for s in sizes]
    vs = [random_tensor(s, torch.float32, device, gen, 0.01).abs() for s in sizes]
    track = Track(masters)
    track.ref[1] = [m.cpu().double() for m in ms]
    track.ref[2] = [v.cpu().double() for v in vs]
    args, hp = lamb_args(params, grads, ms, vs, step=3, use_nvlamb=True)
    mixprec.lamb_(*args, master_params=masters, **hp)
    sync(device)
    reference_step(*track._args(track.ref, [g.cpu().double() for g in grads], torch.float64),
                   clip=clip_factor([g.cpu() for g in grads], 1.0), **hp_for_reference(hp))
    for name, outs, refs in (("master", masters, track.ref[0]), ("exp_avg", ms, track.ref[1]),
                             ("exp_avg_sq", vs, track.ref[2])):
        for i, (o, r) in enumerate(zip(outs, refs)):
            if o.numel():
                assert_rel_err(o, r, 1e-5, f"{name}[{i}]")
    for i, (p, m) in enumerate(zip(params, masters)):
        assert_bitwise_equal(p, m.to(p.dtype), f"params[{i}]")


def test_unaligned_views_and_chunk_edges(device, gen):
    sizes = (CHUNK + 3, 17, 2 * CHUNK - 1)
    views = [[unaligned_view(s, dt, device, gen, sc) for s in sizes]
             for dt, sc in ((torch.float32, 1.0), (torch.float16, 1.0), (torch.float32, 0.1), (torch.float32, 0.01))]
    (params, grads, ms, vs) = [[v for v, _ in lst] for lst in views]
    bases = [b for lst in views for _, b in lst]
    for v in vs:
        v.abs_()
    edges = [(b[0].clone(), b[-1].clone()) for b in bases]
    track = Track(params)
    track.ref[1] = [m.cpu().double() for m in ms]
    track.ref[2] = [v.cpu().double() for v in vs]
    args, hp = lamb_args(params, grads, ms, vs, step=4, adam_w_mode=False)
    mixprec.lamb_(*args, **hp)
    sync(device)
    reference_step(*track._args(track.ref, [g.cpu().double() for g in grads], torch.float64),
                   clip=clip_factor([g.cpu() for g in grads], 1.0), **hp_for_reference(hp))
    for i in range(len(sizes)):
        assert_rel_err(params[i], track.ref[0][i], 1e-5, f"params[{i}]")
        assert_rel_err(ms[i], track.ref[1][i], 1e-5, f"exp_avgs[{i}]")
        assert_rel_err(vs[i], track.ref[2][i], 1e-5, f"exp_avg_sqs[{i}]")
    for i, (b, (first, last)) in enumerate(zip(bases, edges)):
        assert_bitwise_equal(b[0], first, f"base[{i}] first")
        assert_bitwise_equal(b[-1], last, f"base[{i}] last")


@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_trust_ratio_is_one_when_a_norm_is_zero(device, gen, use_nvlamb):
    # Tensor 0: zero weights (||w|| = 0); tensor 1: zero weights, grads and moments with no decay
    # (u = 0); tensor 2: an ordinary one, so the ratio is really computed per tensor.
    params = [torch.zeros(CHUNK + 5, device=device), torch.zeros(33, device=device),
              random_tensor(100, torch.float32, device, gen)]
    grads = [random_tensor(CHUNK + 5, torch.float32, device, gen), torch.zeros(33, device=device),
             random_tensor(100, torch.float32, device, gen)]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    wd = 0.0 if use_nvlamb else 0.01
    track = Track(params)
    args, hp = lamb_args(params, grads, ms, vs, weight_decay=wd, use_nvlamb=use_nvlamb, max_grad_norm=0.0)
    mixprec.lamb_(*args, **hp)
    sync(device)
    reference_step(*track._args(track.ref, [g.cpu().double() for g in grads], torch.float64), **hp_for_reference(hp))
    assert_rel_err(params[0], track.ref[0][0], 1e-5, "zero weights")
    assert bool((params[1] == 0).all()), "zero update must leave zero weights"
    assert_rel_err(params[2], track.ref[0][2], 1e-5, "ordinary tensor")
    # The first tensor moved by exactly lr * u (ratio 1), not by a ratio of 0.
    assert float(params[0].abs().max()) > 1e-3


def test_explicit_global_norm_equals_the_internal_one(device, gen):
    # The op computes the norm itself when none is given; the scaled-grad norm divided by
    # grad_scale in the kernel must act like the unscaled norm handed in.
    scale = 512.0
    sizes = (CHUNK + 1, 50)
    outs = []
    grads = [random_tensor(s, torch.float16, device, gen, scale) for s in sizes]
    init = [random_tensor(s, torch.float32, device, gen) for s in sizes]
    for given in (False, True):
        params = [p.clone() for p in init]
        ms = [torch.zeros_like(p) for p in params]
        vs = [torch.zeros_like(p) for p in params]
        step_grads = [g.clone() for g in grads]  # the step leaves its grads unscaled
        norm = mixprec.multi_tensor_norm(step_grads)[0].reshape(1) / scale if given else None
        args, hp = lamb_args(params, step_grads, ms, vs)
        mixprec.lamb_(*args, grad_scale=scalar(scale, device), global_grad_norm=norm, **hp)
        outs.append(params + ms + vs)
    for i, (a, b) in enumerate(zip(*outs)):
        assert_rel_err(a, b, 1e-6, f"tensor {i}")
    # And clipping really acted: without it the first moments differ by the clip factor.
    seen = [g.cpu().double() / scale for g in grads]
    assert clip_factor(seen, 1.0) > 10.0


def test_device_lr_and_step_equal_host_ones(device, gen):
    sizes = (CHUNK + 7, 9)
    init = [random_tensor(s, torch.float32, device, gen) for s in sizes]
    grads = [random_tensor(s, torch.bfloat16, device, gen) for s in sizes]
    results = []
    for on_device in (False, True):
        params = [p.clone() for p in init]
        ms = [torch.zeros_like(p) for p in params]
        vs = [torch.zeros_like(p) for p in params]
        step_t = scalar(0.0, device)
        for k in range(1, 4):
            if on_device:
                args, hp = lamb_args(params, grads, ms, vs, lr=0.0, step=0)
                mixprec.lamb_(*args, step_tensor=step_t, lr_tensor=scalar(0.01 * k, device), **hp)
            else:
                args, hp = lamb_args(params, grads, ms, vs, lr=0.01 * k, step=k)
                mixprec.lamb_(*args, **hp)
        if on_device:
            assert float(step_t) == 3.0
        results.append(params + ms + vs)
    for i, (a, b) in enumerate(zip(*results)):
        assert_bitwise_equal(a, b, f"tensor {i}")


@pytest.mark.parametrize("where", ["first", "last", "random"])
def test_found_inf_skips_everything(device, gen, where):
    # Non-finite gradients flagged by the check op: params, masters, moments, the step count all
    # stay bit-identical, through every pass (trust ratio on and off).
    value = NON_FINITE[["first", "last", "random"].index(where)]
    for wd in (0.01, 0.0):
        sizes = (CHUNK + 1, 40)
        params = [random_tensor(s, torch.bfloat16, device, gen) for s in sizes]
        masters = [p.float() for p in params]
        grads = [random_tensor(s, torch.float16, device, gen, 64.0) for s in sizes]
        inject_non_finite(grads[0], where, value, gen)
        ms = [random_tensor(s, torch.float32, device, gen) for s in sizes]
        vs = [random_tensor(s, torch.float32, device, gen).abs() for s in sizes]
        found = scalar(0.0, device)
        mixprec.non_finite_check_and_unscale_(grads, found)
        step_t = scalar(5.0, device)
        everything = params + masters + grads + ms + vs + [step_t]
        before = snapshot(everything)
        args, hp = lamb_args(params, grads, ms, vs, weight_decay=wd, step=0)
        mixprec.lamb_(*args, master_params=masters, step_tensor=step_t, grad_scale=scalar(64.0, device),
                      found_inf=found, **hp)
        sync(device)
        assert float(found) == 1.0
        assert_unchanged(before, everything, f"skipped step (weight_decay={wd})")


def test_empty_lists_and_zero_size_tensors(device):
    # Empty lists need a device tensor for the dispatcher; the call is then a no-op, as adam_'s.
    step_t, found = scalar(2.0, device), scalar(0.0, device)
    mixprec.lamb_([], [], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, step_tensor=step_t, found_inf=found)
    sync(device)
    assert float(step_t) == 2.0
    z = [torch.empty(0, device=device), torch.empty(0, 3, device=device, dtype=torch.float16)]
    args, hp = lamb_args(z, [t.clone() for t in z], [torch.empty(t.shape, device=device) for t in z],
                         [torch.empty(t.shape, device=device) for t in z], step=0)
    mixprec.lamb_(*args, step_tensor=step_t, **hp)
    sync(device)
    assert float(step_t) == 3.0  # zero-size tensors still make a step


# ---- the step split in two, for sharded tensors (see the op's schema) ----------------------------


def _split_state(device, gen, masters: bool):
    sizes = (CHUNK + 1, 0, 7, 300)
    dtypes = (torch.float16, torch.float32, torch.bfloat16, torch.float32)
    params = [random_tensor(s, d, device, gen) for s, d in zip(sizes, dtypes)]
    return dict(
        params=params,
        grads=[random_tensor(s, torch.float16, device, gen, 64.0) for s in sizes],
        ms=[random_tensor(s, torch.float32, device, gen, 0.1) for s in sizes],
        vs=[random_tensor(s, torch.float32, device, gen, 0.01).abs() for s in sizes],
        masters=[p.float() + random_tensor(p.shape, torch.float32, device, gen, 1e-3) for p in params] if masters else [],
        step=scalar(2.0, device),
    )


def _raw_lamb(st, device, **kw):
    """torch.ops.mixprec.lamb_ itself: the split arguments are the op's, not the wrapper's."""
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True, grad_averaging=True,
              adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False, grad_scale=scalar(64.0, device),
              found_inf=scalar(0.0, device))
    hp.update(kw)
    torch.ops.mixprec.lamb_(st["params"], st["grads"], st["ms"], st["vs"], st["masters"], st["step"], **hp)


@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("variant", [dict(), dict(adam_w_mode=False, weight_decay=0.0, use_nvlamb=True)],
                         ids=["decoupled", "l2_nvlamb"])
def test_split_step_equals_the_whole_step(device, gen, masters, variant):
    # With the first half's norms handed straight back (one rank: each "shard" is the whole
    # tensor), the two calls are the one-call step bit for bit; the first half changes no weight,
    # counts the step once, and writes ||w|| and ||u|| per tensor (0 for an empty one).
    whole = _split_state(device, gen, masters)
    split = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in whole.items()}
    _raw_lamb(whole, device, **variant)
    weights_before = snapshot(split["masters"] or split["params"])
    norms = poison_(torch.empty(2, len(split["params"]), device=device))
    _raw_lamb(split, device, local_norms=norms, **variant)
    sync(device)
    assert_unchanged(split["masters"] or split["params"], weights_before, "weights after the first half")
    assert float(split["step"]) == 3.0
    assert float(norms[0, 1]) == 0.0 and float(norms[1, 1]) == 0.0, "the empty tensor's norms"
    for i, w in enumerate(weights_before):
        if w.numel():
            assert_rel_err(norms[0, i:i + 1], torch.linalg.vector_norm(w.double()).reshape(1), 1e-5, f"||w[{i}]||")
            assert float(norms[1, i]) > 0.0
    _raw_lamb(split, device, trust_norms=norms, **variant)
    assert float(split["step"]) == 3.0, "the second half counted the step again"
    for key in ("params", "ms", "vs", "masters"):
        for i, (a, b) in enumerate(zip(split[key], whole[key])):
            assert_bitwise_equal(a, b, f"{key}[{i}]")


def test_split_step_uses_the_norms_it_is_given(device, gen):
    # What FSDP2 relies on: the second half applies the trust ratio of the norms handed in (the
    # whole tensors' norms), not of the local tensors. Doubling ||w|| doubles every update of the
    # fp32 masters (up to their rounding after the update).
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    updates = []
    for factor in (1.0, 2.0):
        st = _split_state(device, torch.Generator().manual_seed(seed), True)
        before = snapshot(st["masters"])
        norms = torch.empty(2, len(st["params"]), device=device)
        _raw_lamb(st, device, local_norms=norms)
        norms[0] *= factor
        _raw_lamb(st, device, trust_norms=norms)
        updates.append([m.double().cpu() - b.double().cpu() for m, b in zip(st["masters"], before)])
    for i, (one, two) in enumerate(zip(*updates)):
        if one.numel():
            assert_rel_err(two, 2.0 * one, 1e-4, f"update of masters[{i}]")


def test_split_step_found_inf_skips_both_halves(device, gen):
    st = _split_state(device, gen, True)
    everything = st["params"] + st["ms"] + st["vs"] + st["masters"] + [st["step"]]
    before = snapshot(everything)
    norms = torch.zeros(2, len(st["params"]), device=device)
    _raw_lamb(st, device, local_norms=norms, found_inf=scalar(1.0, device))
    _raw_lamb(st, device, trust_norms=norms.nan_to_num(), found_inf=scalar(1.0, device))
    sync(device)
    assert_unchanged(everything, before, "a skipped split step")


SPLIT_BAD_CASES = {
    # name: (extra kwargs given lists of n tensors on device, exception, argument)
    "both_halves": (lambda n, d: dict(local_norms=torch.zeros(2, n, device=d), trust_norms=torch.zeros(2, n, device=d)),
                    ValueError, "local_norms"),
    "local_shape": (lambda n, d: dict(local_norms=torch.zeros(2, n + 1, device=d)), ValueError, "local_norms"),
    "trust_shape": (lambda n, d: dict(trust_norms=torch.zeros(n, device=d)), ValueError, "trust_norms"),
    "trust_dtype": (lambda n, d: dict(trust_norms=torch.zeros(2, n, device=d, dtype=torch.float64)), TypeError,
                    "trust_norms"),
    "local_strided": (lambda n, d: dict(local_norms=torch.zeros(n, 2, device=d).t()), RuntimeError, "local_norms"),
    "no_trust_ratio": (lambda n, d: dict(trust_norms=torch.zeros(2, n, device=d), weight_decay=0.0), ValueError,
                       "trust_norms"),
}


@pytest.mark.parametrize("case", list(SPLIT_BAD_CASES))
def test_split_step_bad_input_names_the_argument_and_changes_nothing(device, gen, case):
    make, exc, arg = SPLIT_BAD_CASES[case]
    st = _split_state(device, gen, True)
    kw = make(len(st["params"]), device)
    tensors = st["params"] + st["ms"] + st["vs"] + st["masters"] + [st["step"]] + list(kw.values())[:1]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    check_rejected(lambda: _raw_lamb(st, device, **kw), tensors, exc, OP, arg, None, device)


# ---- bad input ------------------------------------------------------------------------------------


def _valid(device, gen):
    sizes = (CHUNK + 1, 10, 3)
    params = [random_tensor(s, torch.float16, device, gen) for s in sizes]
    grads = [random_tensor(s, torch.float16, device, gen) for s in sizes]
    ms = [torch.zeros(s, device=device) for s in sizes]
    vs = [torch.zeros(s, device=device) for s in sizes]
    masters = [p.float() for p in params]
    return params, grads, ms, vs, masters


BAD_CASES = {
    # name: (mutation of (lists, kwargs), exception, argument, index)
    "state_fp16": (lambda L, K: L[2].__setitem__(1, L[2][1].half()), TypeError, "exp_avgs", 1),
    "state_bf16": (lambda L, K: L[3].__setitem__(0, L[3][0].bfloat16()), TypeError, "exp_avg_sqs", 0),
    "master_fp16": (lambda L, K: L[4].__setitem__(2, L[4][2].half()), TypeError, "master_params", 2),
    "grad_float64": (lambda L, K: L[1].__setitem__(2, L[1][2].double()), TypeError, "grads", 2),
    "grads_short": (lambda L, K: L[1].pop(), ValueError, "grads", None),
    "masters_short": (lambda L, K: L[4].pop(), ValueError, "master_params", None),
    "grad_shape": (lambda L, K: L[1].__setitem__(1, L[1][1][:9]), ValueError, "grads", 1),
    "param_strided": (lambda L, K: L[0].__setitem__(1, torch.empty(20, dtype=torch.float16,
                                                                   device=L[0][1].device)[::2]), RuntimeError,
                      "params", 1),
    "beta1": (lambda L, K: K.update(beta1=1.0), ValueError, "beta1", None),
    "beta2": (lambda L, K: K.update(beta2=-0.1), ValueError, "beta2", None),
    "eps": (lambda L, K: K.update(eps=-1e-6), ValueError, "eps", None),
    "weight_decay": (lambda L, K: K.update(weight_decay=-0.01), ValueError, "weight_decay", None),
    "max_grad_norm_nan": (lambda L, K: K.update(max_grad_norm=math.nan), ValueError, "max_grad_norm", None),
    "max_grad_norm_neg": (lambda L, K: K.update(max_grad_norm=-1.0), ValueError, "max_grad_norm", None),
    "lr": (lambda L, K: K.update(lr=-1.0), ValueError, "lr", None),
    "step": (lambda L, K: K.update(step=0), ValueError, "step", None),
    "global_norm_size": (lambda L, K: K.update(global_grad_norm=torch.ones(2, device=L[0][0].device)), ValueError,
                         "global_grad_norm", None),
    "found_inf_dtype": (lambda L, K: K.update(found_inf=torch.zeros(1, dtype=torch.float64, device=L[0][0].device)),
                        TypeError, "found_inf", None),
    "grad_scale_dtype": (lambda L, K: K.update(grad_scale=torch.ones(1, dtype=torch.int32, device=L[0][0].device)),
                         TypeError, "grad_scale", None),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_names_op_argument_index_and_changes_nothing(device, gen, case):
    mutate, exc, arg, index = BAD_CASES[case]
    params, grads, ms, vs, masters = _valid(device, gen)
    lists = [params, grads, ms, vs, masters]
    step_t = scalar(1.0, device)
    args, hp = lamb_args(params, grads, ms, vs)
    kw = dict(hp, master_params=masters)
    mutate(lists, kw)
    if case != "step":
        kw["step_tensor"] = step_t
    tensors = [t for lst in lists for t in lst] + [step_t]
    check_rejected(lambda: mixprec.lamb_(params, grads, ms, vs, **kw), tensors, exc, OP, arg, index, device)


@pytest.mark.cuda
def test_tensor_on_another_device_is_rejected(gen):
    params, grads, ms, vs, masters = _valid("cuda", gen)
    grads[1] = grads[1].cpu()
    args, hp = lamb_args(params, grads, ms, vs)
    check_rejected(lambda: mixprec.lamb_(*args, **hp), params + ms + vs, RuntimeError, OP, "grads", 1, "cuda")


def test_constructor_rejects_what_apex_rejects():
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB(p, amsgrad=True)
    for kw in (dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.5)),
               dict(weight_decay=-0.1), dict(max_grad_norm=-1.0)):
        with pytest.raises(ValueError, match="FusedLAMB"):
            FusedLAMB(p, **kw)
    opt = FusedLAMB(p)
    assert opt.defaults == dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                                grad_averaging=True, max_grad_norm=1.0, adam_w_mode=True, use_nvlamb=False,
                                master_weights=False, rounding="nearest", seed=0)
    assert opt.set_grad_none and not opt.master_weights


def test_opcheck(device, gen):
    op = torch.ops.mixprec.lamb_.default
    sizes = (CHUNK + 3, 10)
    for masters, given_norm, wd, split in ((False, False, 0.01, None), (True, True, 0.0, None),
                                           (True, False, 0.01, "local_norms"), (False, True, 0.01, "trust_norms")):
        params = [random_tensor(s, torch.float16, device, gen) for s in sizes]
        grads = [random_tensor(s, torch.float32, device, gen) for s in sizes]
        ms = [random_tensor(s, torch.float32, device, gen) for s in sizes]
        vs = [random_tensor(s, torch.float32, device, gen).abs() for s in sizes]
        mp = [p.float() for p in params] if masters else []
        kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=wd, bias_correction=True,
                      grad_averaging=True, adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False, step=0,
                      grad_scale=scalar(2.0, device), found_inf=scalar(0.0, device),
                      global_grad_norm=scalar(7.0, device) if given_norm else None)
        if split is not None:
            kwargs[split] = random_tensor((2, len(sizes)), torch.float32, device, gen).abs()
        torch.library.opcheck(op, (params, grads, ms, vs, mp, scalar(1.0, device)), kwargs)
