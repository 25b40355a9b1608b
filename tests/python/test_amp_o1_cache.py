# amp.init's weight-cast cache (a weight used twice is cast once, never served stale) and user
# functions under the handle (amp.register_*_function, the half/float/promote_function decorators).
from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from amp_o1_support import low, make_handle  # noqa: F401 (fixtures)
from conftest import assert_bitwise_equal, peer_bound, random_tensor, rel_err
from mixprec import amp
from mixprec.amp import _casts


class CastCounter(TorchDispatchMode):
    """Counts dtype casts (aten._to_copy) of the tensor whose storage is at ``ptr``."""

    def __init__(self, ptr: int) -> None:
        super().__init__()
        self.ptr, self.count = ptr, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == self.ptr:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _weight(gen, device, n=8):
    return torch.nn.Parameter(random_tensor((n, n), torch.float32, device, gen, scale=0.3))


def _twice(x, w):
    return torch.mm(torch.mm(x, w), w)


def _casts_of(w, fn):
    with CastCounter(w.data_ptr()) as counter:
        out = fn()
    return counter.count, out


def test_weight_used_twice_is_cast_once_and_backward_reaches_it(low, device, gen, make_handle):
    make_handle(dtype=low)
    w = _weight(gen, device)
    x = random_tensor((4, 8), torch.float32, device, gen)
    n, out = _casts_of(w, lambda: _twice(x, w))
    assert n == 1 and out.dtype == low
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32
    # float64 reference, and plain torch in `low` for the bound (Apex 25.04 raised IndexError here)
    ref_w = w.detach().double().requires_grad_()
    _twice(x.double(), ref_w).sum().backward()
    peer_w = w.detach().to(low).requires_grad_()
    with amp.disable_casts():
        _twice(x.to(low), peer_w).float().sum().backward()
    assert rel_err(w.grad, ref_w.grad) < peer_bound(low, peer_w.grad, ref_w.grad)


def test_cached_cast_is_the_same_object(device, gen, make_handle):
    seen = []
    ops = types.ModuleType("user_ops_identity")
    ops.f = lambda x, w: seen.append(w) or x @ w
    amp.register_half_function(ops, "f")
    handle = make_handle()
    w, x = _weight(gen, device), random_tensor((2, 8), torch.float32, device, gen)
    ops.f(x, w), ops.f(x, w)
    assert seen[0].dtype == torch.float16 and seen[0] is seen[1]
    assert len(handle.cache) == 1


def test_without_caching_each_use_is_cast(device, gen, make_handle):
    make_handle(enable_caching=False)
    w, x = _weight(gen, device), random_tensor((4, 8), torch.float32, device, gen)
    assert _casts_of(w, lambda: _twice(x, w))[0] == 2


def test_only_leaves_that_require_grad_are_cached(device, gen, make_handle):
    handle = make_handle()
    w, x = _weight(gen, device), random_tensor((8, 8), torch.float32, device, gen)
    w2 = w * 1.0  # not a leaf
    assert _casts_of(w2, lambda: _twice(x, w2))[0] == 2
    assert _casts_of(x, lambda: _twice(w.detach(), x))[0] == 2  # a leaf without grad: an input
    assert not handle.cache


def test_no_caching_under_no_grad(device, gen, make_handle):
    # A cast made without autograd history must never be served to a forward that needs one.
    handle = make_handle()
    w, x = _weight(gen, device), random_tensor((4, 8), torch.float32, device, gen)
    with torch.no_grad():
        assert _casts_of(w, lambda: _twice(x, w))[0] == 2
    assert not handle.cache
    out = _twice(x, w)
    assert out.requires_grad and out.grad_fn is not None


