"""Casting under amp: the model-forward wrapper (O1 autocast, O2/O3 input and output casts),
disable_casts(), Apex's half/float/promote_function decorators and register_*_function calls,
which act where autocast is on or an amp.init handle is active. No torch function is patched
unless the user registers it (or amp.init's handle is active: _o1_patch)."""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections import abc
from types import MethodType
from typing import Any, Callable, Iterator, Optional

import torch

from ._o1_patch import STATE as _O1, call_with_rule, casts_off

_registry: list[tuple[Any, str, str]] = []  # (module, name, kind) from register_*_function
_WRAPPED = "__mixprec_amp_cast__"


# -- casting values ------------------------------------------------------------------------------
def applier(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apex's applier: ``fn`` on every tensor inside (nested) lists, tuples, dicts and objects
    with a ``to`` method; strings and numpy arrays are left alone."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (str, bytes)):
        return value
    if type(value).__module__ == "numpy":
        return value
    if hasattr(value, "to") and not isinstance(value, torch.nn.Module):
        return fn(value)
    if isinstance(value, abc.Mapping):
        items = {applier(k, fn): applier(v, fn) for k, v in value.items()}
        try:
            return items if type(value) is dict else type(value)(items)
        except TypeError:  # mappings that cannot be built from a dict (defaultdict, ...)
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(applier(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(applier(v, fn) for v in value)
    return value


def to_type(dtype: torch.dtype, t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return t.to(dtype) if t.is_floating_point() else t
    try:
        return t.to(dtype)  # custom batch classes (Apex did the same)
    except Exception:
        return t


_Module = torch.nn.Module
_is_compiling = torch.compiler.is_compiling  # constant True while dynamo traces, a flag read in eager


def _first_param(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """``next(module.parameters(), None)``, by the same preorder walk over ``_parameters`` and
    ``_modules`` that it makes, without its chain of generators (about 20 Python calls on every
    forward). A module whose class overrides a method of that walk gets the walk itself."""
    cls = type(module)  # (attribute reads, not getattr(): no calls)
    if (cls.parameters is not _Module.parameters or cls.named_parameters is not _Module.named_parameters
            or cls._named_members is not _Module._named_members):
        return next(iter(module.parameters()), None)
    stack = [module]
    seen = set()  # named_modules' memo: a module reached twice (or a cycle) is walked once
    while stack:
        m = stack.pop()
        if m is None or m in seen:
            continue
        if type(m).named_modules is not _Module.named_modules:
            return next(iter(module.parameters()), None)
        seen.add(m)
        for t in m._parameters.values():
            if t is not None:
                return t
        stack.extend(reversed(m._modules.values()))  # popped in registration order
    return None


def _device_type_of(module: torch.nn.Module, args: tuple, kwargs: dict, first: Optional[torch.Tensor]) -> str:
    if first is not None:
        return first.device.type
    for t in module.buffers():
        return t.device.type
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


_CAST_FIRST = "_mixprec_amp_cast_first"


def _gone() -> None:
    return None


class FirstParam:
    """O2/O3: the model's first param as amp.initialize cast it (and the optimizer holds it), kept in
    the model's ``__dict__`` rather than the forward's closure, which copies of the model share: a
    deepcopy (an EMA model) maps it to the copy's own param. Weak, as a param replaced must not
    stay alive; pickled as the param itself."""

    __slots__ = ("ref",)

    def __init__(self, param: Optional[torch.Tensor]) -> None:
        self.ref = weakref.ref(param) if param is not None else _gone

    def get(self) -> Optional[torch.Tensor]:
        return self.ref()

    def __deepcopy__(self, memo: dict) -> "FirstParam":
        param = self.ref()
        return self if param is None else FirstParam(copy.deepcopy(param, memo))

    def __reduce__(self):
        return (FirstParam, (self.ref(),))


def patch_forward(model: torch.nn.Module, *, autocast_dtype: Optional[torch.dtype] = None,
                  input_dtype: Optional[torch.dtype] = None, output_dtype: Optional[torch.dtype] = None) -> None:
    """Wraps ``model.forward`` (an instance attribute bound to ``model``, so deepcopy, DDP and
    torch.compile see an ordinary method): inputs cast to ``input_dtype``, the forward run under
    ``torch.autocast(dtype=autocast_dtype)``, outputs cast to ``output_dtype``."""
    inner = model.__dict__.get("forward")
    if inner is None:
        call = type(model).forward  # called as call(self, ...): no wrapper in between
    else:
        def call(self, *args, **kwargs):
            return inner(*args, **kwargs)

    cast_in = functools.partial(to_type, input_dtype) if input_dtype is not None else None
    cast_out = functools.partial(to_type, output_dtype) if output_dtype is not None else None
    # The params' dtypes as amp.initialize left them. O2/O3 look at them only when the forward raises
    # (no cost per call); O1, whose forward would run on with float16 weights and step them without
    # masters, compares the first param's dtype, which it reads anyway for autocast's device.
    # Only the same param object counts: FSDP2 swaps in unsharded params of its policy's dtype
    # around the forward, which is no dtype change (weak: a param replaced must not stay alive).
    cast_dtypes = {name: p.dtype for name, p in model.named_parameters()}
    first_param = _first_param(model)
    first_ref = weakref.ref(first_param) if first_param is not None else None
    first_dtype = first_param.dtype if first_param is not None else None
    if cast_in is not None and first_param is not None:
        model.__dict__[_CAST_FIRST] = FirstParam(first_param)

    def forward(self, *args, **kwargs):
        if cast_in is not None:
            cast_first = self.__dict__.get(_CAST_FIRST)
            if cast_first is not None and _first_param(self) is not cast_first.get():
                _raise_replaced(self)
            if _is_compiling():
                # Traced, a dtype error would come from fake tensors, before the except below can
                # name the change: check first. Dynamo guards on the params' dtypes, so this folds
                # to nothing in the graph (and a recast recompiles and raises here).
                _raise_if_recast(self, cast_dtypes, input_dtype, None)
            args, kwargs = applier(args, cast_in), applier(kwargs, cast_in)
            try:
                output = call(self, *args, **kwargs)
            except Exception as error:
                _raise_if_recast(self, cast_dtypes, input_dtype, error)
                raise
        elif autocast_dtype is not None:
            first = _first_param(self)
            if first is not None and first.dtype != first_dtype and first is first_ref():
                _raise_if_recast(self, cast_dtypes, None, None)
            with torch.autocast(_device_type_of(self, args, kwargs, first), dtype=autocast_dtype):
                output = call(self, *args, **kwargs)
        else:
            output = call(self, *args, **kwargs)
        if cast_out is None:
            return output
        if type(output) is torch.Tensor:  # the common output: applier's answer, without its calls
            return output.to(output_dtype) if output.is_floating_point() else output
        return applier(output, cast_out)

    model.forward = MethodType(forward, model)


def _raise_if_recast(model: torch.nn.Module, cast_dtypes: dict, input_dtype: Optional[torch.dtype],
                     error: Optional[Exception]) -> None:
    """If a param's dtype is no longer the one amp.initialize left it in (model.float(), .half(),
    .to(dtype) afterwards), say so: under O2/O3 (``input_dtype`` set) instead of the error the
    forward raised, torch's dtype mismatch; under O1 before the forward runs on."""
    for name, p in model.named_parameters():
        then = cast_dtypes.get(name)
        if then is not None and p.dtype != then:
            if input_dtype is not None:
                why = (f"amp casts this model's inputs to {input_dtype} and keeps the fp32 master weights in the "
                       "optimizer, so leave the model's dtype as amp.initialize set it (model.state_dict() under "
                       "O2/O3 already gives float32 values)")
            else:
                why = ("under O1 the weights stay as they were and autocast picks each op's precision; "
                       f"{p.dtype} weights would be stepped without fp32 masters (that is O2), so leave the model's "
                       "dtype as it was")
            raise RuntimeError(
                f"{type(model).__name__}.forward: parameter {name!r} is {p.dtype}, but amp.initialize left it "
                f"{then}: the model's dtype was changed after amp.initialize (model.float(), .half(), .double() or "
                f".to(dtype)); {why}; to train in another precision, build the model again and pass it to "
                "amp.initialize with that opt_level") from error


def _raise_replaced(model: torch.nn.Module) -> None:
    """O2/O3: the model's first param is not the object amp.initialize cast (and the optimizer
    holds, with its master); the model trains nothing from here on, silently, unless told."""
    name = next(iter(model.named_parameters()))[0]
    raise RuntimeError(
        f"{type(model).__name__}.forward: parameter {name!r} is no longer the tensor amp.initialize cast: the "
        "model's parameters were replaced after amp.initialize (model.to(device) onto a device whose tensors cannot "
        "take the old ones' place, such as meta, or any move with torch.__future__."
        "set_overwrite_module_params_on_conversion(True); load_state_dict(..., assign=True)), and the optimizer "
        "(and under O2 its fp32 masters) still holds the old ones, so this model would not train. Move the model before "
        "amp.initialize, and load checkpoints without assign=True")


# -- disable_casts and the decorators ------------------------------------------------------------
def _device_types() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Runs the enclosed code without amp's casts (autocast off on every device, and an
    amp.init handle's casts off), e.g. a custom op inside an O1 model's forward that must see its
    inputs' own dtypes."""
    with contextlib.ExitStack() as stack:
        for device_type in _device_types():
            stack.enter_context(torch.autocast(device_type, enabled=False))
        stack.enter_context(casts_off())
        yield


def _first_tensor_device(args: tuple, kwargs: dict) -> Optional[str]:
    found: list[str] = []

    def visit(t):
        if not found:
            found.append(t.device.type)
        return t

    applier((args, kwargs), lambda t: visit(t) if isinstance(t, torch.Tensor) else t)
    return found[0] if found else None


def _float_dtypes(args: tuple, kwargs: dict) -> set:
    seen: set = set()

    def visit(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            seen.add(t.dtype)
        return t

    applier((args, kwargs), visit)
    return seen


def _cast_wrapper(fn: Callable, kind: str) -> Callable:
    if getattr(fn, _WRAPPED, None) is not None:
        return fn

    name = getattr(fn, "__name__", "function")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = _first_tensor_device(args, kwargs)
        if device_type is None or not torch.is_autocast_enabled(device_type):
            if _O1.on:  # an amp.init handle is active: its rules (and weight cache), no autocast
                return call_with_rule(kind, fn, name, args, kwargs)
            return fn(*args, **kwargs)  # amp's casts are off here: the function runs as written
        if kind == "half":
            dtype = torch.get_autocast_dtype(device_type)
        elif kind == "float":
            dtype = torch.float32
        else:  # promote: the widest floating type among the inputs
            dtypes = _float_dtypes(args, kwargs)
            dtype = None if len(dtypes) <= 1 else functools.reduce(torch.promote_types, dtypes)
        if dtype is not None:
            cast = functools.partial(to_type, dtype)
            args, kwargs = applier(args, cast), applier(kwargs, cast)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    setattr(wrapper, _WRAPPED, kind)
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Decorator: where amp's casts are active (autocast on, e.g. in an O1 forward), ``fn`` runs
    with autocast off on its floating inputs cast to amp's low-precision dtype (float16, or
    bfloat16 when chosen). Under an active amp.init handle (and autocast off) its floating inputs
    are cast to the handle's dtype, weights through its cache. Elsewhere it runs unchanged."""
    return _cast_wrapper(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: like :func:`half_function`, with the inputs cast to float32."""
    return _cast_wrapper(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: like :func:`half_function`, with the floating inputs cast to the widest
    floating dtype among them (no cast when they agree)."""
    return _cast_wrapper(fn, "promote")


def _register(module: Any, name: str, kind: str) -> None:
    call = f"amp.register_{kind}_function"
    # Checked before anything is patched: a module given by name ("torch") read as "no function
    # there", and a non-callable attribute (torch.float16) would be replaced by a wrapper.
    if isinstance(module, str):
        raise TypeError(f"{call}: module must be the module or class object (e.g. torch), got the string {module!r}")
    if not isinstance(name, str):
        raise TypeError(f"{call}: function_name must be a string, got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}. ({call})")
    if not callable(getattr(module, name)):
        raise TypeError(f"{call}: {module.__name__ if hasattr(module, '__name__') else module}.{name} is a "
                        f"{type(getattr(module, name)).__name__}, not a function; expected a callable to wrap")
    _registry.append((module, name, kind))
    apply_registry()


def apply_registry() -> None:
    """Replaces each registered ``module.name`` by its cast wrapper (once). The wrappers act only
    where autocast is on or an amp.init handle is active, so they may be installed at
    registration time. (Register before amp.init: the handle's _deactivate puts back what it
    found, which drops a registration made on a name it patched.)"""
    for module, name, kind in _registry:
        fn = getattr(module, name)
        if getattr(fn, _WRAPPED, None) is None:
            setattr(module, name, _cast_wrapper(fn, kind))


def register_half_function(module: Any, function_name: str) -> None:
    """Makes ``module.function_name`` a :func:`half_function` (Apex's call, e.g.
    ``amp.register_half_function(torch, "bmm")``)."""
    _register(module, function_name, "half")


def register_float_function(module: Any, function_name: str) -> None:
    """Makes ``module.function_name`` a :func:`float_function`."""
    _register(module, function_name, "float")


def register_promote_function(module: Any, function_name: str) -> None:
    """Makes ``module.function_name`` a :func:`promote_function`."""
    _register(module, function_name, "promote")
