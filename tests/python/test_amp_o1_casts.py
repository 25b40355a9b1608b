# amp.init's O1 cast rules (Apex's half / float / promote lists, banned and in-place rules, Tensor
# methods and operators), each call checked in output dtype, values against float64 and gradients.
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from amp_o1_support import check_call, dtype_mixes, low, make_handle  # noqa: F401 (fixtures)
from conftest import assert_bitwise_equal, random_tensor
from mixprec import amp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # chain_matmul's deprecation


def _long(n: int, high: int, device) -> torch.Tensor:
    return (torch.arange(n) * 7 % high).to(device)


def _sign(n: int, device) -> torch.Tensor:
    return (torch.arange(n) % 2 * 2 - 1).float().to(device)


# (name, rule, input shapes, input domain, fn(device) -> callable). Domains: "any" (magnitudes
# 0.25..4, both signs), "pos", "unit" (|x| < 0.8), "prob" ([0, 1)), "small" (|x| <= 0.4).
CASES = [
    # half: the functions behind layers, and BLAS
    ("F.linear", "half", [(4, 8), (6, 8), (6,)], "any", lambda d: F.linear),
    ("F.conv1d", "half", [(2, 3, 9), (4, 3, 3)], "any", lambda d: F.conv1d),
    ("F.conv2d", "half", [(2, 3, 6, 6), (4, 3, 3, 3), (4,)], "any", lambda d: F.conv2d),
    ("F.conv3d", "half", [(1, 2, 4, 4, 4), (3, 2, 2, 2, 2)], "any", lambda d: F.conv3d),
    ("F.conv_transpose1d", "half", [(2, 3, 5), (3, 2, 3)], "any", lambda d: F.conv_transpose1d),
    ("F.conv_transpose2d", "half", [(2, 3, 4, 4), (3, 2, 3, 3)], "any", lambda d: F.conv_transpose2d),
    ("F.conv_transpose3d", "half", [(1, 2, 3, 3, 3), (2, 2, 2, 2, 2)], "any", lambda d: F.conv_transpose3d),
    ("torch.conv2d", "half", [(2, 3, 6, 6), (4, 3, 3, 3)], "any", lambda d: torch.conv2d),
    ("F.prelu", "half", [(4, 3, 5), (3,)], "any", lambda d: F.prelu),
    ("torch.matmul", "half", [(3, 4, 8), (8, 5)], "any", lambda d: torch.matmul),
    ("torch.mm", "half", [(4, 8), (8, 5)], "any", lambda d: torch.mm),
    ("torch.mv", "half", [(4, 8), (8,)], "any", lambda d: torch.mv),
    ("torch.bmm", "half", [(2, 4, 8), (2, 8, 3)], "any", lambda d: torch.bmm),
    ("torch.addmm", "half", [(4, 5), (4, 8), (8, 5)], "any", lambda d: torch.addmm),
    ("torch.addmv", "half", [(4,), (4, 8), (8,)], "any", lambda d: torch.addmv),
    ("torch.addr", "half", [(4, 5), (4,), (5,)], "any", lambda d: torch.addr),
    ("torch.baddbmm", "half", [(2, 4, 3), (2, 4, 8), (2, 8, 3)], "any", lambda d: torch.baddbmm),
    ("torch.addbmm", "half", [(4, 3), (2, 4, 8), (2, 8, 3)], "any", lambda d: torch.addbmm),
    ("torch.chain_matmul", "half", [(4, 8), (8, 5), (5, 3)], "any", lambda d: torch.chain_matmul),
    ("Tensor.matmul", "half", [(4, 8), (8, 5)], "any", lambda d: lambda x, y: x.matmul(y)),
    ("Tensor.mm", "half", [(4, 8), (8, 5)], "any", lambda d: lambda x, y: x.mm(y)),
    ("x @ y", "half", [(4, 8), (8, 5)], "any", lambda d: lambda x, y: x @ y),
    # float: point-wise, reductions, softmax, norms, losses
    ("torch.exp", "float", [(5, 7)], "any", lambda d: torch.exp),
    ("torch.log", "float", [(5, 7)], "pos", lambda d: torch.log),
    ("torch.log10", "float", [(5, 7)], "pos", lambda d: torch.log10),
    ("torch.log2", "float", [(5, 7)], "pos", lambda d: torch.log2),
    ("torch.log1p", "float", [(5, 7)], "pos", lambda d: torch.log1p),
    ("torch.expm1", "float", [(5, 7)], "any", lambda d: torch.expm1),
    ("torch.reciprocal", "float", [(5, 7)], "any", lambda d: torch.reciprocal),
    ("torch.rsqrt", "float", [(5, 7)], "pos", lambda d: torch.rsqrt),
    ("torch.erfinv", "float", [(5, 7)], "unit", lambda d: torch.erfinv),
    ("torch.acos", "float", [(5, 7)], "unit", lambda d: torch.acos),
    ("torch.asin", "float", [(5, 7)], "unit", lambda d: torch.asin),
    ("torch.cosh", "float", [(5, 7)], "any", lambda d: torch.cosh),
    ("torch.sinh", "float", [(5, 7)], "any", lambda d: torch.sinh),
    ("torch.tan", "float", [(5, 7)], "unit", lambda d: torch.tan),
    ("torch.pow", "float", [(5, 7)], "any", lambda d: lambda x: torch.pow(x, 3)),
    ("torch.pow(t, t)", "float", [(5, 7), (5, 7)], "pos", lambda d: torch.pow),
    ("torch.sum", "float", [(5, 7)], "any", lambda d: torch.sum),
    ("torch.prod", "float", [(5, 3)], "any", lambda d: lambda x: torch.prod(x, 1)),
    ("torch.cumsum", "float", [(5, 7)], "any", lambda d: lambda x: torch.cumsum(x, 1)),
    ("torch.cumprod", "float", [(5, 4)], "any", lambda d: lambda x: torch.cumprod(x, 1)),
    ("torch.norm", "float", [(5, 7)], "any", lambda d: torch.norm),
    ("torch.linalg.vector_norm", "float", [(5, 7)], "any", lambda d: torch.linalg.vector_norm),
    ("torch.dist", "float", [(5, 7), (5, 7)], "any", lambda d: torch.dist),
    ("torch.renorm", "float", [(5, 7)], "any", lambda d: lambda x: torch.renorm(x, 2, 0, 1.0)),
    ("torch.std", "float", [(5, 7)], "any", lambda d: torch.std),
    ("torch.var", "float", [(5, 7)], "any", lambda d: torch.var),
    ("torch.logsumexp", "float", [(5, 7)], "any", lambda d: lambda x: torch.logsumexp(x, 1)),
    ("F.softmax", "float", [(5, 7)], "any", lambda d: lambda x: F.softmax(x, dim=1)),
    ("F.log_softmax", "float", [(5, 7)], "any", lambda d: lambda x: F.log_softmax(x, dim=1)),
    ("F.softmin", "float", [(5, 7)], "any", lambda d: lambda x: F.softmin(x, dim=1)),
    ("F.softplus", "float", [(5, 7)], "any", lambda d: F.softplus),
    ("F.normalize", "float", [(5, 7)], "any", lambda d: F.normalize),
    ("F.cosine_similarity", "float", [(5, 7), (5, 7)], "any", lambda d: F.cosine_similarity),
    ("F.layer_norm", "float", [(4, 8), (8,), (8,)], "any", lambda d: lambda x, w, b: F.layer_norm(x, (8,), w, b)),
    ("F.group_norm", "float", [(2, 4, 5), (4,), (4,)], "any", lambda d: lambda x, w, b: F.group_norm(x, 2, w, b)),
    ("F.local_response_norm", "float", [(2, 4, 5)], "any", lambda d: lambda x: F.local_response_norm(x, 2)),
    ("F.interpolate", "float", [(2, 3, 5)], "any", lambda d: lambda x: F.interpolate(x, scale_factor=2.0,
                                                                                      mode="linear")),
    ("F.mse_loss", "float", [(6, 5), (6, 5)], "any", lambda d: F.mse_loss),
    ("F.l1_loss", "float", [(6, 5), (6, 5)], "any", lambda d: F.l1_loss),
    ("F.smooth_l1_loss", "float", [(6, 5), (6, 5)], "small", lambda d: F.smooth_l1_loss),
    ("F.huber_loss", "float", [(6, 5), (6, 5)], "any", lambda d: F.huber_loss),
    ("F.kl_div", "float", [(6, 5), (6, 5)], "pos", lambda d: lambda x, t: F.kl_div(x, t, reduction="batchmean")),
    ("F.nll_loss", "float", [(6, 5)], "any", lambda d: lambda x: F.nll_loss(x, _long(6, 5, d))),
    ("F.cross_entropy", "float", [(6, 5)], "any", lambda d: lambda x: F.cross_entropy(x, _long(6, 5, d))),
    ("F.multi_margin_loss", "float", [(6, 5)], "any", lambda d: lambda x: F.multi_margin_loss(x, _long(6, 5, d))),
    ("F.binary_cross_entropy_with_logits", "float", [(6, 5), (6, 5)], "prob",
     lambda d: F.binary_cross_entropy_with_logits),
    ("F.poisson_nll_loss", "float", [(6, 5), (6, 5)], "pos", lambda d: F.poisson_nll_loss),
    ("F.soft_margin_loss", "float", [(6,)], "any", lambda d: lambda x: F.soft_margin_loss(x, _sign(6, d))),
    ("F.hinge_embedding_loss", "float", [(6,)], "any", lambda d: lambda x: F.hinge_embedding_loss(x, _sign(6, d))),
    ("F.margin_ranking_loss", "float", [(6,), (6,)], "any",
     lambda d: lambda x, y: F.margin_ranking_loss(x, y, _sign(6, d))),
    ("F.cosine_embedding_loss", "float", [(6, 4), (6, 4)], "any",
     lambda d: lambda x, y: F.cosine_embedding_loss(x, y, _sign(6, d))),
    ("F.triplet_margin_loss", "float", [(6, 4), (6, 4), (6, 4)], "any", lambda d: F.triplet_margin_loss),
    ("F.multilabel_soft_margin_loss", "float", [(6, 5), (6, 5)], "prob", lambda d: F.multilabel_soft_margin_loss),
    ("Tensor.pow", "float", [(5, 7)], "any", lambda d: lambda x: x.pow(2.0)),
    ("x ** 2", "float", [(5, 7)], "any", lambda d: lambda x: x ** 2),
    ("2 ** x", "float", [(5, 7)], "small", lambda d: lambda x: 2 ** x),
    ("Tensor.sum", "float", [(5, 7)], "any", lambda d: lambda x: x.sum()),
    ("Tensor.softmax", "float", [(5, 7)], "any", lambda d: lambda x: x.softmax(1)),
    ("Tensor.log_softmax", "float", [(5, 7)], "any", lambda d: lambda x: x.log_softmax(1)),
    ("Tensor.exp", "float", [(5, 7)], "any", lambda d: lambda x: x.exp()),
    ("Tensor.norm", "float", [(5, 7)], "any", lambda d: lambda x: x.norm()),
    ("Tensor.cumsum", "float", [(5, 7)], "any", lambda d: lambda x: x.cumsum(0)),
    # promote: mixed inputs run in the widest type
    ("torch.add", "promote", [(5, 7), (5, 7)], "any", lambda d: torch.add),
    ("torch.sub", "promote", [(5, 7), (5, 7)], "any", lambda d: torch.sub),
    ("torch.mul", "promote", [(5, 7), (5, 7)], "any", lambda d: torch.mul),
    ("torch.div", "promote", [(5, 7), (5, 7)], "any", lambda d: torch.div),
    ("torch.atan2", "promote", [(5, 7), (5, 7)], "any", lambda d: torch.atan2),
    ("torch.addcmul", "promote", [(5, 7), (5, 7), (5, 7)], "any", lambda d: torch.addcmul),
    ("torch.addcdiv", "promote", [(5, 7), (5, 7), (5, 7)], "any", lambda d: torch.addcdiv),
    ("torch.cross", "promote", [(4, 3), (4, 3)], "any", lambda d: lambda x, y: torch.cross(x, y, dim=1)),
    ("torch.dot", "promote", [(9,), (9,)], "any", lambda d: torch.dot),
    ("torch.bilinear", "promote", [(4, 3), (4, 5), (2, 3, 5)], "any", lambda d: torch.bilinear),
    ("F.bilinear", "promote", [(4, 3), (4, 5), (2, 3, 5)], "any", lambda d: F.bilinear),
    ("torch.maximum", "promote", [(5, 7), (5, 7)], "any", lambda d: torch.maximum),
    ("torch.index_put", "promote", [(6, 3), (2, 3)], "any",
     lambda d: lambda x, v: torch.index_put(x, (torch.tensor([1, 4], device=d),), v)),
    ("torch.cat", "promote", [(3, 4), (2, 4), (1, 4)], "any", lambda d: lambda *xs: torch.cat(xs)),
    ("torch.stack", "promote", [(3, 4), (3, 4), (3, 4)], "any", lambda d: lambda *xs: torch.stack(list(xs))),
    ("x + y", "promote", [(5, 7), (5, 7)], "any", lambda d: lambda x, y: x + y),
    ("x - y", "promote", [(5, 7), (5, 7)], "any", lambda d: lambda x, y: x - y),
    ("x * y", "promote", [(5, 7), (5, 7)], "any", lambda d: lambda x, y: x * y),
    ("x / y", "promote", [(5, 7), (5, 7)], "any", lambda d: lambda x, y: x / y),
    ("x * 0-dim y", "promote", [(5, 7), ()], "any", lambda d: lambda x, y: x * y),
    ("Tensor.add", "promote", [(5, 7), (5, 7)], "any", lambda d: lambda x, y: x.add(y, alpha=0.5)),
    ("Tensor.atan2", "promote", [(5, 7), (5, 7)], "any", lambda d: lambda x, y: x.atan2(y)),
]