@pytest.mark.parametrize("change", ["optimizer step", "no_grad in place", ".data assignment"])
def test_no_stale_cast_after_the_weight_changes(change, device, gen, make_handle):
    make_handle()
    w, x = _weight(gen, device), random_tensor((4, 8), torch.float32, device, gen)
    _twice(x, w).float().sum().backward()  # fills the cache; no scale_loss clears it
    if change == "optimizer step":
        torch.optim.SGD([w], lr=0.5).step()
    elif change == "no_grad in place":
        with torch.no_grad():
            w.mul_(-1.5)
    else:
        w.data = w.data * -1.5
    n, out = _casts_of(w, lambda: _twice(x, w))
    assert n == 1, "the changed weight must be cast again"
    with amp.disable_casts():
        fresh = _twice(x.half(), w.detach().half())
    assert_bitwise_equal(out.detach(), fresh, f"forward after {change}")


def test_cache_is_cleared_by_scale_loss_and_clear_cache(device, gen, make_handle):
    handle = make_handle()
    w, x = _weight(gen, device), random_tensor((4, 8), torch.float32, device, gen)
    opt = torch.optim.SGD([w], lr=0.1)
    loss = _twice(x, w).float().pow(2).mean()
    assert len(handle.cache) == 1
    with handle.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert not handle.cache
    _twice(x, w)
    handle._clear_cache()
    assert not handle.cache
    assert _casts_of(w, lambda: _twice(x, w))[0] == 1


# -- user functions: decorators and registration ------------------------------------------------
def _user_module(name: str, seen: list) -> types.ModuleType:
    # The bodies only record their arguments' dtypes: no torch op inside that the handle patches.
    ops = types.ModuleType(name)
    for fn in ("mm", "exp", "add"):
        setattr(ops, fn, lambda *xs: seen.append([x.dtype for x in xs]) or xs[0])
    return ops


def test_registered_functions_apply_under_the_handle(device, gen, make_handle):
    seen: list = []
    ops = _user_module("user_ops_registered", seen)
    amp.register_half_function(ops, "mm")
    amp.register_float_function(ops, "exp")
    amp.register_promote_function(ops, "add")
    a, h = random_tensor((4, 4), torch.float32, device, gen), random_tensor((4,), torch.float16, device, gen)
    f32, f16 = torch.float32, torch.float16

    def run():
        seen.clear()
        ops.mm(a, a), ops.exp(h), ops.add(h, a), ops.add(h, h)
        return seen

    assert run() == [[f32, f32], [f16], [f16, f32], [f16, f16]], "no handle, no autocast: as written"
    handle = make_handle()
    assert run() == [[f16, f16], [f32], [f32, f32], [f16, f16]]
    handle._deactivate()
    assert run() == [[f32, f32], [f16], [f16, f32], [f16, f16]]


def test_decorators_apply_under_the_handle(low, device, gen, make_handle):
    calls = []

    def body(*xs):
        calls.append([x.dtype for x in xs])
        return xs[0]

    half, flt, prom = amp.half_function(body), amp.float_function(body), amp.promote_function(body)
    a = random_tensor((3,), torch.float32, device, gen)
    half(a), flt(a.to(low)), prom(a.to(low), a)
    assert calls == [[torch.float32], [low], [low, torch.float32]], "outside a handle: unchanged"
    calls.clear()
    make_handle(dtype=low)
    half(a), flt(a.to(low)), prom(a.to(low), a), prom(a.to(low), a.to(low))
    assert calls == [[low], [torch.float32], [torch.float32, torch.float32], [low, low]]
    calls.clear()
    with amp.disable_casts():
        half(a)
    assert calls == [[torch.float32]]


def test_decorators_keep_the_autocast_behaviour(gen):
    fn = amp.half_function(lambda x: (x.dtype, torch.is_autocast_enabled("cpu")))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fn(torch.ones(2)) == (torch.bfloat16, False)
    assert fn(torch.ones(2)) == (torch.float32, False)


def test_registering_a_missing_name_raises_and_registers_nothing():
    ops = _user_module("user_ops_missing", [])
    before = list(_casts._registry)
    for register in (amp.register_half_function, amp.register_float_function, amp.register_promote_function):
        with pytest.raises(ValueError, match=r"No function named nope in module <module 'user_ops_missing'"):
            register(ops, "nope")
    assert _casts._registry == before and not hasattr(ops, "nope")
