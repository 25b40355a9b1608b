# master_weights="remainder": bf16 params whose fp32 masters are kept as (param, int16 low half),
# checked bit for bit against fp32-master runs, across checkpoints both ways, and its refusals.
from __future__ import annotations

import io

import pytest
import torch

import mixprec
from conftest import DEVICES, assert_bitwise_equal, assert_unchanged, bits, snapshot
from mixprec.optimizers import _lean

FAMILIES = {
    "adam": lambda ps, mw: mixprec.optimizers.FusedAdam(ps, lr=3e-3, weight_decay=0.01, master_weights=mw),
    "sgd": lambda ps, mw: mixprec.optimizers.FusedSGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, master_weights=mw),
    "lamb": lambda ps, mw: mixprec.optimizers.FusedLAMB(ps, lr=1e-2, master_weights=mw),
    "adagrad": lambda ps, mw: mixprec.optimizers.FusedAdagrad(ps, lr=1e-2, weight_decay=0.01, master_weights=mw),
    "novograd": lambda ps, mw: mixprec.optimizers.FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01, master_weights=mw),
}
# Straddle the CPU tile (512) and the vector widths; one empty tensor.
SHAPES = [(37,), (513,), (4, 33), (0,), (1,)]


def make_params(gen, device, shapes=SHAPES):
    return [torch.randn(s, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_() for s in shapes]


def clones(params):
    return [p.detach().clone().requires_grad_() for p in params]


def rne_bf16(master):
    """torch's round-to-nearest-even bf16 of each master (what an fp32-master run's model holds)."""
    return master.to(torch.bfloat16)


def set_grads(gen, step, pairs, device, skip):
    """Same random grads (scaled by `scale`) into every param list of `pairs`; with `skip`, an
    inf in one of them and found_inf set, as a GradScaler would."""
    scale = 2.0 ** int(torch.randint(0, 8, (1,), generator=gen))
    for i, ps in enumerate(zip(*pairs)):
        g = torch.randn(ps[0].shape, generator=gen) * scale
        if skip and g.numel() > 0 and i == step % len(SHAPES):
            g.view(-1)[int(torch.randint(0, g.numel(), (1,), generator=gen))] = float("inf")
        for p in ps:
            p.grad = g.to(device=device, dtype=p.dtype)
    return scale


def step_all(opts, scale, skip, device):
    for opt in opts:
        opt.grad_scale = torch.tensor([scale], device=device)
        opt.found_inf = torch.tensor([1.0 if skip else 0.0], device=device)
        opt.step()


def masters_and_weights(opt, params):
    """Each param's fp32 master as the optimizer holds it (rebuilt from a remainder), and its weight."""
    out = []
    for p in params:
        state = opt.state[p]
        if _lean.REMAINDER in state:
            out.append((_lean.rebuild(p, state[_lean.REMAINDER]), p.detach()))
        else:
            out.append((state["master_param"], p.detach()))
    return out


def assert_same_masters(reference, lean, msg):
    """Remainder masters bit-identical to the fp32 ones; the remainder run's weight the nearest
    bf16 of the master with ties toward zero, which is torch's RNE except at exact ties."""
    ties = 0
    for i, ((m_ref, w_ref), (m, w)) in enumerate(zip(reference, lean)):
        assert_bitwise_equal(m, m_ref, f"{msg}: master {i}")
        assert_bitwise_equal(w_ref, rne_bf16(m_ref), f"{msg}: fp32-master run's weight {i}")
        tie = (bits(m_ref).to(torch.int64) & 0xFFFF) == 0x8000
        assert_bitwise_equal(w[~tie.to(w.device)], w_ref[~tie.to(w.device)], f"{msg}: weight {i}")
        expected = _lean.split(m_ref)[0]
        assert_bitwise_equal(w, expected, f"{msg}: weight {i} (ties toward zero)")
        ties += int(tie.sum())
    return ties


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_remainder_run_is_the_fp32_master_run_bit_for_bit(family, device, gen):
    params = make_params(gen, device)
    lean_params = clones(params)
    reference = FAMILIES[family](params, True)
    lean = FAMILIES[family](lean_params, "remainder")
    skipped = 0
    for step in range(1000):
        skip = step % 97 == 13  # some skipped steps, with an inf in the grads
        scale = set_grads(gen, step, (params, lean_params), device, skip)
        step_all((reference, lean), scale, skip, device)
        skipped += skip
        assert_same_masters(masters_and_weights(reference, params), masters_and_weights(lean, lean_params),
                            f"{family} step {step}")
    assert skipped > 5
    assert float(lean.param_groups[0]["step"]) == 1000 - skipped
    # 2 + 2 bytes per bf16 param: the remainder is int16 and nothing else is kept for the weight.
    for p in lean_params:
        assert set(lean.state[p]) & {"master_param", _lean.REMAINDER} == {_lean.REMAINDER}
        assert lean.state[p][_lean.REMAINDER].dtype == torch.int16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_remainders_of_tensors_past_one_chunk(family, device, gen):
    # Chunks past the first (65536 elements) find their remainders at their own offsets.
    shapes = [(2 * 65536 + 5,), (3, 23000)]
    params = make_params(gen, device, shapes)
    lean_params = clones(params)
    reference, lean = FAMILIES[family](params, True), FAMILIES[family](lean_params, "remainder")
    for step in range(3):
        for p, q in zip(params, lean_params):
            p.grad = torch.randn(p.shape, generator=gen).to(device=device, dtype=p.dtype)
            q.grad = p.grad.clone()
        reference.step()
        lean.step()
        assert_same_masters(masters_and_weights(reference, params), masters_and_weights(lean, lean_params),
                            f"{family} step {step}")


def test_split_and_rebuild_are_exact_over_every_low_half(gen):
    # Every 16-bit low half under random high halves, the ties, signs, subnormals, infinities.
    high = torch.randint(0, 2**16, (2**16,), generator=gen, dtype=torch.int64)
    high[:8] = torch.tensor([0x0000, 0x8000, 0x0001, 0x7F7F, 0xFF7F, 0x3F80, 0x0080, 0x807F])
    u = (high << 16) | torch.arange(2**16)
    u = u[((u >> 23) & 0xFF) != 0xFF]  # finite masters (NaN and inf below)
    master = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)
    weight, remainder = _lean.split(master)
    assert_bitwise_equal(_lean.rebuild(weight, remainder), master, "rebuild(split(m))")
    # The weight is a nearest bf16: within half an ulp of the master (overflow to inf aside).
    finite = weight.isfinite()
    err = (weight[finite].double() - master[finite].double()).abs()
    ulp = (weight[finite].double().abs() * 2.0**-7).clamp_min(2.0**-133)
    assert bool((err <= ulp * 0.5 + 1e-300).all())
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    w, r = _lean.split(special)
    assert_bitwise_equal(_lean.rebuild(w, r)[:2], special[:2], "inf")
    assert bool(_lean.rebuild(w, r)[2].isnan()) and bool(w[2].isnan())