def _input(shape, domain, gen, device):
    if domain == "prob":
        return torch.rand(shape, generator=gen).to(device)
    x = random_tensor(shape, torch.float32, "cpu", gen, scale={"unit": 0.2, "small": 0.1}.get(domain, 1.0))
    return (x.abs() if domain == "pos" else x).to(device)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cast_rule(case, low, device, gen, make_handle):
    name, rule, shapes, domain, make_fn = case
    handle = make_handle(dtype=low)
    fn = make_fn(device)
    for dtypes in dtype_mixes(len(shapes), low):
        inputs = [_input(s, domain, gen, device).to(dt) for s, dt in zip(shapes, dtypes)]
        check_call(handle, fn, inputs, rule, low, f"{name} {[str(d)[6:] for d in dtypes]}")


def test_layers_and_modules_follow_the_lists(device, gen, make_handle):
    # Apex's test_basic_casts: layers run through F's patched functions; their fp32 parameters are
    # passed as inputs (functional_call), so that their gradients are checked to arrive in fp32.
    handle = make_handle()
    torch.manual_seed(gen.initial_seed())
    layers = [("half", torch.nn.Linear(8, 6), (4, 8)), ("half", torch.nn.Conv1d(8, 4, 3), (2, 8, 5)),
              ("float", torch.nn.Softmax(dim=1), (4, 8)), ("float", torch.nn.GroupNorm(2, 8), (2, 8, 5)),
              ("float", torch.nn.LayerNorm(5), (2, 8, 5))]
    for rule, m, shape in layers:
        m.to(device)
        names = [n for n, _ in m.named_parameters()]

        def fn(x, *params, m=m, names=names):
            return torch.func.functional_call(m, dict(zip(names, params)), (x,))

        for dt in (torch.float16, torch.float32):
            x = _input(shape, "any", gen, device).to(dt)
            check_call(handle, fn, [x, *(p.detach() for p in m.parameters())], rule, torch.float16, f"{m} {dt}")
    for m in (torch.nn.ReLU(), torch.nn.BatchNorm1d(8).to(device)):  # on no list: the input's dtype
        for dt in (torch.float16, torch.float32):
            x = _input((4, 8), "any", gen, device).to(dt).requires_grad_()
            y = m(x)
            assert y.dtype == dt, f"{m}: {dt} input must give {dt} (not on Apex's lists)"
            y.float().sum().backward()
            assert x.grad.dtype == dt


