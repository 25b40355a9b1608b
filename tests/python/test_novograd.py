# Tests of mixprec.optimizers.FusedNovoGrad on CPU and CUDA: 20-step trajectories against a float64
# NovoGrad written from the paper with Apex's options, Apex compatibility, checkpoints, loss scaling
# (the op itself: test_novograd_op.py).
from __future__ import annotations

import inspect
import io
import math

import pytest
import torch

import mixprec
from conftest import (
    CHUNK,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    random_tensor,
    random_tensors,
    rel_err,
    scalar,
    snapshot,
)
from mixprec.optimizers.fused_novograd import FusedNovoGrad

OP = "novograd_"
LOW = (torch.float16, torch.bfloat16)

# ---- the float64 reference ----------------------------------------------------------------------


def f32(x: float) -> float:
    """A hyper-parameter as the kernels see it (they compute in float32)."""
    return float(torch.tensor(x, dtype=torch.float32))


def reference_step(w, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, bias_correction=True,
                   grad_averaging=True, reg_inside_moment=False, norm_type=2.0, init_zero=False,
                   dtype=torch.float64):
    """One NovoGrad step of one tensor (Ginsburg et al. 2019, Algorithm 1) with Apex's options.

    The paper's second moment is the running average of squared gradient norms, v_t = beta2 *
    v_{t-1} + (1 - beta2) * ||g_t||^2 with v_1 = ||g_1||^2; `v` here is its square root, the
    layout the op keeps (with the infinity norm: the running average of max |g|, Apex's variant).
    Apex's options: init_zero (v_0 = 0 instead of v_1 = ||g_1||^2), bias correction of m by
    1 - beta1^t and of the norm by sqrt(1 - beta2^t), grad_averaging (the (1 - beta1) factor on
    the new term of m), and reg_inside_moment (the paper's m_t = beta1 * m + g / (sqrt(v) + eps)
    + d * w; otherwise m averages raw gradients and the normalization and decay act on the update).
    Element-wise math runs in `dtype` (float64: the reference; fp16/bf16: plain PyTorch in that
    precision); the per-tensor scalars are Python floats (double). Returns (w, m, v).
    """
    lr, beta1, beta2, eps, wd = (f32(x) for x in (lr, beta1, beta2, eps, weight_decay))
    g64 = g.detach().to("cpu", torch.float64)
    if norm_type == 2.0:
        new = float((g64 * g64).sum())
        seeded = step == 1 and not init_zero
        v_sq = new if seeded else beta2 * v * v + (1 - beta2) * new
        v = math.sqrt(v_sq)
    else:
        new = float(g64.abs().max()) if g64.numel() else 0.0
        v = new if (step == 1 and not init_zero) else beta2 * v + (1 - beta2) * new
    c1 = 1 - beta1**step if bias_correction else 1.0
    c2 = math.sqrt(1 - beta2**step) if bias_correction else 1.0
    b3 = 1 - beta1 if grad_averaging else 1.0
    d = v / c2 + eps
    # Low precision: each operation rounds to `dtype`, as torch's fp16/bf16 arithmetic does (it
    # computes in float32 and rounds); emulated through float32, which the CPU runs much faster.
    low = dtype != torch.float64
    work = torch.float32 if low else torch.float64
    q = (lambda x: x.to(dtype).to(work)) if low else (lambda x: x)
    w, m, g = (q(t.detach().to("cpu", work)) for t in (w, m, g))
    if reg_inside_moment:
        m = q(q(beta1 * m) + q(b3 * q(q(g / d) + q(wd * w))))
        w = q(w - q(lr * q(m / c1)))
    else:
        m = q(q(beta1 * m) + q(b3 * g))
        w = q(w - q(lr * q(q(q(m / c1) / d) + q(wd * w))))
    return w, m, v


class ReferenceNovoGrad:
    """A param group's trajectory under reference_step, in `dtype`; None grads skip a tensor."""

    def __init__(self, weights, hp: dict, dtype=torch.float64):
        self.hp, self.dtype, self.step = hp, dtype, 0
        self.w = [w.detach().to("cpu", dtype).clone() for w in weights]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [0.0] * len(weights)

    def __call__(self, grads):
        self.step += 1
        for i, g in enumerate(grads):
            if g is not None:
                self.w[i], self.m[i], self.v[i] = reference_step(self.w[i], g, self.m[i], self.v[i], step=self.step,
                                                                 dtype=self.dtype, **self.hp)


