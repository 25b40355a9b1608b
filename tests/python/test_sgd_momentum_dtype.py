# FusedSGD's momentum in the param's dtype (state_dtype="param", the Apex alias's default): the
# fp16/bf16 trajectory of torch.optim.SGD and of Apex's L0 TestFusedSGD.test_half, checkpoints,
# the defaults of both classes, and refused options and op calls that change nothing.
from __future__ import annotations

import importlib
import io

import pytest
import torch

import mixprec
from mixprec import apex_alias
from mixprec.optimizers import FusedSGD

LOW = (torch.float16, torch.bfloat16)
# Powers of two only: every product torch.optim.SGD forms (lr * d, momentum * buf, wd * w,
# (1 - dampening) * g) is exact in fp16/bf16 and fp32, so its per-op roundings fall on the sums
# alone, whatever its kernels contract into one fma or how its CPU add rounds alpha (to the
# tensor's dtype in the vectorized loop): the trajectories must be identical bit for bit.
EXACT_CONFIGS = {
    "apex_test_half": dict(lr=0.25, momentum=0.125),  # Apex's TestFusedSGD options
    "nesterov": dict(lr=0.25, momentum=0.125, nesterov=True),
    "weight_decay": dict(lr=0.25, momentum=0.125, weight_decay=2.0 ** -7),
    "dampening_wd_maximize": dict(lr=0.125, momentum=0.25, dampening=0.5, weight_decay=2.0 ** -6, maximize=True),
}


def apex_fused_sgd():
    """apex.optimizers.FusedSGD as mixprec's alias resolves it (without installing the alias)."""
    return importlib.import_module(apex_alias.ALIASES["apex.optimizers"]).FusedSGD


def snapshot(*tensors):
    return [t.detach().clone() for t in tensors]


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.element_size() == 2 else a,
                                              b.view(torch.int16) if b.element_size() == 2 else b)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("config", list(EXACT_CONFIGS))
def test_apex_test_half_against_torch_sgd(device, dtype, config, gen):
    """What Apex's TestFusedSGD.test_half checks (FusedSGD against torch.optim.SGD on fp16 params,
    7 steps of rand grads, 1e-3 abs), here bit for bit and for momentum, Nesterov and decay too.
    With float32 momentum (mixprec's default, and main before this) the params drift 3 fp16 ulps
    from torch's in 7 steps."""
    hyper = EXACT_CONFIGS[config]
    n = 278011 if device == "cuda" else 40009
    start = torch.rand(n, generator=gen).to(device, dtype)
    ref = torch.nn.Parameter(start.clone())
    tst = torch.nn.Parameter(start.clone())
    ref_opt = torch.optim.SGD([ref], **hyper)  # foreach on CUDA, single-tensor on the CPU
    tst_opt = apex_fused_sgd()([tst], **hyper)
    for step in range(7):
        ref.grad = torch.rand(n, generator=gen).to(device, dtype)
        tst.grad = ref.grad  # one tensor for both, as Apex's test does: neither may change it
        grad = ref.grad.clone()
        ref_opt.step()
        tst_opt.step()
        assert torch.equal(ref.grad, grad)
        buf = tst_opt.state[tst]["momentum_buffer"]
        assert buf.dtype == dtype
        assert same_bits(buf, ref_opt.state[ref]["momentum_buffer"]), f"step {step}: momentum"
        assert same_bits(tst.detach(), ref.detach()), f"step {step}: params"
        assert (tst - ref).abs().max().item() <= 1e-3  # Apex's own bound, trivially


def emulated_step(w, g, buf, first, dtype, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                  maximize=False):
    """float64 SGD with torch.optim.SGD's roundings on fp16/bf16 params: each intermediate tensor
    (decayed grad, momentum * buf, new buffer, Nesterov's sum, new weight) rounded to `dtype`.
    Coefficients as the kernel has them (float32)."""
    def r(x):
        return x.to(dtype).double()

    def f32(x):
        return float(torch.tensor(x, dtype=torch.float32))

    lr, momentum, weight_decay, one_minus_d = f32(lr), f32(momentum), f32(weight_decay), f32(1.0 - dampening)
    g = -g if maximize else g
    if weight_decay != 0.0:
        g = r(g + weight_decay * w)
    buf = g.clone() if first else r(r(momentum * buf) + one_minus_d * g)
    g = r(g + momentum * buf) if nesterov else buf
    return r(w - lr * g), buf