def test_comparisons_and_equal_promote(device, make_handle):
    # 1 + 2**-12 is not a float16 number: compared in fp32 it differs from fp16's 1.0.
    make_handle()
    a16 = torch.ones(3, dtype=torch.float16, device=device)
    b32 = torch.full((3,), 1 + 2.0 ** -12, device=device)
    assert not bool(torch.eq(a16, b32).any()) and bool((a16 < b32).all())
    assert not torch.equal(a16, b32)
    assert bool((a16 != b32[0]).all())  # 0-dim fp32 operand: promoted too (plain torch would not)


def test_inplace_matches_self(low, device, gen, make_handle):
    # Apex's test_inplace_add_matches_self: the result keeps self's dtype; grads flow to both.
    make_handle(dtype=low)
    for xt, yt in dtype_mixes(2, low):
        x_leaf = _input((6,), "any", gen, device).to(xt).requires_grad_()
        y = _input((6,), "any", gen, device).to(yt).requires_grad_()
        x = x_leaf.clone()
        out = x.add_(y)
        assert out is x and out.dtype == xt
        with amp.disable_casts():  # Apex's rule: the other operand is cast to self's dtype first
            expected = x_leaf.detach() + y.detach().to(xt)
        assert_bitwise_equal(out.detach(), expected, f"{xt} += {yt}")
        out.float().sum().backward()
        assert x_leaf.grad.dtype == xt and y.grad.dtype == yt
        z = _input((6,), "any", gen, device).to(xt)
        z += _input((6,), "any", gen, device).to(yt)
        assert z.dtype == xt


