"""O1's cast rules applied Apex's way, by patching: the wrappers amp.init's handle installs over
torch's functions and Tensor methods (per _o1_lists), the weight-cast cache, and the exact
removal of every patch."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch

from ._o1_lists import BANNED_MESSAGE

Tensor = torch.Tensor
_F16, _BF16, _F32, _F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
_LOW = frozenset((_F16, _BF16))
# What the half and float rules cast. float64 is left alone, as torch.autocast leaves it: a
# caller who asked for double precision keeps it.
_ELIGIBLE = frozenset((_F16, _BF16, _F32))
_FLOATING = _ELIGIBLE | {_F64}
#: The promotion of each pair of distinct floating dtypes, so that promote rules look it up.
_WIDER = {(a, b): torch.promote_types(a, b) for a in _FLOATING for b in _FLOATING if a is not b}
_SEQ = (list, tuple)
_SHORT = {_F16: "Half", _BF16: "BFloat16", _F32: "Float", _F64: "Double"}
_MISSING = object()


class CastState:
    """The one active handle's settings, read by every wrapper (attribute reads, no calls)."""

    __slots__ = ("on", "low", "cache", "verbose", "handle")

    def __init__(self) -> None:
        self.on = False  # a handle is active and casts are not disabled
        self.low = _F16
        self.cache: Optional[dict] = None  # id(param) -> (param, version, data_ptr, cast)
        self.verbose = False
        self.handle = None


STATE = CastState()


@contextlib.contextmanager
def casts_off() -> Iterator[None]:
    """The active handle's casts off inside (amp.disable_casts, handle._disable_casts)."""
    handle, previous = STATE.handle, STATE.on
    STATE.on = False
    try:
        yield
    finally:
        if STATE.handle is handle:  # a handle deactivated inside stays deactivated
            STATE.on = previous