# ---- helpers --------------------------------------------------------------------------------------

HP = dict(lr=0.05, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01)


def make_state(sizes, param_dtype, grad_dtype, device, gen, master: bool):
    """Random params (~0.1), grads (~1), first moments (~0.1) and positive second moments:
    a mid-training state, never zeros."""
    params = random_tensors(sizes, param_dtype, device, gen, 0.1)
    st = dict(
        params=params,
        grads=random_tensors(sizes, grad_dtype, device, gen, 1.0),
        exp_avgs=random_tensors(sizes, torch.float32, device, gen, 0.1),
        exp_avg_sq_norms=random_tensor(len(sizes), torch.float32, "cpu", gen).abs().mul(10).to(device),
        master_params=[p.float() + random_tensor(p.shape, torch.float32, device, gen, 1e-4) for p in params]
        if master else [],
    )
    return st


def run_op(st, hp=HP, **kw):
    args = dict(hp)
    args.update(kw)
    mixprec.novograd_(st["params"], st["grads"], st["exp_avgs"], st["exp_avg_sq_norms"],
                      master_params=st["master_params"], **args)


def expected_one_step(st, step, hp=HP, grad_scale=1.0, **flags):
    """The reference result of run_op(st, step=step, ...) in float64: (weights, exp_avgs, norms,
    the weights and exp_avgs before the step)."""
    weights = st["master_params"] or st["params"]
    ws, ms, vs = [], [], []
    v_in = st["exp_avg_sq_norms"].double().cpu().tolist()
    for w, g, m, v in zip(weights, st["grads"], st["exp_avgs"], v_in):
        g = g.detach().double().cpu() / grad_scale
        w1, m1, v1 = reference_step(w, g, m, v, step=step, **hp, **flags)
        ws.append(w1), ms.append(m1), vs.append(v1)
    before = dict(weights=snapshot(weights), exp_avgs=snapshot(st["exp_avgs"]))
    return ws, ms, torch.tensor(vs, dtype=torch.float64), before


def assert_close(actual, reference, operand, tol, msg):
    """docs/architecture.md's relative error, measured against the larger of the result and an operand of it
    (the old weight or moment): where a step cancels most of a small tensor's value, fp32's
    rounding of the operands is what remains, and the result alone would make it look large."""
    a, r, o = (t.detach().to("cpu", torch.float64).flatten() for t in (actual, reference, operand))
    den = max(torch.linalg.vector_norm(r).item(), torch.linalg.vector_norm(o).item())
    err = torch.linalg.vector_norm(a - r).item() / den if den > 0 else torch.linalg.vector_norm(a - r).item()
    assert err < tol, f"{msg}: relative error {err:.3e} >= {tol:.1e}"  # NaN fails here too


def check_one_step(st, exp, msg, tol=1e-5):
    """Weights (master or fp32 params), moments and norms against expected_one_step, and the
    model copy against the master's rounding."""
    ws, ms, vs, before = exp
    weights = st["master_params"] or st["params"]
    for i, (w, r) in enumerate(zip(weights, ws)):
        assert_close(w, r, before["weights"][i], tol, f"{msg}: weight[{i}]")
        assert_close(st["exp_avgs"][i], ms[i], before["exp_avgs"][i], tol, f"{msg}: exp_avgs[{i}]")
    assert_rel_err(st["exp_avg_sq_norms"], vs, tol, f"{msg}: exp_avg_sq_norms")
    for i, (p, w) in enumerate(zip(st["params"], st["master_params"])):
        assert_bitwise_equal(p, w.to(p.dtype), f"{msg}: params[{i}] is not the rounded master")


def all_state(st, step_tensor=None):
    return [*st["params"], *st["grads"], *st["exp_avgs"], st["exp_avg_sq_norms"], *st["master_params"],
            *([step_tensor] if step_tensor is not None else [])]


def flags_id(flags: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in flags.items()) or "apex"


# ---- FusedNovoGrad: 20-step trajectories ----------------------------------------------------------------

# Constructor flags (Apex's names), each also run with a second group of other hyper-parameters.
CLASS_FLAGS = [
    dict(),
    dict(reg_inside_moment=True, init_zero=True, norm_type=0),
    dict(grad_averaging=False, bias_correction=False, reg_inside_moment=True, norm_type=2),
    dict(norm_type=0, betas=(0.95, 0.5)),
]