@pytest.mark.parametrize("call", [lambda x: x.exp_(), lambda x: torch.exp_(x), lambda x: x.pow_(2.0),
                                  lambda x: x.__ipow__(2.0), lambda x: x.log_()],
                         ids=["Tensor.exp_", "torch.exp_", "Tensor.pow_", "**=", "Tensor.log_"])
def test_inplace_float_op_on_low_precision_raises(call, low, device, gen, make_handle):
    # Apex's test_inplace_exp_is_error_for_half: the op runs in fp32, which x cannot hold in place.
    make_handle(dtype=low)
    x = _input((7,), "pos", gen, device).to(low)
    before, version = x.clone(), x._version
    with pytest.raises(NotImplementedError, match=r"amp \(O1\): in-place \S+ on a torch\.(b?float16) tensor"):
        call(x)
    assert_bitwise_equal(x, before, "refused in-place op")
    assert x._version == version
    x32 = _input((7,), "pos", gen, device)
    ref = call(x32.double().clone())
    out = call(x32)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-6)


def test_binary_cross_entropy_is_banned(device, gen, make_handle):
    make_handle()
    x, t = torch.rand(6, 5, generator=gen).to(device), torch.rand(6, 5, generator=gen).to(device)
    for fn in (F.binary_cross_entropy, torch.nn.BCELoss()):
        with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits.*allow_banned=True"):
            fn(x.half(), t)
        assert fn(x, t).dtype == torch.float32  # fp32 inputs are left to run