def ulp(x, dtype):
    """Spacing of `dtype` at |x| (at least its smallest normal's), as float64."""
    a = x.abs().clamp_min(torch.finfo(dtype).tiny).to(dtype)
    return (torch.nextafter(a, torch.full_like(a, float("inf"))).double() - a.double())


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("hyper", [dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.05),
                                   dict(lr=0.03, momentum=0.7, nesterov=True, weight_decay=0.02, maximize=True)],
                         ids=["dampening_wd", "nesterov_wd_maximize"])
def test_param_dtype_momentum_against_float64(device, dtype, hyper, gen):
    """Any hyper-parameters: the float64 emulation of those roundings. fp32 intermediates differ
    from float64 ones by 2^-24 relative, which moves a rounding only next to a tie: nearly every
    element identical. A moved rounding is an ulp of the terms summed where it happened, and is
    carried on: into the buffer (decaying by momentum) and through lr * (1 + momentum) into the
    weight, which may round once more. The bound adds those up step by step (twice, for margin)."""
    n = 8191
    lr, m = hyper["lr"], hyper["momentum"]
    w64 = (torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype).double()
    p = torch.nn.Parameter(w64.to(device, dtype))
    opt = FusedSGD([p], state_dtype="param", **hyper)
    buf64 = None
    tol_w = torch.zeros(n, dtype=torch.float64)
    tol_b = torch.zeros(n, dtype=torch.float64)
    for step in range(6):
        g64 = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).double()
        p.grad = g64.to(device, dtype)
        opt.step()
        terms = torch.maximum(w64.abs(), g64.abs())
        w64, buf64 = emulated_step(w64, g64, buf64, step == 0, dtype, **hyper)
        terms = torch.maximum(terms, buf64.abs())
        tol_b = m * tol_b + 2 * ulp(terms, dtype)
        tol_w = tol_w + lr * (1 + m) * tol_b + ulp(w64, dtype)
        for got, want, tol in ((p.detach(), w64, tol_w), (opt.state[p]["momentum_buffer"], buf64, tol_b)):
            assert got.dtype == dtype
            diff = (got.cpu().double() - want).abs()
            assert (diff <= 2 * tol).all(), f"step {step}: {diff.max().item()}"
            assert (diff == 0).double().mean().item() >= 0.99, f"step {step}"


@pytest.mark.parametrize("cls", [FusedSGD, "apex"])
def test_buffer_dtypes_of_each_default_and_option(device, cls):
    """mixprec's FusedSGD: float32 buffers unless told; the alias's: the dtype of the weight the
    step updates (the param's, float32 where there is a master), as Apex's and torch's are."""
    cls = apex_fused_sgd() if cls == "apex" else cls
    params = [torch.nn.Parameter(torch.randn(5, device=device, dtype=dt)) for dt in (torch.float32, *LOW)]
    master = [torch.nn.Parameter(torch.randn(5, device=device, dtype=dt)) for dt in LOW]
    opt = cls([{"params": params}, {"params": master, "master_weights": True}], lr=0.1, momentum=0.9)
    for p in params + master:
        p.grad = torch.randn_like(p)
    opt.step()
    param_dtype = cls is not FusedSGD
    assert opt.state_dtype == ("param" if param_dtype else torch.float32)
    for p in params:
        want = p.dtype if param_dtype else torch.float32
        assert opt.state[p]["momentum_buffer"].dtype == want
    for p in master:
        assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    # Switching the option converts the buffers at the next step.
    opt.state_dtype = torch.float32 if param_dtype else "param"
    opt.step()
    for p in params:
        want = torch.float32 if param_dtype else p.dtype
        assert opt.state[p]["momentum_buffer"].dtype == want


