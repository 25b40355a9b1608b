# Shared pieces of the amp.init (Apex's original API) tests: a fixture that makes handles and gives
# every one back, the attributes a handle may patch, and one call checked in dtype and value.
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import peer_bound, rel_err
from mixprec import amp

LOWS = (torch.float16, torch.bfloat16)
#: Every object whose attributes amp.init may replace.
OWNERS = (torch, F, torch.Tensor, torch._VF, torch.linalg, torch.nn.modules.rnn.RNNBase)


@pytest.fixture
def make_handle():
    """``make_handle(**init_kwargs)``: amp.init, with every handle deactivated after the test."""
    made = []

    def make(**kwargs):
        handle = amp.init(**kwargs)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        handle._deactivate()


@pytest.fixture(params=LOWS, ids=["fp16", "bf16"])
def low(request) -> torch.dtype:
    return request.param


def attributes() -> list[dict]:
    """The own attributes of every patchable owner (identity snapshots)."""
    return [dict(vars(owner)) for owner in OWNERS]


def assert_same_attributes(before: list[dict]) -> None:
    for owner, was in zip(OWNERS, before):
        now = vars(owner)
        assert set(now) == set(was), f"{owner}: attributes added/removed: {set(now) ^ set(was)}"
        changed = [k for k in was if now[k] is not was[k]]
        assert not changed, f"{owner}: not the original objects: {changed[:10]}"


def expected_dtype(rule: str, dtypes, low: torch.dtype) -> torch.dtype:
    """Apex's rule for the output dtype of one call, given its floating inputs' dtypes."""
    if rule == "half":
        return low
    if rule == "float":
        return torch.float32
    return torch.float32 if torch.float32 in dtypes else low  # promote: the widest


def check_call(handle, fn, inputs: list[torch.Tensor], rule: str, low: torch.dtype, msg: str,
               backward: bool = True) -> torch.Tensor:
    """``fn(*inputs)`` under ``handle``: output dtype by Apex's rule, values against a float64
    reference (fp32 outputs within 1e-5; low-precision outputs within 2x plain torch's error in
    that dtype), and each input's gradient in the input's own dtype."""
    inputs = [x.detach().requires_grad_(backward) for x in inputs]
    out = fn(*inputs)
    want = expected_dtype(rule, [x.dtype for x in inputs], low)
    assert out.dtype == want, f"{msg}: output {out.dtype}, Apex's {rule} rule gives {want}"
    with handle._disable_casts():
        ref = fn(*[x.detach().double() for x in inputs])
        peer = fn(*[x.detach().to(want) for x in inputs]) if want != torch.float32 else None
    bound = peer_bound(want, peer, ref) if peer is not None else 1e-5
    err = rel_err(out, ref)
    assert err < bound, f"{msg}: relative error {err:.3e} >= {bound:.3e}"
    if backward:
        out.float().sum().backward()
        for i, x in enumerate(inputs):
            assert x.grad is not None and x.grad.dtype == x.dtype, f"{msg}: input {i} grad {x.grad}"
    return out


def dtype_mixes(n: int, low: torch.dtype):
    return list(itertools.product((low, torch.float32), repeat=n))
