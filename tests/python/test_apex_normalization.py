# Tests of mixprec's apex.normalization (mixprec.apex_compat.normalization): FusedLayerNorm,
# FusedRMSNorm, their Mixed* forms and functional forms against float64 torch references (values
# and autograd gradients), Apex's dtype rules, parameters and state_dict keys, errors.
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bitwise_equal, assert_rel_err, peer_bound, random_tensor
from mixprec.apex_compat import normalization as N


def ref_norm(rms, x, shape, w, b, eps):
    """torch's float64 LayerNorm / RMSNorm, differentiable in x, w, b."""
    if rms:
        return F.rms_norm(x, shape, w, eps)
    return F.layer_norm(x, shape, w, b, eps)


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


CASES = [((6, 33), (33,)), ((2, 3, 4, 6), (4, 6)), ((5, 1024), 1024)]


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,normalized", CASES)
def test_module_vs_float64_values_and_grads(device, gen, rms, dtype, shape, normalized):
    cls = N.FusedRMSNorm if rms else N.FusedLayerNorm
    m = cls(normalized, eps=1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():  # random parameters, not the ones/zeros of a fresh module
        for p in m.parameters():
            p.copy_(random_tensor(p.shape, dtype, device, gen))
    x = random_tensor(shape, dtype, device, gen)
    (xi,) = leaves(x)
    out = m(xi)
    assert out.dtype == dtype and out.shape == x.shape
    ns = list(m.normalized_shape)
    x64, w64, b64 = leaves(x.double(), m.weight.double(), None if rms else m.bias.double())
    ref = ref_norm(rms, x64, ns, w64, b64, 1e-5)
    peer = ref_norm(rms, x, ns, m.weight.detach(), None if rms else m.bias.detach(), 1e-5)
    assert_rel_err(out, ref, peer_bound(dtype, peer, ref), "output")
    dy = random_tensor(shape, dtype, device, gen)
    out.backward(dy)
    ref.backward(dy.double())
    bound = {torch.float32: 1e-5}.get(dtype, 1e-2)
    assert_rel_err(xi.grad, x64.grad, bound, "grad input")
    assert_rel_err(m.weight.grad, w64.grad, bound, "grad weight")
    if not rms:
        assert_rel_err(m.bias.grad, b64.grad, bound, "grad bias")


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("in_dtype,param_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.float16)])
def test_mixed_output_takes_the_parameters_dtype(device, gen, rms, in_dtype, param_dtype):
    cls = N.MixedFusedRMSNorm if rms else N.MixedFusedLayerNorm
    m = cls(48).to(device=device, dtype=param_dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(random_tensor(p.shape, param_dtype, device, gen))
    x = random_tensor((7, 48), in_dtype, device, gen)
    (xi,) = leaves(x)
    out = m(xi)
    assert out.dtype == param_dtype
    x64, w64, b64 = leaves(x.double(), m.weight.double(), None if rms else m.bias.double())
    ref = ref_norm(rms, x64, [48], w64, b64, 1e-5)
    # Computed in the wider dtype and rounded once into the parameters' dtype.
    tol = 1e-5 if param_dtype == torch.float32 else 2 * torch.finfo(param_dtype).eps
    assert_rel_err(out, ref, tol, "output")
    out.float().sum().backward()
    ref.sum().backward()
    assert xi.grad.dtype == in_dtype and m.weight.grad.dtype == param_dtype
    assert_rel_err(m.weight.grad, w64.grad, 1e-2, "grad weight")
    assert_rel_err(xi.grad, x64.grad, 1e-2, "grad input")


def test_functional_forms_have_apex_signatures_and_eps(gen):
    x = random_tensor((4, 10), torch.float32, "cpu", gen)
    w, b = random_tensor(10, torch.float32, "cpu", gen), random_tensor(10, torch.float32, "cpu", gen)
    x64, w64, b64 = x.double(), w.double(), b.double()
    cases = [
        (N.fused_layer_norm(x, [10]), F.layer_norm(x64, [10], eps=1e-6)),
        (N.fused_layer_norm_affine(x, w, b, [10]), F.layer_norm(x64, [10], w64, b64, 1e-6)),
        (N.mixed_dtype_fused_layer_norm_affine(x, w, b, [10], eps=1e-3), F.layer_norm(x64, [10], w64, b64, 1e-3)),
        (N.fused_rms_norm(x, 10), F.rms_norm(x64, [10], eps=1e-6)),
        (N.fused_rms_norm_affine(x, w, [10]), F.rms_norm(x64, [10], w64, 1e-6)),
        (N.mixed_dtype_fused_rms_norm_affine(x, w, (10,), 1e-3, True), F.rms_norm(x64, [10], w64, 1e-3)),
    ]
    for i, (out, ref) in enumerate(cases):
        assert_rel_err(out, ref, 1e-5, f"functional form {i}")
    # eps matters: a large eps must show (so the defaults above were really 1e-6).
    assert not torch.allclose(N.fused_layer_norm(x * 1e-3, [10], eps=1e-2), N.fused_layer_norm(x * 1e-3, [10]))


@pytest.mark.parametrize("cls", [N.FusedLayerNorm, N.FusedRMSNorm])
def test_memory_efficient_changes_nothing(gen, cls):
    x = random_tensor((8, 40), torch.float16, "cpu", gen)
    outs = []
    for mem in (False, True):
        m = cls(40, memory_efficient=mem).half()
        (xi,) = leaves(x)
        y = m(xi)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, m.weight.grad))
    for a, b in zip(*outs):
        assert_bitwise_equal(a, b, "memory_efficient")


def test_parameters_and_state_dict_keys_are_apexs():
    ln, rms = N.FusedLayerNorm([3, 4]), N.FusedRMSNorm(5, eps=1e-6)
    assert list(ln.state_dict()) == ["weight", "bias"] and list(rms.state_dict()) == ["weight"]
    assert ln.normalized_shape == torch.Size([3, 4]) and rms.normalized_shape == torch.Size([5])
    assert torch.equal(ln.weight, torch.ones(3, 4)) and torch.equal(ln.bias, torch.zeros(3, 4))
    assert N.FusedLayerNorm(4, elementwise_affine=False).weight is None
    assert list(N.FusedRMSNorm(4, elementwise_affine=False).state_dict()) == []
    assert "eps=1e-06, elementwise_affine=True" in repr(rms)
    other = N.FusedLayerNorm([3, 4])
    sd = {k: torch.randn_like(v) for k, v in ln.state_dict().items()}
    other.load_state_dict(sd)
    assert all(torch.equal(other.state_dict()[k], sd[k]) for k in sd)
    assert not isinstance(rms, N.FusedLayerNorm) and isinstance(N.MixedFusedLayerNorm(3), N.FusedLayerNorm)
    assert isinstance(N.MixedFusedRMSNorm(3), N.FusedRMSNorm)


def test_mixed_forms_take_elementwise_affine_only_as_true():
    with pytest.warns(UserWarning, match="does not support `elementwise_affine` argument"):
        assert N.MixedFusedLayerNorm(4, elementwise_affine=True).weight is not None
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="MixedFusedRMSNorm does not support"):
        N.MixedFusedRMSNorm(4, elementwise_affine=False)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"FusedLayerNorm: invalid eps -1\.0; expected a finite number >= 0"):
        N.FusedLayerNorm(4, eps=-1.0)
    with pytest.raises(ValueError, match="FusedRMSNorm: invalid normalized_shape 0"):
        N.FusedRMSNorm(0)
    with pytest.raises(ValueError, match="fused_rms_norm: invalid eps nan"):
        N.fused_rms_norm(torch.ones(2, 3), [3], math.nan)
    m = N.FusedLayerNorm(4)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match="FusedLayerNorm: mixprec::layer_norm: input has shape"):
        m(torch.ones(2, 5))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    with pytest.raises(AttributeError, match="FusedLayerNormAffineFunction is not provided"):
        getattr(N, "FusedLayerNormAffineFunction")


@pytest.mark.cuda
def test_cuda_autocast_casts_like_apex(gen):
    m = N.FusedLayerNorm(64).cuda()
    x = random_tensor((4, 64), torch.float32, "cuda", gen)
    with torch.autocast("cuda", dtype=torch.float16):
        y = m(x)
    assert y.dtype == torch.float16  # Apex casts input and params to the autocast dtype
    assert_rel_err(y, F.layer_norm(x.double(), [64]), 2e-3, "autocast output")