# -- casting one tensor ---------------------------------------------------------------------------
def _convert(x: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    if STATE.verbose:
        print(f"{_SHORT[x.dtype]}->{_SHORT[dtype]} ({name})")
    return x.to(dtype)


def to_low(x: Tensor, name: str) -> Tensor:
    """``x`` in the handle's low dtype. A leaf that requires grad (a weight) is cast once while
    it is unchanged: the entry remembers its version counter and data pointer, which any
    in-place change (an optimizer step) or ``.data =`` moves. Only with grad mode on, so that a
    cast without autograd history is never served to a forward that needs one."""
    dtype = x.dtype
    low = STATE.low
    if dtype is low or dtype not in _ELIGIBLE:
        return x
    cache = STATE.cache
    if cache is None or not (x.requires_grad and x.is_leaf and torch.is_grad_enabled()):
        return _convert(x, low, name)
    version, ptr = x._version, x.data_ptr()
    entry = cache.get(id(x))  # the entry holds x itself, so its id cannot be reused meanwhile
    if entry is not None and entry[1] == version and entry[2] == ptr:
        return entry[3]
    out = _convert(x, low, name)
    cache[id(x)] = (x, version, ptr, out)
    return out


def to_float(x: Tensor, name: str) -> Tensor:
    return _convert(x, _F32, name) if x.dtype in _LOW else x


def _to_dtype(dtype: torch.dtype) -> Callable[[Tensor, str], Tensor]:
    def cast(x: Tensor, name: str) -> Tensor:
        d = x.dtype
        return _convert(x, dtype, name) if d is not dtype and d in _FLOATING else x
    return cast


_TO = {d: _to_dtype(d) for d in _FLOATING}


# -- casting a call's arguments -------------------------------------------------------------------
# Tensors among the arguments and inside list/tuple arguments (cat's sequence, an RNN's weights and
# hidden state) are cast; ``out=`` is left as given, so the result still lands there.
def _cast_seq(seq, conv, name):
    items = [conv(t, name) if isinstance(t, Tensor) else t for t in seq]
    return type(seq)(items) if any(a is not b for a, b in zip(items, seq)) else seq


def cast_call(fn: Callable, args: tuple, kwargs: dict, conv, name: str) -> Any:
    """``fn(*args, **kwargs)`` with every floating tensor argument passed through ``conv``."""
    new = None
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            c = conv(a, name)
        elif type(a) in _SEQ and a:
            c = _cast_seq(a, conv, name)
        else:
            continue
        if c is not a:
            if new is None:
                new = list(args)
            new[i] = c
    for k, v in kwargs.items():  # a fresh dict per call: safe to update
        if k == "out":
            continue
        if isinstance(v, Tensor):
            kwargs[k] = conv(v, name)
        elif type(v) in _SEQ and v:
            kwargs[k] = _cast_seq(v, conv, name)
    return fn(*(args if new is None else new), **kwargs)


def _widen(common, t):
    d = t.dtype
    if d not in _FLOATING or d is common:
        return common, False
    if common is None:
        return d, False
    return _WIDER[common, d], True


def widest(args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    """The widest floating dtype among the arguments when they hold more than one, else None."""
    common, mixed = None, False
    for a in (*args, *(v for k, v in kwargs.items() if k != "out")) if kwargs else args:
        if isinstance(a, Tensor):
            common, m = _widen(common, a)
            mixed |= m
        elif type(a) in _SEQ:
            for t in a:
                if isinstance(t, Tensor):
                    common, m = _widen(common, t)
                    mixed |= m
    return common if mixed else None


def _any_low(args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    for a in (*args, *kwargs.values()):
        for t in (a if type(a) in _SEQ else (a,)):
            if isinstance(t, Tensor) and t.dtype in _LOW:
                return t.dtype
    return None


def call_with_rule(kind: str, fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """One call under the half, float or promote rule (the decorators' entry point)."""
    if kind == "half":
        return cast_call(fn, args, kwargs, to_low, name)
    if kind == "float":
        return cast_call(fn, args, kwargs, to_float, name)
    target = widest(args, kwargs)
    return fn(*args, **kwargs) if target is None else cast_call(fn, args, kwargs, _TO[target], name)


# -- the wrappers, one factory per rule ---------------------------------------------------------
def _cast_rule(conv):
    def make(orig, name):
        def wrapper(*args, **kwargs):
            if not STATE.on:
                return orig(*args, **kwargs)
            return cast_call(orig, args, kwargs, conv, name)
        return wrapper
    return make


def _promote(orig, name):
    def wrapper(*args, **kwargs):
        if STATE.on:
            target = widest(args, kwargs)
            if target is not None:
                return cast_call(orig, args, kwargs, _TO[target], name)
        return orig(*args, **kwargs)
    return wrapper


def _match(orig, name):
    # In place, the result keeps self's dtype: the other operands are cast to it (Apex's rule).
    def wrapper(self, *args, **kwargs):
        if STATE.on and self.dtype in _ELIGIBLE:
            return cast_call(orig, (self, *args), kwargs, _TO[self.dtype], name)
        return orig(self, *args, **kwargs)
    return wrapper


def _inplace(orig, name):
    # Tensor.exp_ and torch.exp_ alike: self is the first argument. The op runs in fp32, which a
    # low-precision self cannot hold in place (Apex's rule: an error, before anything changes).
    def wrapper(self, *args, **kwargs):
        if STATE.on:
            if self.dtype in _LOW:
                base = name[:-1] if name.endswith("_") else name.replace("__i", "__")
                raise NotImplementedError(
                    f"amp (O1): in-place {name} on a {self.dtype} tensor: {base} runs in float32 under amp's "
                    f"O1 rules, and an in-place result cannot leave the tensor's dtype; use the out-of-place "
                    f"{base} (or cast the tensor to float32 first)")
            return cast_call(orig, (self, *args), kwargs, to_float, name)
        return orig(self, *args, **kwargs)
    return wrapper


def _banned(orig, name):
    def wrapper(*args, **kwargs):
        if STATE.on and _any_low(args, kwargs) is not None:
            raise NotImplementedError(BANNED_MESSAGE)
        return orig(*args, **kwargs)
    return wrapper


def _to_cpu(orig, name):
    # Apex's rule: a low-precision tensor leaves the device as float32. One already on the CPU
    # is not moved anywhere, so it is not cast.
    def wrapper(self, *args, **kwargs):
        if STATE.on and self.dtype in _LOW and self.device.type != "cpu":
            self = _convert(self, _F32, name)
        return orig(self, *args, **kwargs)
    return wrapper


def _rnn_check(orig, name):
    # nn.RNN/LSTM/GRU refuse an input whose dtype differs from their weights unless autocast is
    # on; under the handle the _VF call casts both, so the check sees a same-dtype stand-in
    # (a meta tensor: no memory, only the shape and dtype that the check reads).
    def wrapper(self, input, *args, **kwargs):
        if STATE.on and self._flat_weights:
            w = self._flat_weights[0]
            if w is not None and input.dtype is not w.dtype and input.dtype in _ELIGIBLE and w.dtype in _ELIGIBLE:
                input = torch.empty(input.shape, dtype=w.dtype, device="meta")
        return orig(self, input, *args, **kwargs)
    return wrapper


_FACTORIES = {
    "half": _cast_rule(to_low), "float": _cast_rule(to_float), "promote": _promote, "match": _match,
    "inplace": _inplace, "banned": _banned, "to_cpu": _to_cpu,
    "rnn_check": _rnn_check,
}


# -- installing and removing ----------------------------------------------------------------------
def install(table: list[tuple[object, str, str]]) -> list[tuple[object, str, object]]:
    """Replaces each (owner, name) of ``table`` by its rule's wrapper. Returns what removal needs:
    (owner, name, the owner's own entry before, or _MISSING where the attribute was inherited or
    served by the owner's __getattr__, as torch._VF serves its functions)."""
    patched: list[tuple[object, str, object]] = []
    try:
        for owner, name, kind in table:
            orig = getattr(owner, name)
            wrapper = functools.wraps(orig)(_FACTORIES[kind](orig, name))
            patched.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, wrapper)
    except BaseException:
        uninstall(patched)
        raise
    return patched


def uninstall(patched: list[tuple[object, str, object]]) -> None:
    """Puts back every attribute ``install`` replaced, the same objects (in reverse order)."""
    for owner, name, saved in reversed(patched):
        if saved is _MISSING:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, saved)
    patched.clear()