def _hp(group: dict) -> dict:
    """A FusedNovoGrad param group's hyper-parameters in reference_step's terms."""
    return dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                grad_averaging=group["grad_averaging"], reg_inside_moment=group["reg_inside_moment"],
                norm_type=2.0 if group["norm_type"] == 2 else math.inf, init_zero=group["init_zero"])


def cat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().to("cpu", torch.float64).flatten() for t in tensors])


def _model(dtype, device, gen):
    """Two param groups, values ~0.1 (so that updates matter). Chunk boundaries are the op tests'."""
    a = [random_tensor(s, dtype, device, gen, 0.1).requires_grad_() for s in ((4099,), (33, 7), (1,))]
    b = [random_tensor(s, dtype, device, gen, 0.1).requires_grad_() for s in ((257,), (2, 3, 5))]
    return a, b


@pytest.mark.parametrize("flags", CLASS_FLAGS, ids=flags_id)
@pytest.mark.parametrize("master", [False, True], ids=["no_master", "master"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_trajectory_matches_float64_reference(device, gen, dtype, master, flags):
    a, b = _model(dtype, device, gen)
    opt = FusedNovoGrad([{"params": a}, {"params": b, "lr": 0.02, "weight_decay": 0.0, "betas": (0.8, 0.9)}],
                        lr=0.05, weight_decay=0.05, master_weights=master, **flags)
    groups = [(g["params"], _hp(g)) for g in opt.param_groups]
    refs = [ReferenceNovoGrad(ps, hp) for ps, hp in groups]
    # Plain PyTorch in the params' precision: the same math, elements and moments in that dtype.
    peers = [ReferenceNovoGrad(ps, hp, dtype) for ps, hp in groups] if dtype in LOW and not master else []
    start = [snapshot(a), snapshot(b)]
    for step in range(20):
        for ps, ref, peer in zip([a, b], refs, peers or [None, None]):
            grads = [random_tensor(p.shape, dtype, device, gen) for p in ps]
            if step == 7:
                grads[-1] = None  # a tensor without a grad for a step keeps its state
            for p, g in zip(ps, grads):
                p.grad = g
            ref(grads)
            if peer is not None:
                peer(grads)
        opt.step()

    for gi, ((ps, _), ref) in enumerate(zip(groups, refs)):
        where = f"{dtype} master={master} {flags} group {gi}"
        norms = opt.param_groups[gi]["exp_avg_sq"]
        assert_rel_err(norms, torch.tensor(ref.v, dtype=torch.float64), 1e-5, f"{where}: exp_avg_sq")
        assert opt.param_groups[gi]["step"].item() == 20
        if dtype == torch.float32 or master:
            masters = [opt.state[p].get("master_param", p) for p in ps]
            for i, (p, master_w) in enumerate(zip(ps, masters)):
                assert master_w.dtype == torch.float32
                assert_bitwise_equal(p.detach(), master_w.to(dtype), f"{where}: param {i} is not the rounded master")
            # Weights and moments of the group together: a one-element tensor can start and end near
            # zero by chance, and then fp32's rounding over 20 steps is a large part of it (seen:
            # 1.3e-5 of a (1,) weight in 4 of 4119 seeds, fp16 with masters and the inf norm).
            assert_close(cat(masters), cat(ref.w), cat(start[gi]), 1e-5, f"{where}: weights")
            assert_rel_err(cat([opt.state[p]["exp_avg"] for p in ps]), cat(ref.m), 1e-5, f"{where}: exp_avg")
        else:
            # Twice the error of plain PyTorch in this precision, never below one rounding of it.
            peer = peers[gi]
            for what, ours, theirs, exact in (("params", ps, peer.w, ref.w),
                                              ("exp_avg", [opt.state[p]["exp_avg"] for p in ps], peer.m, ref.m)):
                bound = max(2 * rel_err(cat(theirs), cat(exact)), torch.finfo(dtype).eps, 1e-5)
                assert_rel_err(cat(ours), cat(exact), bound, f"{where}: {what}")
    # The test can fail: the weights moved far more than the tolerances over the 20 steps.
    assert rel_err(cat(w for r in refs for w in r.w), cat(start[0] + start[1])) > 1e-2


# ---- FusedNovoGrad: constructor, Apex compatibility ---------------------------------------------------


def test_constructor_is_apexs():
    sig = inspect.signature(FusedNovoGrad.__init__)
    expected = [("params", inspect.Parameter.empty), ("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
                ("eps", 1e-8), ("weight_decay", 0.0), ("amsgrad", False), ("reg_inside_moment", False),
                ("grad_averaging", True), ("norm_type", 2), ("init_zero", False), ("set_grad_none", True)]
    positional = [(n, p.default) for n, p in sig.parameters.items()
                  if n != "self" and p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == expected
    assert sig.parameters["master_weights"].kind == inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["master_weights"].default is False


def test_constructor_rejects_bad_hyper_parameters():
    w = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedNovoGrad(w, amsgrad=True)
    for kw in (dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)), dict(betas=(0.9,)),
               dict(weight_decay=-1.0), dict(norm_type=1), dict(norm_type=3.0)):
        with pytest.raises(ValueError, match="FusedNovoGrad"):
            FusedNovoGrad(w, **kw)


def test_norm_type_zero_is_the_infinity_norm(device, gen):
    # Apex spells the infinity norm 0; inf is the same optimizer.
    runs = []
    grads = [random_tensor((CHUNK + 1,), torch.float32, device, gen) for _ in range(3)]
    w0 = random_tensor((CHUNK + 1,), torch.float32, device, gen, 0.1)
    for norm_type in (0, math.inf, 2):
        w = w0.clone().requires_grad_()
        opt = FusedNovoGrad([w], lr=0.1, norm_type=norm_type)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        runs.append(w.detach())
    assert_bitwise_equal(runs[1], runs[0], "norm_type=inf vs 0")
    assert not torch.equal(runs[2], runs[0]), "the L2 norm must differ from the infinity norm"


def test_zero_grad_follows_set_grad_none(device):
    for set_grad_none, expect_none in ((True, True), (False, False)):
        w = torch.ones(4, device=device, requires_grad=True)
        w.grad = torch.ones(4, device=device)
        opt = FusedNovoGrad([w], set_grad_none=set_grad_none)
        opt.zero_grad()
        assert (w.grad is None) == expect_none
        if not expect_none:
            assert_bitwise_equal(w.grad, torch.zeros(4, device=device), "zeroed grad")


def test_loads_an_apex_checkpoint(device, gen):
    # Apex keeps one norm vector per dtype ([fp16, fp32], params in group order), fp16 moments for
    # fp16 params and an int step; the checkpoint continues exactly as ours would.
    ps = [random_tensor((5,), torch.float16, device, gen, 0.1).requires_grad_(),
          random_tensor((6,), torch.float32, device, gen, 0.1).requires_grad_(),
          random_tensor((7,), torch.float16, device, gen, 0.1).requires_grad_()]
    exp_avgs = [random_tensor(p.shape, p.dtype, device, gen, 0.1) for p in ps]
    norms16, norms32 = torch.tensor([1.5, 2.5], device=device), torch.tensor([3.5], device=device)
    apex = {"state": {i: {"exp_avg": m.clone()} for i, m in enumerate(exp_avgs)},
            "param_groups": [dict(lr=0.01, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  grad_averaging=True, norm_type=2, init_zero=False, step=4,
                                  exp_avg_sq=[norms16, norms32], params=[0, 1, 2])]}
    buf = io.BytesIO()
    torch.save(apex, buf)
    buf.seek(0)
    opt = FusedNovoGrad(ps, reg_inside_moment=True)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    group = opt.param_groups[0]
    assert group["reg_inside_moment"] is True  # Apex keeps it outside the group: ours stays
    assert_bitwise_equal(group["exp_avg_sq"].cpu(), torch.tensor([1.5, 3.5, 2.5]), "merged norms")
    for p, m in zip(ps, exp_avgs):
        assert_bitwise_equal(opt.state[p]["exp_avg"], m.float(), "exp_avg")
    for p in ps:
        p.grad = random_tensor(p.shape, p.dtype, device, gen)
    st = dict(params=[p.detach() for p in ps], grads=[p.grad for p in ps], exp_avgs=[m.float() for m in exp_avgs],
              exp_avg_sq_norms=torch.tensor([1.5, 3.5, 2.5], device=device), master_params=[])
    exp = expected_one_step(st, 5, hp=dict(HP, lr=0.01, beta2=0.999, weight_decay=0.0), reg_inside_moment=True)
    opt.step()
    assert group["step"].item() == 5
    assert_rel_err(group["exp_avg_sq"], exp[2], 1e-6, "norms after the step")
    assert_rel_err(ps[1], exp[0][1], 1e-5, "the fp32 param after the step")
    bad = dict(apex, param_groups=[dict(apex["param_groups"][0], exp_avg_sq=[norms16, norms16])])
    fresh = FusedNovoGrad(ps)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        fresh.load_state_dict(bad)
    assert len(fresh.state) == 0 and "exp_avg_sq" not in fresh.param_groups[0]


# ---- FusedNovoGrad: checkpoints and loss scaling ---------------------------------------------------------


def _clone_state(opt):
    out = [t.clone() for g in opt.param_groups for t in ([g["exp_avg_sq"], g["step"]] if "exp_avg_sq" in g else [])]
    for st in opt.state.values():
        out += [st[k].clone() for k in sorted(st)]
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_state_dict_round_trip_continues_bit_identically(device, gen, dtype):
    def make(params):
        return FusedNovoGrad([{"params": params[:2]}, {"params": params[2:], "norm_type": 0, "init_zero": True}],
                             lr=0.05, weight_decay=0.01, master_weights=True)

    params = [random_tensor(s, dtype, device, gen, 0.1).requires_grad_() for s in (CHUNK + 2, 9, 4, 100)]
    opt = make(params)
    grads = [[random_tensor(p.shape, dtype, device, gen) for p in params] for _ in range(10)]

    def step(opt, params, gs, k):
        for i, (p, g) in enumerate(zip(params, gs)):
            p.grad = None if (k == 6 and i == 1) else g.clone()  # one param sits a step out
        opt.step()

    for k in range(5):
        step(opt, params, grads[k], k)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    params2 = [p.detach().clone().requires_grad_() for p in params]
    opt2 = make(params2)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert all(s.device == params2[0].device for s in _clone_state(opt2))
    for k in range(5, 10):
        step(opt, params, grads[k], k)
        step(opt2, params2, grads[k], k)
    for i, (p, q) in enumerate(zip(params, params2)):
        assert_bitwise_equal(q.detach(), p.detach(), f"param {i} after reloading")
    for i, (x, y) in enumerate(zip(_clone_state(opt), _clone_state(opt2))):
        assert_bitwise_equal(y, x, f"optimizer state tensor {i} after reloading")


def test_load_state_dict_rejects_corrupt_norms(device):
    params = [torch.ones(3, device=device, requires_grad=True), torch.ones(2, device=device, requires_grad=True)]
    opt = FusedNovoGrad(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    good = opt.state_dict()
    before = _clone_state(opt)
    for bad_value in (torch.ones(3), torch.ones(1, 2), torch.ones(2, dtype=torch.int64), "x"):
        bad = dict(good, param_groups=[dict(good["param_groups"][0], exp_avg_sq=bad_value)])
        with pytest.raises(ValueError, match="exp_avg_sq"):
            opt.load_state_dict(bad)
        for i, (x, y) in enumerate(zip(before, _clone_state(opt))):
            assert_bitwise_equal(y, x, f"state tensor {i} after a rejected load")


def test_torch_grad_scaler_drives_the_fused_path(device, gen):
    # torch.amp.GradScaler hands its scale and found_inf to the fused step; a twin fed the
    # unscaled grads (exact: the scale is a power of two) must end bit-identical, and an injected
    # inf must skip the step on the device, leaving everything as it was.
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = FusedNovoGrad(model.parameters(), lr=0.01, weight_decay=0.01, reg_inside_moment=True)
    opt_twin = FusedNovoGrad(twin, lr=0.01, weight_decay=0.01, reg_inside_moment=True)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=1000)
    for k in range(4):
        x = random_tensor((16, 64), torch.float32, device, gen)
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if k == 2:
            list(model.parameters())[0].grad[3, 5] = math.inf
        for p, q in zip(model.parameters(), twin):
            q.grad = p.grad / scaler.get_scale()
        before = snapshot([*model.parameters(), *_clone_state(opt)])
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if k == 2:
            assert_unchanged(before, [*model.parameters(), *_clone_state(opt)], "step with an inf gradient")
            assert scaler.get_scale() == scale_before / 2
            continue
        opt_twin.step()
        for i, (p, q) in enumerate(zip(model.parameters(), twin)):
            assert_bitwise_equal(p.detach(), q.detach(), f"step {k}: param {i} vs the unscaled twin")
    assert opt.param_groups[0]["step"].item() == 3
