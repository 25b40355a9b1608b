# The fifth misuse probe (issue 20), part 4: Apex's surfaces on mixprec (LARC, amp_C through
# multi_tensor_applier, apex.normalization) and the integrations' helpers, misused: every refusal
# names the call and argument and changes nothing; everything else computes what Apex computes.
from __future__ import annotations

import copy

import pytest
import torch

from amp_support import amp_world, assert_same_world
from conftest import assert_bitwise_equal, random_tensor
from test_misuse_probe4 import refused
from mixprec.apex_compat import amp_c
from mixprec.apex_compat.larc import LARC
from mixprec.apex_compat.multi_tensor_apply import multi_tensor_applier
from mixprec.apex_compat.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from mixprec.optimizers import FusedSGD


def params_with_grads(gen, dtype=torch.float32, shapes=((4, 3), (5,))):
    ps = [torch.nn.Parameter(random_tensor(s, dtype, "cpu", gen)) for s in shapes]
    for p in ps:
        p.grad = random_tensor(p.shape, dtype, "cpu", gen)
    return ps


# ---- LARC ---------------------------------------------------------------------------------------

def larc_reference(ps, lr, wd, trust, eps):
    """Apex's LARC step around SGD (no momentum), in float64: the expected new weights."""
    out = []
    for p in ps:
        w, g = p.detach().double(), p.grad.double()
        wn, gn = w.norm(), g.norm()
        adaptive = min(float(trust * wn / (gn + wn * wd + eps)) / lr, 1.0)
        out.append(w - lr * (g + wd * w) * adaptive)
    return out


def test_larc_takes_float64_params_as_apex_does(gen):
    """LARC's norms of float64 tensors raised torch's "convertible without narrowing" error."""
    ps = params_with_grads(gen, torch.float64)
    expected = larc_reference(ps, 0.1, 0.01, 0.02, 1e-8)
    LARC(torch.optim.SGD(ps, lr=0.1, weight_decay=0.01)).step()
    for p, e in zip(ps, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("break_it, exc, pattern", [
    (lambda ps, larc: larc.param_groups[0].update(lr=float("nan")), ValueError, r"FusedSGD: param group 0: invalid lr nan"),
    (lambda ps, larc: setattr(ps[1].grad, "data", ps[1].grad.data.double()), TypeError, r"grads\[1\] has dtype Double"),
], ids=["nan_lr", "float64_grad"])
def test_a_step_the_inner_optimizer_refuses_leaves_the_gradients_as_they_were(break_it, exc, pattern, gen):
    """The gradients were rescaled before the inner step refused: a retry rescaled them again."""
    ps = params_with_grads(gen)
    larc = LARC(FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01), clip=False)
    larc.step()
    for p in ps:
        p.grad = random_tensor(p.shape, torch.float32, "cpu", gen)
    break_it(ps, larc)
    refused(larc.step, [larc.optim], exc, pattern)


def test_a_negative_trust_coefficient_set_after_construction_steps_as_apexs(gen):
    """Peer-equal (silent in Apex too): the constructor checks trust_coefficient, the attribute
    is read as it is at each step, and a negative one reverses the update, as Apex's LARC does."""
    ps = params_with_grads(gen)
    larc = LARC(torch.optim.SGD(ps, lr=0.1), clip=False)
    larc.trust_coefficient = -0.02
    expected = []
    for p in ps:
        w, g = p.detach().double(), p.grad.double()
        expected.append(w - 0.1 * g * float(-0.02 * w.norm() / (g.norm() + 1e-8)))
    larc.step()
    for p, e in zip(ps, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-6, atol=1e-6)


# ---- amp_C through multi_tensor_applier -----------------------------------------------------------

def flag():
    return torch.zeros(1, dtype=torch.int32)


def lists(gen, n, shapes=((5,), (7,))):
    return [[random_tensor(s, torch.float32, "cpu", gen) for s in shapes] for _ in range(n)]


def test_sgd_with_a_zero_scale_steps_with_zero_gradients_as_apex(gen):
    """Apex multiplies the gradients by `scale`; mixprec divides by its reciprocal, which for 0
    raised a bare ZeroDivisionError."""
    g, p, m = lists(gen, 3)
    g[0][1] = float("inf")  # inf * 0 is NaN in Apex's kernel
    before = [t.clone() for t in g]
    new_p = [t.clone() for t in p]
    multi_tensor_applier(amp_c.multi_tensor_sgd, flag(), [g, new_p, m], 0.01, 0.0, 0.0, 0.1, False, True, False, 0.0)
    for w, w0 in zip(new_p, p):
        expected = w0 - 0.1 * 0.01 * w0
        expected = expected if w is not new_p[0] else torch.where(torch.arange(5) == 1, float("nan"), expected)
        torch.testing.assert_close(w, expected, equal_nan=True)
    for a, b in zip(g, before):
        assert_bitwise_equal(a, b)  # Apex leaves the gradients alone


def _l2norm_str(g, p, m, f):
    multi_tensor_applier(amp_c.multi_tensor_l2norm, f, [g], "False")


def _lamb_float_norm(g, p, m, f):
    multi_tensor_applier(amp_c.multi_tensor_lamb, f, [g, p, m, [t.clone() for t in m]], 1e-3, 0.9, 0.999, 1e-6, 1, 1,
                         0.01, 1, 1, 3.0, 1.0)


def _novograd_list_norms(g, p, m, f):
    multi_tensor_applier(amp_c.multi_tensor_novograd, f, [g, p, m], [0.0, 0.0], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1,
                         0, 2)


