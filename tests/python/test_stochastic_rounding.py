# rounding="stochastic": pure-bf16 steps rounded by a counter-based hash, checked bit for bit
# against a Python twin of the hash (so CPU and CUDA agree), for bias, determinism and checkpoints.
from __future__ import annotations

import io

import pytest
import torch

import mixprec
from conftest import DEVICES, assert_bitwise_equal, assert_unchanged, snapshot

M32 = 0xFFFFFFFF


def mul32(x, c):
    """x * c mod 2**32 for int64 tensors or ints below 2**32 (split so int64 never overflows)."""
    if isinstance(x, int):
        return (x * c) & M32
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x):
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounding_key(seed: int, step: int, tensor: int) -> int:
    k = mix32((seed & M32) ^ 0x9E3779B9)
    k = mix32(k ^ (seed >> 32))
    k = mix32(k ^ step)
    return mix32((k + tensor) & M32)


def reference_round(x: torch.Tensor, seed: int, step: int, tensor: int) -> torch.Tensor:
    """kernels/optim_common.h's bf16_round_stochastic of fp32 `x`, element i hashed at index i."""
    x = x.detach().cpu().contiguous().view(-1)
    index = torch.arange(x.numel(), dtype=torch.int64)
    key = rounding_key(seed, step, tensor)
    r = mix32((mix32((index & M32) ^ key) + (index >> 32)) & M32)
    u = x.view(torch.int32).to(torch.int64) & M32
    out = (u + (r & 0xFFFF)) >> 16
    special = (u & 0x7F800000) == 0x7F800000
    out = torch.where(special, torch.where((u & 0x7FFFFF) != 0, (u >> 16) | 0x40, u >> 16), out) & 0xFFFF
    return torch.where(out >= 2**15, out - 2**16, out).to(torch.int16).view(torch.bfloat16)


