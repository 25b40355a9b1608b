# torch's fused-optimizer contract under a GradScaler, for all five mixprec fused optimizers: after
# scaler.step the kernel has left p.grad unscaled (as torch's fused AdamW does), a skipped step leaves it alone.
from __future__ import annotations

import pytest
import torch

import mixprec
from conftest import (
    assert_bitwise_equal,
    assert_unchanged,
    inject_non_finite,
    random_tensor,
    rel_err,
    scalar,
    snapshot,
    torch_grad_scaler,
)
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from optim_family import SHAPES, optimizer_tensors

# Options that reach every branch that reads the gradient (momentum, decay, LAMB's clipping by a
# small max_grad_norm, so the written-back grad must be unscaled but not clipped).
FAMILIES = {
    "adam": (FusedAdam, dict(lr=1e-2, weight_decay=0.01, amsgrad=True)),
    "sgd": (FusedSGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "lamb": (FusedLAMB, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
    "adagrad": (FusedAdagrad, dict(lr=1e-2, weight_decay=0.01)),
    "novograd": (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
}
DTYPE_MASTER = [(torch.float32, False), (torch.float16, False), (torch.float16, True), (torch.bfloat16, False),
                (torch.bfloat16, True)]


def make(family, dtype, master, device, gen):
    cls, hyper = FAMILIES[family]
    params = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in SHAPES]
    return params, cls(params, master_weights=master, **hyper)


def scaler_of(kind, device, dtype, init_scale):
    if kind == "torch":
        return torch_grad_scaler(device, dtype, init_scale=init_scale, growth_interval=1000)
    return mixprec.GradScaler(torch.device(device).type, init_scale=init_scale, growth_interval=1000)


def backward(scaler, params, gen):
    """Scaled backward of sum(p * c): each grad is c * scale rounded to the param's dtype (c small
    enough that 2^16 times it stays finite in fp16)."""
    coefs = [random_tensor(p.shape, torch.float32, p.device, gen, scale=2.0**-5) for p in params]
    for p in params:
        p.grad = None
    scaler.scale(sum((p.float() * c).sum() for p, c in zip(params, coefs))).backward()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype,master", DTYPE_MASTER, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("kind,init_scale", [("torch", 2.0**16), ("mixprec", 2.0**16), ("mixprec", 3000.0)])
def test_step_leaves_grads_unscaled(family, dtype, master, kind, init_scale, device, gen):
    """Three steps: after each, every grad is the scaled grad times the float32 1/scale, rounded to
    its dtype (bit for bit), and within that dtype's rounding of the float64 quotient."""
    params, opt = make(family, dtype, master, device, gen)
    scaler = scaler_of(kind, device, dtype, init_scale)
    for k in range(3):
        backward(scaler, params, gen)
        scale = scaler.get_scale()
        scaled = snapshot([p.grad for p in params])
        scaler.step(opt)
        scaler.update()
        inv = 1 / scalar(scale, "cpu")
        for i, (p, g) in enumerate(zip(params, scaled)):
            assert_bitwise_equal(p.grad, (g.cpu().float() * inv).to(dtype), f"step {k}: grad {i}")
            exact = g.cpu().double() / scale
            assert rel_err(p.grad.cpu().double(), exact) <= torch.finfo(dtype).eps, f"step {k}: grad {i} vs float64"
        assert opt.param_groups[0]["step"].item() == k + 1


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype,master", DTYPE_MASTER, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("kind", ["torch", "mixprec"])
@pytest.mark.parametrize("where", ["first", "last", "random"])
def test_skipped_step_leaves_grads_params_and_state(family, dtype, master, kind, where, device, gen):
    """An inf/NaN in one grad: the skipped step leaves every grad (the others still scaled),
    param, state tensor and step count bit-identical; the next clean step unscales again."""
    params, opt = make(family, dtype, master, device, gen)
    scaler = scaler_of(kind, device, dtype, 2.0**12)
    backward(scaler, params, gen)
    scaler.step(opt)  # a first clean step, so the state exists and is non-trivial
    scaler.update()
    backward(scaler, params, gen)
    inject_non_finite(params[int(torch.randint(0, len(params), (1,), generator=gen))].grad, where, float("nan"), gen)
    grads = snapshot([p.grad for p in params])
    state = snapshot(optimizer_tensors(params, opt))
    scaler.step(opt)
    scaler.update()
    for i, (p, g) in enumerate(zip(params, grads)):
        assert_bitwise_equal(p.grad, g, f"grad {i} after the skipped step", nan_equal=True)
    assert_unchanged(state, optimizer_tensors(params, opt), "skipped step")
    assert scaler.get_scale() == 2.0**11


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype,master", DTYPE_MASTER, ids=lambda v: str(v).replace("torch.", ""))
def test_without_a_scaler_grads_are_only_read(family, dtype, master, device, gen):
    params, opt = make(family, dtype, master, device, gen)
    for _ in range(2):
        for p in params:
            p.grad = random_tensor(p.shape, dtype, device, gen)
        grads = snapshot([p.grad for p in params])
        opt.step()
        assert_unchanged(grads, [p.grad for p in params], "grads after a step without a scaler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_grads_equal_torch_fused_adamw(dtype, device, gen):
    """torch.optim.AdamW(fused=True) and FusedAdam under one torch.amp.GradScaler each, fed the
    same scaled grads: equal .grad after every step, a skipped one included."""
    inits = [random_tensor(s, dtype, device, gen) for s in SHAPES]
    ours = [torch.nn.Parameter(x.clone()) for x in inits]
    theirs = [torch.nn.Parameter(x.clone()) for x in inits]
    opt_ours = FusedAdam(ours, lr=1e-2, weight_decay=0.01)
    try:
        opt_theirs = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.01, fused=True)
    except RuntimeError as e:  # the peer, not mixprec, is missing
        pytest.skip(f"torch's fused AdamW is unavailable for {dtype} on {device}: {e}")
    scalers = [torch_grad_scaler(device, dtype, init_scale=2.0**14, growth_interval=1000) for _ in range(2)]
    for k in range(4):
        coefs = [random_tensor(s, torch.float32, device, gen) for s in SHAPES]
        for ps, scaler in zip((ours, theirs), scalers):
            for p in ps:
                p.grad = None
            scaler.scale(sum((p.float() * c).sum() for p, c in zip(ps, coefs))).backward()
        if k == 2:
            for ps in (ours, theirs):
                ps[1].grad[0, 3] = float("inf")
        before = snapshot([p.grad for p in ours])
        for (ps, opt), scaler in zip(((ours, opt_ours), (theirs, opt_theirs)), scalers):
            try:
                scaler.step(opt)
            except (RuntimeError, NotImplementedError) as e:
                pytest.skip(f"torch's fused AdamW cannot step {dtype} on {device}: {e}")
            scaler.update()
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_bitwise_equal(a.grad, b.grad, f"step {k}: grad {i} vs torch's fused AdamW")
        # Step 2 has an inf planted; a random coefficient past 65504 / 2**14 overflows an fp16 grad
        # on its own (some seeds): a skipped step leaves the grads as they were, in either case.
        if not all(bool(torch.isfinite(g).all()) for g in before):
            assert_unchanged(before, [p.grad for p in ours], "grads of the skipped step")
        else:
            assert not torch.equal(before[0], ours[0].grad), "the grads were not unscaled"