def test_binary_cross_entropy_allow_banned_runs_in_float(device, gen, make_handle):
    handle = make_handle(allow_banned=True)
    x = torch.rand(6, 5, generator=gen).mul_(0.9).add_(0.05).to(device)
    t = torch.rand(6, 5, generator=gen).to(device)
    for dt in (torch.float16, torch.float32):
        check_call(handle, lambda a, b: F.binary_cross_entropy(a, b), [x.to(dt), t], "float", torch.float16,
                   f"bce {dt}")
        assert torch.nn.BCELoss()(x.to(dt), t).dtype == torch.float32


def test_cpu_method_casts_when_leaving_the_device(device, make_handle):
    # Apex's test_cpu_is_float: low precision leaves a GPU as fp32. A CPU tensor moves nowhere.
    make_handle()
    x = torch.randn(4, device=device).half()
    y = x.cpu()
    assert y.dtype == (torch.float16 if device == "cpu" else torch.float32)
    assert torch.equal(y.float(), x.float().cpu())


def test_float64_and_integers_are_left_alone(device, make_handle):
    make_handle()
    d = torch.randn(4, 4, dtype=torch.float64, device=device)
    i = torch.arange(16, device=device).view(4, 4)
    assert torch.mm(d, d).dtype == torch.float64 and torch.exp(d).dtype == torch.float64
    if device == "cpu":  # CUDA has no integer matmul, with or without amp ("addmm_cuda" for 'Long')
        assert torch.mm(i, i).dtype == torch.int64
    assert torch.mul(i, i).dtype == torch.int64 and i.sum().dtype == torch.int64
    assert (d.half() + d).dtype == torch.float64  # promote: widest is double


def test_out_argument_is_not_cast(device, make_handle):
    make_handle()
    a, b = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device).half()
    out = torch.empty(4, 4, device=device)
    res = torch.add(a, b, out=out)
    assert res is out and torch.allclose(out, a + b.float())