AMP_C_NAMED = {
    # A string flag read as true (per-tensor norms returned where the caller asked for none).
    "l2norm_per_tensor_string": (_l2norm_str, TypeError, r"amp_C.multi_tensor_l2norm: invalid per_tensor 'False'"),
    # Both raised the dispatcher's schema dump, the second naming mixprec's internal argument.
    "lamb_norm_as_number": (_lamb_float_norm, TypeError, r"amp_C.multi_tensor_lamb: invalid global_grad_norm 3.0"),
    "novograd_norms_as_list": (_novograd_list_norms, TypeError,
                               r"amp_C.multi_tensor_novograd: invalid grad_norms \[0.0, 0.0\]"),
}


@pytest.mark.parametrize("case", list(AMP_C_NAMED))
def test_amp_c_arguments_of_the_wrong_kind_are_named_and_change_nothing(case, gen):
    call, exc, pattern = AMP_C_NAMED[case]
    g, p, m = lists(gen, 3)
    m = [torch.zeros_like(t) for t in m]
    f = flag()
    refused(lambda: call(g, p, m, f), [g, p, m, f], exc, pattern)


def test_axpby_with_a_nan_coefficient_flags_nothing_as_apex(gen):
    """Peer-equal: Apex's axpby checks its inputs, not the result, so a NaN coefficient writes NaN
    with the flag clear."""
    x, y = lists(gen, 2)
    out = [torch.empty_like(t) for t in x]
    f = flag()
    multi_tensor_applier(amp_c.multi_tensor_axpby, f, [x, y, out], float("nan"), 1.0, -1)
    assert int(f) == 0 and all(bool(t.isnan().all()) for t in out)


# ---- apex.normalization ----------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_an_integer_input_is_refused_by_name(cls, dtype):
    """It was promoted to the weight's dtype, normalized, and cast back: truncated integers
    (mostly zeros) out, silently. Apex's kernels refuse it."""
    module = cls(8)
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(TypeError, match=rf"{cls.__name__}: input has dtype {dtype}; expected a floating-point tensor"):
        module(torch.ones(2, 8, dtype=dtype))
    for k, v in module.state_dict().items():
        assert_bitwise_equal(v, before[k])


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_a_float64_input_and_module_match_torch(cls, gen):
    module = cls(8).double()
    x = random_tensor((3, 8), torch.float64, "cpu", gen)
    if cls is FusedLayerNorm:
        expected = torch.nn.functional.layer_norm(x, (8,), module.weight, module.bias, module.eps)
    else:
        expected = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + module.eps) * module.weight
    torch.testing.assert_close(module(x), expected, rtol=1e-12, atol=1e-12)


def test_an_eps_set_negative_after_construction_is_refused_at_the_forward():
    module = FusedLayerNorm(8)
    module.eps = -1.0
    with pytest.raises(ValueError, match=r"FusedLayerNorm: invalid eps -1.0; expected a finite number >= 0"):
        module(torch.ones(2, 8))


# ---- integrations: the session every plugin (Lightning, Fabric, the HF Trainer) runs on ------------
# (test_integrations_accelerate.py covers accelerate's helpers; Lightning is not importable everywhere,
# and AmpSession is the part of its plugin that decides these refusals.)

@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(loss_scale=float("nan")), ValueError, "loss_scale must be None"),
    (dict(loss_scale=True), ValueError, "loss_scale must be None"),
    (dict(loss_scale=0.0), ValueError, "loss_scale must be None"),
    (dict(dtype=torch.float32), ValueError, "dtype must be torch.float16 or torch.bfloat16"),
    (dict(opt_level="o2"), ValueError, "opt_level must be one of"),
    (dict(num_losses=2), TypeError, r"unexpected keyword argument\(s\) \['num_losses'\]"),
], ids=["nan_scale", "bool_scale", "zero_scale", "fp32", "lowercase_level", "unknown_keyword"])
def test_a_session_refuses_bad_options_when_built(kwargs, exc, pattern):
    from mixprec.integrations._session import AmpSession

    with pytest.raises(exc, match=rf"Plugin: {pattern}"):
        AmpSession("Plugin", **kwargs)


def session_with_model(gen):
    from mixprec.integrations._session import AmpSession

    session = AmpSession("Plugin", opt_level="O2", verbosity=0)
    model = torch.nn.Linear(4, 2)
    opt = FusedSGD(model.parameters(), lr=0.1)
    session.initialize(model, [opt])
    loss = model(random_tensor((3, 4), torch.float32, "cpu", gen)).float().sum()
    return session, model, opt, loss


def test_a_session_refuses_to_scale_after_amp_was_initialized_elsewhere(gen):
    session, model, opt, loss = session_with_model(gen)
    other = torch.nn.Linear(4, 2)
    from mixprec import amp

    amp.initialize(other, FusedSGD(other.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    before = amp_world([model, other], [opt])
    with pytest.raises(RuntimeError, match=r"Plugin.backward: amp.initialize was called again elsewhere"):
        session.backward(loss, opt, lambda scaled: scaled.backward())
    assert_same_world(before, amp_world([model, other], [opt]))


def test_a_session_refuses_an_optimizer_it_did_not_initialize_and_a_second_model(gen):
    session, model, opt, loss = session_with_model(gen)
    stranger = torch.optim.SGD(model.parameters(), lr=0.1)
    before = amp_world([model], [opt])
    with pytest.raises(RuntimeError, match=r"Plugin.backward: optimizer SGD did not go through this plugin's "
                                           "amp.initialize"):
        session.backward(loss, stranger, lambda scaled: scaled.backward())
    second = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match=r"Plugin: this plugin already initialized amp for Linear"):
        session.initialize(second, [torch.optim.SGD(second.parameters(), lr=0.1)])
    assert_same_world(before, amp_world([model], [opt]))
    assert second.weight.dtype == torch.float32
