# Tests of mixprec.fp8's Linear: outputs and gradients against float64 references within bounds
# derived from the FP8 unit roundoff, exact agreement with a float64 model of the same casts,
# scaling state (current, delayed, state_dict round-trips), eligibility and inf/NaN propagation.
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from conftest import inject_non_finite, random_tensor, rel_err

from mixprec import fp8

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
#: Unit roundoff (half an ulp at 1) of each format: 3 and 2 mantissa bits; and of the bf16 output.
U = {E4: 2.0 ** -4, E5: 2.0 ** -3}
U_BF16 = 2.0 ** -8


def quantized64(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 model of current scaling: scale = fp8_max / amax (in fp32, as the device computes
    it), t * scale cast by torch's own conversion, then divided by the scale again."""
    t = t.detach().cpu().float()
    scale = torch.tensor(fp8.FP8_MAX[dtype], dtype=torch.float32) / t.abs().max()
    q = (t * scale).clamp(-fp8.FP8_MAX[dtype], fp8.FP8_MAX[dtype]).to(dtype)
    return q.double() / scale.double()


def scaled_cast64(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    s = scale.detach().cpu().float()
    m = fp8.FP8_MAX[dtype]
    return (t.detach().cpu().float() * s).clamp(-m, m).to(dtype).double() / s.double()


def cancellation_bound(a: torch.Tensor, b: torch.Tensor, u: float) -> float:
    """The norm-wise bound of a product of two operands each rounded with unit roundoff u (each
    element's error is at most (2u + u^2) sum |a||b|), relative to the exact product's norm."""
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    return (2 * u + u * u) * float(torch.linalg.norm(a64.abs() @ b64.abs())) / float(torch.linalg.norm(a64 @ b64))


def make(device, dtype, gen, in_f=64, out_f=48, bias=True, recipe=None):
    layer = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(random_tensor(layer.weight.shape, torch.float32, "cpu", gen, 0.1))
        if bias:
            layer.bias.copy_(random_tensor(layer.bias.shape, torch.float32, "cpu", gen, 0.1))
    layer = layer.to(device=device, dtype=dtype)
    return fp8.Fp8Linear.from_linear(layer, recipe)


@pytest.mark.parametrize("recipe", (fp8.Fp8Recipe(), fp8.Fp8Recipe.e4m3()), ids=("hybrid", "e4m3"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_outputs_and_grads_against_float64(device, recipe, dtype, gen):
    layer = make(device, dtype, gen, recipe=recipe)
    x = random_tensor((2, 40, 64), dtype, device, gen).requires_grad_()
    dy = random_tensor((2, 40, 48), dtype, device, gen, 1e-3)
    y = layer(x)
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and layer.weight.grad.dtype == dtype
    x64, w64, b64 = (t.detach().cpu().double() for t in (x.reshape(-1, 64), layer.weight, layer.bias))
    dy64 = dy.cpu().double().reshape(-1, 48)
    fwd, bwd = recipe.forward_dtype, recipe.backward_dtype
    out_u = U_BF16 if dtype == torch.bfloat16 else 1e-6
    # 1. Within the bound FP8 rounding allows, against the exact float64 result...
    checks = (("y", y.reshape(-1, 48), x64 @ w64.t() + b64, cancellation_bound(x64, w64.t(), U[fwd])),
              ("dx", x.grad.reshape(-1, 64), dy64 @ w64, cancellation_bound(dy64, w64, max(U[fwd], U[bwd]))),
              ("dw", layer.weight.grad, dy64.t() @ x64, cancellation_bound(dy64.t(), x64, max(U[fwd], U[bwd]))))
    for name, got, exact, bound in checks:
        err = rel_err(got, exact)
        assert err < bound + 2 * out_u, f"{name}: {err:.3e} >= {bound:.3e}"
        # ...and really through FP8: more error than the output dtype alone makes.
        assert err > 2 * out_u / 8, f"{name}: error {err:.1e} is too small for FP8 operands"
    # 2. Equal, up to fp32 accumulation and the output rounding, to float64 on the same casts.
    qx, qw, qdy = quantized64(x64, fwd), quantized64(w64, fwd), quantized64(dy64, bwd)
    for name, got, model in (("y", y.reshape(-1, 48), qx @ qw.t() + b64), ("dx", x.grad.reshape(-1, 64), qdy @ qw),
                             ("dw", layer.weight.grad, qdy.t() @ qx)):
        assert rel_err(got, model) < out_u + 1e-5, f"{name} differs from the float64 model of its casts"
    assert torch.allclose(layer.bias.grad.cpu().double(), dy64.sum(0), rtol=out_u, atol=1e-6)


def test_cpu_emulation_matches_torch_scaled_mm(gen):
    a = random_tensor((32, 64), torch.float32, "cpu", gen).to(E4)
    b = random_tensor((48, 64), torch.float32, "cpu", gen).to(E4).t()
    sa, sb = torch.tensor([0.37]), torch.tensor([2.5])
    emulated = fp8.scaled_mm(a, b, sa, sb, torch.float32, emulate=True)
    try:
        peer = fp8.scaled_mm(a, b, sa, sb, torch.float32, emulate=False)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU _scaled_mm for FP8: {e}")
    exact = (a.double() @ b.double()) * 0.37 * 2.5
    assert rel_err(emulated, exact) < 1e-6 and rel_err(peer, exact) < 1e-6


def test_delayed_scaling_follows_its_history(device, gen):
    recipe = fp8.Fp8Recipe(scaling="delayed", amax_history_len=3)
    layer = make(device, torch.bfloat16, gen, bias=False, recipe=recipe)
    st = layer.fp8_state
    amaxes = []
    for step, mag in enumerate((1.0, 8.0, 0.5, 0.25, 0.25)):
        x = random_tensor((16, 64), torch.bfloat16, device, gen, mag)
        expected_scale = (448.0 / max(amaxes[-3:]) if amaxes else 1.0)
        with torch.no_grad():
            y = layer(x)
        assert st.scale[0].item() == pytest.approx(expected_scale, rel=1e-6), f"step {step}"
        # The casts used the scales of the history: the model of the casts with them gives y.
        qx, qw = (scaled_cast64(t, st.scale[i], E4) for i, t in enumerate((x, layer.weight)))
        assert rel_err(y, qx @ qw.t()) < 2 * U_BF16, f"step {step}"
        amaxes.append(x.float().abs().max().item())
        assert st.amax[0].item() == amaxes[-1]


@pytest.mark.parametrize("value", (math.inf, math.nan))
@pytest.mark.parametrize("where", ("first", "random"))
def test_non_finite_inputs_and_grads_are_never_hidden(device, value, where, gen):
    for recipe in (fp8.Fp8Recipe(), fp8.Fp8Recipe(scaling="delayed")):
        layer = make(device, torch.bfloat16, gen, recipe=recipe)
        layer(random_tensor((16, 64), torch.bfloat16, device, gen))  # a finite step first
        scale_before = layer.fp8_state.scale.clone()
        x = random_tensor((16, 64), torch.float32, "cpu", gen)
        inject_non_finite(x, where, value, gen)
        y = layer(x.to(device, torch.bfloat16))
        assert not bool(y.isfinite().all()), "a saturated inf/NaN input gave a finite output"
        assert bool(layer.fp8_state.scale.isfinite().all())
        if recipe.scaling == "current":
            assert torch.equal(layer.fp8_state.scale[0], scale_before[0])  # the non-finite amax kept it
        xg = random_tensor((16, 64), torch.bfloat16, device, gen).requires_grad_()
        dy = random_tensor((16, 48), torch.float32, "cpu", gen)
        inject_non_finite(dy, where, value, gen)
        layer(xg).backward(dy.to(device, torch.bfloat16))
        assert not bool(xg.grad.isfinite().all()) and not bool(layer.weight.grad.isfinite().all())


def test_eligibility_and_fallback(device, gen):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 30), torch.nn.Linear(30, 16),
                                torch.nn.Conv1d(4, 4, 1)).to(device)
    converted, skipped = fp8.convert(model)
    assert converted == ["0"] and set(skipped) == {"1", "2"}
    assert "out_features=30" in skipped["1"] and "in_features=30" in skipped["2"]
    assert type(model[1]) is torch.nn.Linear and isinstance(model[0], fp8.Fp8Linear)
    with pytest.raises(ValueError, match=r"mixprec.fp8.Fp8Linear.from_linear: linear is not eligible.*out_features=30"):
        fp8.Fp8Linear.from_linear(model[1])
    assert type(model[1]) is torch.nn.Linear
    # 24 tokens (not a multiple of 16): plain F.linear, bit for bit, and counted.
    x = random_tensor((24, 64), torch.float32, device, gen)
    assert torch.equal(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    assert model[0].fp8_state.fallbacks == 1
    y16 = model[0](x[:16])
    assert not torch.equal(y16, torch.nn.functional.linear(x[:16], model[0].weight, model[0].bias))


def test_state_dict_round_trip_and_refusals(device, gen, tmp_path):
    recipe = fp8.Fp8Recipe(scaling="delayed", amax_history_len=4)
    a = make(device, torch.bfloat16, gen, recipe=recipe)
    for _ in range(3):
        a(random_tensor((32, 64), torch.bfloat16, device, gen)).sum().backward()
    assert "fp8_state.scale" not in a.state_dict() and list(a.parameters()) == [a.weight, a.bias]
    buf = io.BytesIO()
    torch.save(a.fp8_state.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    b = copy.deepcopy(a)
    b.fp8_state.load_state_dict({k: torch.zeros_like(v) + 1 for k, v in loaded.items()})
    b.fp8_state.load_state_dict(loaded)
    x = random_tensor((32, 64), torch.bfloat16, device, gen)
    assert torch.equal(a(x), b(x))
    for k in ("scale", "amax", "amax_history"):
        assert torch.equal(getattr(a.fp8_state, k), getattr(b.fp8_state, k))
    before = {k: v.clone() for k, v in b.fp8_state.state_dict().items()}
    bad_cases = [({**loaded, "amax_history": torch.zeros(3, 5)}, ValueError, "amax_history"),
                 ({**loaded, "scale": torch.tensor([1.0, -1.0, 1.0])}, ValueError, "scale"),
                 ({k: v for k, v in loaded.items() if k != "amax"}, KeyError, "keys"),
                 ([1, 2], TypeError, "expected a dict")]
    for bad, exc, word in bad_cases:
        with pytest.raises(exc, match=f"Fp8ScalingState.load_state_dict: state_dict.*{word}"):
            b.fp8_state.load_state_dict(bad)
        for k, v in b.fp8_state.state_dict().items():
            assert torch.equal(v, before[k]), f"a refused load changed {k}"


def test_module_casts_keep_the_state_fp32(gen):
    layer = make("cpu", torch.float32, gen)
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and layer.fp8_state.scale.dtype == torch.float32
    assert "fp8=float8_e4m3fn/float8_e5m2" in repr(layer)


def test_recipe_rejects_bad_values():
    with pytest.raises(TypeError, match="Fp8Recipe: forward_dtype"):
        fp8.Fp8Recipe(forward_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Fp8Recipe: scaling"):
        fp8.Fp8Recipe(scaling="per-row")
    with pytest.raises(ValueError, match="Fp8Recipe: amax_history_len"):
        fp8.Fp8Recipe(amax_history_len=0)
    with pytest.raises(ValueError, match="Fp8Recipe: margin"):
        fp8.Fp8Recipe(margin=-1)
    with pytest.raises(ValueError, match="Fp8Recipe: amax_reduction"):
        fp8.Fp8Recipe(amax_reduction="mean")


def test_diagnostics_report_amax_scale_and_saturated_share(device, gen):
    from mixprec import diagnostics

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)).to(device, torch.bfloat16)
    fp8.convert(model, fp8.Fp8Recipe(scaling="delayed", amax_history_len=2))
    x = random_tensor((16, 64), torch.bfloat16, device, gen)
    model(x).float().sum().backward()  # the first step casts with scale 1
    big = x * 4
    big.view(-1)[:8] = 1e4  # past what the scale from the history leaves room for, as are many of x * 4
    with diagnostics.track_saturation(model):
        model(big)
    report = diagnostics.fp8_report(model)
    assert [r.name for r in report] == ["0"]
    inp, weight, grad = report[0].tensors
    assert inp.role == "input" and inp.dtype == E4 and grad.dtype == E5
    assert inp.amax == big.float().abs().max().item() and weight.amax == model[0].weight.float().abs().max().item()
    assert inp.scale == pytest.approx(448.0 / x.float().abs().max().item(), rel=1e-6)
    expected = (big.float().abs() * inp.scale > 448).sum().item() / big.numel()
    assert expected >= 8 / big.numel() and inp.saturated_share == pytest.approx(expected)
    assert weight.saturated_share == 0.0 and grad.saturated_share is None
    text = diagnostics.format_fp8_report(report)
    assert "input" in text and "grad_output" in text and f"{100 * expected:.3f}%" in text


@pytest.mark.cuda
def test_cuda_fp8_linear_step_never_syncs(gen):
    for recipe in (fp8.Fp8Recipe(), fp8.Fp8Recipe(scaling="delayed")):
        layer = make("cuda", torch.bfloat16, gen, in_f=256, out_f=128, recipe=recipe)
        x = random_tensor((4, 64, 256), torch.bfloat16, "cuda", gen).requires_grad_()
        layer(x).sum().backward()  # warm-up: cuBLASLt workspaces, lazy inits
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x).float().pow(2).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert bool(x.grad.isfinite().all()) and bool(layer.weight.grad.isfinite().all())