def sgd(params, **kw):
    return mixprec.optimizers.FusedSGD(params, lr=1.0, rounding="stochastic", **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_is_the_hash_of_seed_step_tensor_and_element(device, gen):
    # SGD with lr 1 and bf16 grads: w - g is exact in fp32 on every device, so the bits that come
    # out are the rounding's alone, and must be the Python twin's (hence the same on CPU and CUDA).
    shapes = [(1000,), (3, 513), (1,), (70000,)]  # a second chunk (65536) in the last
    params = [torch.randn(s, generator=gen).bfloat16().to(device).requires_grad_() for s in shapes]
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    opt = sgd(params, seed=seed)
    for step in range(1, 4):
        expected = []
        for i, p in enumerate(params):
            p.grad = (torch.randn(p.shape, generator=gen) * 2.0**-9).bfloat16().to(device)
            expected.append(reference_round(p.detach().float() - p.grad.float(), seed, step, i).view(p.shape))
        opt.step()
        for i, p in enumerate(params):
            assert_bitwise_equal(p.detach().cpu(), expected[i], f"step {step} tensor {i}")


def test_rounding_is_unbiased(gen):
    # x = +-(1 + k/32 ulp) for k = 1..31 between the bf16 neighbours 1 and 1 + 2**-7 (and their
    # negatives), many elements and steps each: the mean of the rounded values is x in float64
    # within 5 standard errors, and the round-up count is binomial(k/32).
    n, steps = 31 * 2048, 12
    k = torch.arange(n) % 31 + 1
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    grad = (-sign * k * 2.0**-12).bfloat16()
    x = sign.double() * (1 + k.double() * 2.0**-12)
    p = torch.zeros(n, dtype=torch.bfloat16, requires_grad=True)
    opt = sgd([p], seed=int(torch.randint(0, 2**62, (1,), generator=gen)))
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            p.copy_(sign)
        p.grad = grad.clone()
        opt.step()
        total += p.detach().double()
    ulp = 2.0**-7
    up = ((total - steps * sign.double()).abs() / ulp).round()
    for kk in range(1, 32):
        sel = k == kk
        trials = int(sel.sum()) * steps
        prob = kk / 32
        ups = float(up[sel].sum())
        sigma = (trials * prob * (1 - prob)) ** 0.5
        assert abs(ups - trials * prob) < 5 * sigma, f"k={kk}: {ups} ups in {trials}, expected {trials * prob}"
        mean = float(total[sel].sum()) / trials
        ref = float(x[sel].sum()) / int(sel.sum())
        assert abs(mean - ref) < 5 * ulp * sigma / trials + 1e-12, f"k={kk}: mean {mean} vs {ref}"


def run(params, grads, seed, steps, opt=None):
    opt = opt or sgd(params, seed=seed, momentum=0.9)
    for g in grads[:steps]:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
    return opt


def test_same_seed_same_bits_and_other_seeds_differ(gen):
    base = [torch.randn(s, generator=gen).bfloat16() for s in [(300,), (17, 9)]]
    grads = [[(torch.randn(b.shape, generator=gen) * 1e-2).bfloat16() for b in base] for _ in range(6)]
    outs = []
    for seed in (7, 7, 8):
        ps = [b.clone().requires_grad_() for b in base]
        run(ps, grads, seed, 6)
        outs.append(ps)
    for a, b in zip(outs[0], outs[1]):
        assert_bitwise_equal(a.detach(), b.detach(), "same seed")
    assert any(not torch.equal(a, c) for a, c in zip(outs[0], outs[2])), "another seed rounds the same"


def test_checkpoint_round_trip_repeats_the_rounding(gen):
    base = [torch.randn(s, generator=gen).bfloat16() for s in [(300,), (5, 7)]]
    grads = [[(torch.randn(b.shape, generator=gen) * 1e-2).bfloat16() for b in base] for _ in range(10)]
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    straight = [b.clone().requires_grad_() for b in base]
    run(straight, grads, seed, 10)
    first = [b.clone().requires_grad_() for b in base]
    opt = run(first, grads, seed, 5)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["param_groups"][0]["seed"] == seed and saved["param_groups"][0]["rounding"] == "stochastic"
    assert float(saved["param_groups"][0]["step"]) == 5
    resumed = [p.detach().clone().requires_grad_() for p in first]
    fresh = sgd(resumed, seed=0, momentum=0.9)  # the checkpoint's seed wins
    fresh.load_state_dict(saved)
    run(resumed, grads[5:], None, 5, opt=fresh)
    for a, b in zip(resumed, straight):
        assert_bitwise_equal(a.detach(), b.detach(), "resumed run")


FAMILIES = {
    "adam": lambda ps, **kw: mixprec.optimizers.FusedAdam(ps, lr=1e-2, weight_decay=0.1, **kw),
    "sgd": lambda ps, **kw: mixprec.optimizers.FusedSGD(ps, lr=1e-2, momentum=0.9, **kw),
    "lamb": lambda ps, **kw: mixprec.optimizers.FusedLAMB(ps, lr=1e-2, **kw),
    "adagrad": lambda ps, **kw: mixprec.optimizers.FusedAdagrad(ps, lr=1e-2, **kw),
    # NovoGrad's step is the layer-normalized gradient averaged with weight 1 - beta1: about 1e-5
    # per element at lr 1e-2, a thousandth of bf16's spacing near 1, so it rounds away from nearest
    # only a few times per step; lr 1e-1 makes that dozens.
    "novograd": lambda ps, **kw: mixprec.optimizers.FusedNovoGrad(ps, lr=1e-1, **kw),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_rounds_its_fp32_update_by_the_hash(family, gen):
    # Each step, an fp32 twin loaded with the bf16 run's state computes the unrounded update; the
    # bf16 run's params must be that value rounded by the hash, and the twin's state the same.
    params = [torch.randn(s, generator=gen).bfloat16().requires_grad_() for s in [(600,), (3, 11)]]
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    opt = FAMILIES[family](params, rounding="stochastic", seed=seed)
    away_from_nearest = 0
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in params]
        twin_params = [p.detach().float().requires_grad_() for p in params]
        twin = FAMILIES[family](twin_params)
        if step > 1:
            twin.load_state_dict(opt.state_dict())
        for p, t, g in zip(params, twin_params, grads):
            p.grad, t.grad = g.clone(), g.float()
        opt.step()
        twin.step()
        for i, (p, t) in enumerate(zip(params, twin_params)):
            assert_bitwise_equal(p.detach(), reference_round(t, seed, step, i).view(p.shape), f"step {step} param {i}")
        nearest = [t.detach().bfloat16() for t in twin_params]
        away_from_nearest += sum(int((p.detach() != q).sum()) for p, q in zip(params, nearest))
    # Counted over the run, not per step: one step of small updates may round every element the
    # nearest way by chance; five steps of 633 elements may not.
    assert away_from_nearest > 0, "rounded to nearest"


def test_refusals_name_the_problem_and_change_nothing(gen):
    p16 = torch.randn(4, generator=gen).half().requires_grad_()
    pb = torch.randn(4, generator=gen).bfloat16().requires_grad_()
    with pytest.raises(ValueError, match="rounding='stochastic' rounds to bfloat16; param group 0 param 0 is float16"):
        sgd([p16])
    with pytest.raises(ValueError, match=r"invalid combination master_weights=True, rounding='stochastic'"):
        sgd([pb], master_weights=True)
    with pytest.raises(ValueError, match="invalid rounding 'up'; expected 'nearest' or 'stochastic'"):
        mixprec.optimizers.FusedAdam([pb], rounding="up")
    for bad in (-1, True, 2**63, 1.5):
        with pytest.raises(ValueError, match="invalid seed"):
            mixprec.optimizers.FusedAdam([pb], rounding="stochastic", seed=bad)
    # The op itself: fp16 params, and masters beside stochastic rounding.
    g16, gb = torch.randn(4, generator=gen).half(), torch.randn(4, generator=gen).bfloat16()
    master = pb.detach().float()
    before = snapshot([p16, pb, g16, gb, master])
    for validate_only in (True, False):
        with pytest.raises(TypeError, match=r"mixprec::sgd_: params\[1\] is float16; stochastic_rounding rounds"):
            mixprec.sgd_([pb.detach(), p16.detach()], [gb, g16], [], lr=0.1, stochastic_rounding=True, step=1,
                             validate_only=validate_only)
        with pytest.raises(ValueError, match=r"mixprec::sgd_: stochastic_rounding rounds params kept without masters"):
            mixprec.sgd_([pb.detach()], [gb], [], lr=0.1, stochastic_rounding=True, master_params=[master], step=1,
                             validate_only=validate_only)
        with pytest.raises(ValueError, match=r"mixprec::sgd_: step must be >= 1"):
            mixprec.sgd_([pb.detach()], [gb], [], lr=0.1, stochastic_rounding=True, validate_only=validate_only)
    assert_unchanged(before, [p16, pb, g16, gb, master])


def test_float32_params_in_a_stochastic_group_are_exact(gen):
    p32 = torch.randn(50, generator=gen).requires_grad_()
    ref = p32.detach().clone().requires_grad_()
    g = torch.randn(50, generator=gen)
    p32.grad, ref.grad = g.clone(), g.clone()
    sgd([p32], seed=3).step()
    mixprec.optimizers.FusedSGD([ref], lr=1.0).step()
    assert_bitwise_equal(p32.detach(), ref.detach(), "fp32 param")


def test_a_skipped_step_changes_nothing_and_the_next_rounds_as_its_count_says(gen):
    p = torch.randn(777, generator=gen).bfloat16().requires_grad_()
    opt = sgd([p], seed=5)
    g = (torch.randn(777, generator=gen) * 2.0**-9).bfloat16()
    g[3] = float("inf")
    p.grad = g.clone()
    before = snapshot([p])
    opt.found_inf = torch.ones(1)
    opt.step()
    assert_unchanged(before, [p])
    assert float(opt.param_groups[0]["step"]) == 0
    opt.found_inf = torch.zeros(1)
    g[3] = 0.0
    p.grad = g.clone()
    expected = reference_round(p.detach().float() - g.float(), 5, 1, 0)
    opt.step()
    assert_bitwise_equal(p.detach(), expected, "first counted step")