def test_alias_class_is_mixprec_fused_sgd():
    cls = apex_fused_sgd()
    assert issubclass(cls, FusedSGD) and cls.__name__ == "FusedSGD"
    mod = importlib.import_module(apex_alias.ALIASES["apex.optimizers"])
    for name in ("FusedAdam", "FusedLAMB", "FusedAdagrad", "FusedNovoGrad", "FusedMixedPrecisionLamb"):
        assert getattr(mod, name) is getattr(mixprec.optimizers, name)


@pytest.mark.parametrize("dtype", LOW)
def test_state_dict_round_trip_keeps_param_dtype_buffers(device, dtype, gen):
    hyper = dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)
    start = torch.randn(1000, generator=gen).to(device, dtype)
    a = torch.nn.Parameter(start.clone())
    opt = FusedSGD([a], state_dtype="param", **hyper)
    grads = [torch.randn(1000, generator=gen).to(device, dtype) for _ in range(6)]
    for g in grads[:3]:
        a.grad = g.clone()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = torch.nn.Parameter(a.detach().clone())
    # Made with float32 momentum: the checkpoint's group option ("param") wins, no conversion.
    opt_b = FusedSGD([b], **hyper)
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["state_dtype"] == "param"
    assert same_bits(opt_b.state[b]["momentum_buffer"], opt.state[a]["momentum_buffer"])
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        opt_b.step()
        assert same_bits(a.detach(), b.detach())
        assert same_bits(opt_b.state[b]["momentum_buffer"], opt.state[a]["momentum_buffer"])


@pytest.mark.parametrize("dtype", LOW)
def test_loads_torch_sgd_checkpoint_and_continues_its_trajectory(device, dtype, gen):
    hyper = EXACT_CONFIGS["weight_decay"]
    start = torch.rand(4099, generator=gen).to(device, dtype)
    ref = torch.nn.Parameter(start.clone())
    ref_opt = torch.optim.SGD([ref], **hyper)
    grads = [torch.rand(4099, generator=gen).to(device, dtype) for _ in range(5)]
    for g in grads[:2]:
        ref.grad = g.clone()
        ref_opt.step()
    tst = torch.nn.Parameter(ref.detach().clone())
    tst_opt = FusedSGD([tst], state_dtype="param", **hyper)
    tst_opt.load_state_dict(ref_opt.state_dict())
    assert tst_opt.state[tst]["momentum_buffer"].dtype == dtype  # kept, not widened
    for g in grads[2:]:
        ref.grad, tst.grad = g.clone(), g.clone()
        ref_opt.step()
        tst_opt.step()
        assert same_bits(tst.detach(), ref.detach())


BAD_STATE_DTYPES = [torch.float16, torch.bfloat16, torch.float64, "params", None, 1]