def spec_split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split from its definition, in float64 (finite masters): of the two bf16 values around
    the master (its high half, and the next one away from zero), the nearer, ties to the high half;
    the remainder is the low half."""
    u = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low, away = u >> 16, (u >> 16) + 1
    as_float = lambda h: torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).view(torch.bfloat16).double()
    m = master.double()
    take_away = (as_float(away) - m).abs() < (m - as_float(low)).abs()
    weight = torch.where(take_away, away, low)
    to16 = lambda h: torch.where(h >= 2**15, h - 2**16, h).to(torch.int16)
    return to16(weight).view(torch.bfloat16), to16(u & 0xFFFF)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_the_master_form_ops_follow_their_definition_on_every_layout(device, layout, gen):
    # mixprec::master_split / master_rebuild (one implementation for both fronts) against the
    # split's definition, on the device and in the master's layout.
    master = torch.randn(2, 3, 5, 7, generator=gen) * torch.exp2(torch.randint(-20, 20, (2, 3, 5, 7), generator=gen))
    master.view(-1)[:4] = torch.tensor([1.0 + 2.0**-8, -(1.0 + 3 * 2.0**-8), 2.0**-130, -0.0])  # ties, subnormal
    master = master.to(device)
    if layout == "channels_last":
        master = master.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        master = master.transpose(1, 3)
    weight, remainder = torch.ops.mixprec.master_split(master)
    want_weight, want_remainder = spec_split(master.cpu().contiguous())
    assert weight.device == master.device and weight.stride() == master.stride()
    assert_bitwise_equal(weight.cpu().contiguous(), want_weight, "weight")
    assert_bitwise_equal(remainder.cpu().contiguous(), want_remainder, "remainder")
    assert_bitwise_equal(torch.ops.mixprec.master_rebuild(weight, remainder), master, "rebuild")


def test_the_master_form_ops_refuse_what_they_cannot_read_and_pass_opcheck(gen):
    m = torch.randn(9, generator=gen)
    w, r = torch.ops.mixprec.master_split(m)
    torch.library.opcheck(torch.ops.mixprec.master_split.default, (m,))
    torch.library.opcheck(torch.ops.mixprec.master_rebuild.default, (w, r))
    with pytest.raises(TypeError, match="mixprec::master_split: master must be a float32 tensor, got torch.bfloat16"):
        torch.ops.mixprec.master_split(w)
    with pytest.raises(TypeError, match="mixprec::master_rebuild: weight must be a bfloat16 tensor, got torch.float32"):
        torch.ops.mixprec.master_rebuild(m, r)
    with pytest.raises(TypeError, match="mixprec::master_rebuild: remainder must be an int16 tensor"):
        torch.ops.mixprec.master_rebuild(w, r.int())
    with pytest.raises(ValueError, match=r"remainder has shape \[8\] but weight has \[9\]"):
        torch.ops.mixprec.master_rebuild(w, r[:8])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("direction", ["remainder_to_fp32", "fp32_to_remainder"])
def test_checkpoints_move_between_remainder_and_fp32_masters(family, direction, gen):
    source_mode, target_mode = ("remainder", True) if direction == "remainder_to_fp32" else (True, "remainder")
    params = make_params(gen, "cpu")
    source = FAMILIES[family](params, source_mode)
    for step in range(7):
        step_all((source,), set_grads(gen, step, (params,), "cpu", False), False, "cpu")
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    # The target model holds the source's weights (model.load_state_dict), then its optimizer loads.
    target_params = clones(params)
    target = FAMILIES[family](target_params, target_mode)
    target.load_state_dict(saved)
    # The checkpoint's group options win, as for every option; the form is then chosen again.
    assert target.master_weights == source_mode
    target.master_weights = target_mode
    for step in range(7, 20):
        scale = set_grads(gen, step, (params, target_params), "cpu", step == 11)
        step_all((source, target), scale, step == 11, "cpu")
        pair = (source, params, target, target_params) if source_mode is True else (target, target_params, source,
                                                                                      params)
        assert_same_masters(masters_and_weights(pair[0], pair[1]), masters_and_weights(pair[2], pair[3]),
                            f"{family} {direction} step {step}")
    # Each optimizer ends up keeping the form its groups ask for.
    for p in target_params:
        key = _lean.REMAINDER if target_mode == "remainder" else "master_param"
        assert key in target.state[p] and len({"master_param", _lean.REMAINDER} & set(target.state[p])) == 1


def test_a_resumed_fp32_master_step_rounds_the_weight_to_nearest_even(gen):
    # A remainder checkpoint resumed with fp32 masters: its first step still steps the remainders
    # (ties toward zero), then the masters change form; the weight must then be what an fp32-master
    # step writes, the master rounded to nearest even. Masters on exact ties (low half 0x8000) under
    # odd bf16 weights tell the two apart; lr 0 keeps every master where it is.
    odd = (torch.randint(0x3F00, 0x4000, (64,), generator=gen) | 1).to(torch.int16)
    params = [odd.view(torch.bfloat16).clone().requires_grad_()]
    source = mixprec.optimizers.FusedAdam(params, lr=0.0, master_weights="remainder")
    params[0].grad = torch.zeros_like(params[0])
    source.step()
    source.state[params[0]][_lean.REMAINDER].fill_(-0x8000)  # low half 0x8000 as int16
    masters = _lean.rebuild(params[0], source.state[params[0]][_lean.REMAINDER])
    assert bool(((bits(masters).to(torch.int64) & 0xFFFF) == 0x8000).all())
    target_params = clones(params)
    target = mixprec.optimizers.FusedAdam(target_params, lr=0.0, master_weights=True)
    target.load_state_dict(source.state_dict())
    target.master_weights = True
    target_params[0].grad = torch.zeros_like(target_params[0])
    target.step()
    assert_bitwise_equal(target.state[target_params[0]]["master_param"], masters, "masters")
    assert_bitwise_equal(target_params[0].detach(), rne_bf16(masters), "weights (nearest even)")
    assert not torch.equal(target_params[0].detach(), params[0].detach())  # the ties-toward-zero weights


@pytest.mark.parametrize("bad", [torch.float16, torch.float32])
def test_remainder_needs_bf16_params_and_a_refusal_changes_nothing(bad, gen):
    good = make_params(gen, "cpu", [(5,)])
    other = torch.randn(3, generator=gen).to(bad).requires_grad_()
    message = f"FusedAdam: master_weights='remainder' needs bfloat16 params; param group 0 param 1 is {bad}"
    with pytest.raises(ValueError, match=message):
        mixprec.optimizers.FusedAdam(good + [other], master_weights="remainder")
    opt = mixprec.optimizers.FusedAdam(good, master_weights="remainder")
    with pytest.raises(ValueError, match="param group 1 param 0 is"):
        opt.add_param_group({"params": [other]})
    assert len(opt.param_groups) == 1
    # A param cast after construction: the step refuses before writing anything.
    good[0].grad = torch.randn(5, generator=gen).bfloat16()
    opt.step()
    before = snapshot([good[0], opt.state[good[0]][_lean.REMAINDER], opt.param_groups[0]["step"]])
    data, grad = good[0].data, good[0].grad
    good[0].data, good[0].grad = data.to(bad), grad.to(bad)
    with pytest.raises(ValueError, match=f"param group 0 param 0 is {bad}"):
        opt.step()
    good[0].data, good[0].grad = data, grad
    assert_unchanged(before, [good[0], opt.state[good[0]][_lean.REMAINDER], opt.param_groups[0]["step"]])


def test_bad_master_weights_values_are_refused():
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="invalid master_weights 'rest'; expected True, False or 'remainder'"):
        mixprec.optimizers.FusedSGD([p], lr=0.1, master_weights="rest")
    opt = mixprec.optimizers.FusedSGD([p], lr=0.1, master_weights=True)
    with pytest.raises(ValueError, match="invalid master_weights"):
        opt.master_weights = "remainders"
    assert opt.master_weights is True


def test_op_refuses_a_remainder_beside_a_non_bf16_param_and_changes_nothing(gen):
    ps = [torch.randn(9, generator=gen).bfloat16(), torch.randn(9, generator=gen).half()]
    grads = [torch.randn(9, generator=gen).to(p.dtype) for p in ps]
    ms = [torch.zeros(9, dtype=torch.int16) for _ in ps]
    avg, sq = [torch.zeros(9) for _ in ps], [torch.zeros(9) for _ in ps]
    before = snapshot(ps + grads + ms + avg + sq)
    for validate_only in (True, False):
        with pytest.raises(TypeError, match=r"mixprec::adam_: master_params\[1\] is an int16 remainder, which "
                                            r"needs a bfloat16 param; params\[1\] is Half"):
            mixprec.adam_(ps, grads, avg, sq, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, master_params=ms,
                              step=1, validate_only=validate_only)
        with pytest.raises(TypeError, match=r"master_params\[0\] has dtype Int; expected float32"):
            mixprec.adam_(ps[:1], grads[:1], avg[:1], sq[:1], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              master_params=[torch.zeros(9, dtype=torch.int32)], step=1, validate_only=validate_only)
    assert_unchanged(before, ps + grads + ms + avg + sq)


def test_op_steps_fp32_masters_and_remainders_in_one_call(gen):
    # A loaded fp32 master beside remainders (one call, two groups of kernels): both are exact.
    p32 = [torch.randn(700, generator=gen) for _ in range(2)]
    ps = [m.bfloat16() for m in p32]
    weight, remainder = _lean.split(p32[1])
    ps[1] = weight.clone()
    masters = [p32[0].clone(), remainder.clone()]
    g = [torch.randn(700, generator=gen).bfloat16() for _ in range(2)]
    ref = [m.clone() for m in p32]
    mixprec.sgd_([p.bfloat16() for p in ref], [x.clone() for x in g], [], lr=0.5, momentum=0.0, dampening=0.0,
                     weight_decay=0.0, master_params=ref, step=1)
    mixprec.sgd_(ps, [x.clone() for x in g], [], lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0,
                     master_params=masters, step=1)
    assert_bitwise_equal(masters[0], ref[0], "fp32 master")
    assert_bitwise_equal(_lean.rebuild(ps[1], masters[1]), ref[1], "remainder master")
    assert_bitwise_equal(ps[0], rne_bf16(ref[0]), "rounded copy")
    assert_bitwise_equal(ps[1], _lean.split(ref[1])[0], "remainder's weight")


# ---- amp: O2 with bf16 weights and remainder masters --------------------------------------------

def test_amp_o2_keeps_remainders_split_from_the_fp32_weights(gen):
    from mixprec import amp
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
    originals = [p.detach().clone() for p in model.parameters()]
    opt = mixprec.optimizers.FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                                master_weights="remainder", verbosity=0)
    params = list(model.parameters())
    assert opt.master_weights == "remainder"
    # The masters are the fp32 weights from before the cast, bit for bit, in 2 bytes each.
    for p, original in zip(params, originals):
        assert p.dtype == torch.bfloat16 and set(opt.state[p]) >= {_lean.REMAINDER}
        assert "master_param" not in opt.state[p]
        assert_bitwise_equal(_lean.rebuild(p, opt.state[p][_lean.REMAINDER]), original, "master")
    # Steps through amp's loss scaling, against a plain fp32-master optimizer with the same masters.
    ref_params = clones(params)
    reference = mixprec.optimizers.FusedAdam(ref_params, lr=1e-2, master_weights=True)
    for p, original in zip(ref_params, originals):
        reference._init_param_state(p, reference.param_groups[0])
        reference.state[p]["master_param"].copy_(original)
    x = torch.randn(5, 9, generator=gen).bfloat16()
    for step in range(4):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        for p, r in zip(params, ref_params):
            r.grad = p.grad.clone()  # the unscaled grads amp's step hands to the kernel
        opt.step()
        reference.step()
        assert_same_masters(masters_and_weights(reference, ref_params), masters_and_weights(opt, params),
                            f"amp step {step}")


def test_amp_refuses_remainders_it_cannot_keep():
    from mixprec import amp
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="master_weights='remainder' needs cast_model_type=torch.bfloat16"):
        amp.initialize(model, mixprec.optimizers.FusedAdam(model.parameters()), opt_level="O2",
                       master_weights="remainder", verbosity=0)
    assert model.weight.dtype == torch.float32  # refused before the cast
    with pytest.raises(ValueError, match="needs mixprec fused optimizers; optimizer 0 is SGD"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                       cast_model_type=torch.bfloat16, master_weights="remainder", verbosity=0)
    assert model.weight.dtype == torch.float32


@pytest.mark.parametrize("corrupt", ["dtype", "shape"])
def test_corrupt_remainders_are_refused_and_loading_changes_nothing(corrupt, gen):
    params = make_params(gen, "cpu", [(6,), (4,)])
    opt = FAMILIES["adam"](params, "remainder")
    step_all((opt,), set_grads(gen, 0, (params,), "cpu", False), False, "cpu")
    saved = opt.state_dict()
    bad = saved["state"][1][_lean.REMAINDER]
    saved["state"][1][_lean.REMAINDER] = bad.float() if corrupt == "dtype" else bad[:2]
    before = snapshot([opt.state[p][_lean.REMAINDER] for p in params] + params)
    expected = "expected an int16 tensor" if corrupt == "dtype" else r"has shape \(2,\); expected the parameter's \(4,\)"
    with pytest.raises(ValueError, match=r"FusedAdam.load_state_dict: state\[1\]\['master_remainder'\] .*" + expected):
        opt.load_state_dict(saved)
    assert_unchanged(before, [opt.state[p][_lean.REMAINDER] for p in params] + params)