@pytest.mark.parametrize("bad", BAD_STATE_DTYPES, ids=repr)
def test_bad_state_dtype_is_refused_and_changes_nothing(bad):
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r'FusedSGD: defaults: invalid state_dtype .*; expected torch.float32 or "param"'):
        FusedSGD([p], lr=0.1, momentum=0.9, state_dtype=bad)

    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn_like(p)
    opt.step()
    before = snapshot(p, p.grad, opt.state[p]["momentum_buffer"], opt.param_groups[0]["step"])
    groups_before = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in opt.param_groups]
    defaults_before = dict(opt.defaults)

    q = torch.nn.Parameter(torch.randn(3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"FusedSGD: param group 1: invalid state_dtype"):
        opt.add_param_group({"params": [q], "state_dtype": bad})
    with pytest.raises(ValueError, match=r"FusedSGD: setting state_dtype: invalid state_dtype"):
        opt.state_dtype = bad
    opt.param_groups[0]["state_dtype"] = bad  # set behind the optimizer's back: refused at step()
    with pytest.raises(ValueError, match=r"FusedSGD: param group 0: invalid state_dtype"):
        opt.step()
    opt.param_groups[0]["state_dtype"] = torch.float32

    assert len(opt.param_groups) == 1 and opt.defaults == defaults_before
    assert [{k: v for k, v in g.items() if k not in ("params", "step")} for g in opt.param_groups] == groups_before
    after = (p, p.grad, opt.state[p]["momentum_buffer"], opt.param_groups[0]["step"])
    assert all(same_bits(x.detach(), y) for x, y in zip(after, before))


@pytest.mark.parametrize("param_dtype,buffer_dtype", [(torch.float32, torch.float16), (torch.float16, torch.bfloat16),
                                                      (torch.bfloat16, torch.float16), (torch.float16, torch.float64)])
def test_op_refuses_a_buffer_of_another_low_dtype(device, param_dtype, buffer_dtype, gen):
    """sgd_ takes float32 buffers or buffers of the param's dtype; anything else is a TypeError naming
    the buffer and its param, and the refused call writes nothing."""
    params = [torch.randn(7, generator=gen).to(device, param_dtype) for _ in range(2)]
    grads = [torch.randn(7, generator=gen).to(device, param_dtype) for _ in range(2)]
    bufs = [torch.randn(7, generator=gen).to(device, torch.float32),
            torch.randn(7, generator=gen).to(device, buffer_dtype)]
    before = snapshot(*params, *grads, *bufs)
    with pytest.raises(TypeError, match=r"momentum_buffers\[1\] has dtype .* but .*params\[1\] is .*; a momentum buffer "
                                        r"must be float32 or its param's dtype"):
        mixprec.sgd_(params, grads, bufs, lr=0.1, momentum=0.9, step=2)
    assert all(same_bits(x, y) for x, y in zip(params + grads + bufs, before))


@pytest.mark.parametrize("dtype", LOW)
def test_op_steps_param_dtype_buffers_with_grad_scale(device, dtype, gen):
    """Op level, under a loss scale (the GradScaler path): the buffer gets the unscaled gradient
    rounded to its dtype, as torch's unscale_ would leave it, and a found_inf step writes nothing."""
    n = 1031
    p = torch.randn(n, generator=gen).to(device, dtype)
    g = (torch.randn(n, generator=gen) * 1024).to(device, dtype)
    buf = torch.full((n,), float("nan"), device=device, dtype=dtype)  # poisoned: the first step must not read it
    scale = torch.tensor([1024.0], device=device)
    found = torch.tensor([1.0], device=device)
    before = snapshot(p, g, buf)
    mixprec.sgd_([p], [g], [buf], lr=0.5, momentum=0.9, step=1, grad_scale=scale, found_inf=found)
    assert all(same_bits(x, y) for x, y in zip((p, g, buf), before))
    found.zero_()
    mixprec.sgd_([p], [g], [buf], lr=0.5, momentum=0.9, step=1, grad_scale=scale, found_inf=found)
    unscaled = (before[1].double() / 1024).to(dtype)
    assert same_bits(g, unscaled) and same_bits(buf, unscaled)
    assert same_bits(p, (before[0].double() - 0.5 * unscaled.double()).to(dtype))


def test_without_momentum_nothing_is_rounded(device, gen):
    """momentum == 0: no buffer, so no momentum dtype; fp16 params with fp32 masters (amp_C's
    four lists, O2) step their masters exactly as fp32 params would, decay included."""
    masters = [torch.randn(n, generator=gen).to(device) for n in (5, 1031)]
    grads = [torch.randn(m.shape, generator=gen).to(device, torch.float16) for m in masters]
    fp32 = [m.clone() for m in masters]
    half = [m.half() for m in masters]
    kw = dict(lr=0.1, weight_decay=0.01, step=1)
    mixprec.sgd_(half, grads, [], master_params=masters, **kw)
    mixprec.sgd_(fp32, [g.float() for g in grads], [], **kw)
    assert all(same_bits(a, b) for a, b in zip(masters, fp32))
    assert all(same_bits(h, m.half()) for h, m in zip(half, masters))
