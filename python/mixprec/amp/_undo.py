"""amp.initialize's undo record: what the call may change (models' tensors, classes, forward patches
and hooks; optimizers' groups, state and patched methods; amp's globals; registered function patches),
taken by reference before it starts, so that a call that raises partway leaves everything as it was."""

from __future__ import annotations

from typing import Any

import torch

from . import _fp8
from ._casts import _registry
from ._scaler import _amp_state


def _contents(value: Any) -> Any:
    """A shallow copy of a container attribute's contents (None: not a container amp changes)."""
    if isinstance(value, dict):  # OrderedDicts of hooks, _parameters, _modules, optimizer.state
        return list(value.items())
    if isinstance(value, (list, set)):
        return list(value)
    return None


def _put_back(container: Any, contents: list) -> None:
    if isinstance(container, dict):
        container.clear()
        container.update(contents)
    elif isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


class _Attributes:
    """An object's class and instance attributes, each container attribute with its contents (one
    level deep): restoring puts the same objects back, so references users hold stay valid."""

    def __init__(self, obj: Any) -> None:
        self.obj, self.cls = obj, type(obj)
        self.attrs = dict(obj.__dict__)
        self.contents = {k: c for k, v in self.attrs.items() if (c := _contents(v)) is not None}

    def restore(self) -> None:
        obj = self.obj
        if type(obj) is not self.cls:
            obj.__class__ = self.cls  # layer kernels and Fp8Linear swap classes in place
        d = obj.__dict__
        d.clear()
        d.update(self.attrs)
        for k, contents in self.contents.items():
            _put_back(self.attrs[k], contents)


class _Tensor:
    """A parameter (or its gradient), whose object must survive the rollback: the cast replaced its
    ``.data`` (or swapped its contents), never the bits of the storage it had before."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.data, self.grad = t, t.data, t.grad
        self.grad_data = None if self.grad is None else self.grad.data

    def restore(self) -> None:
        t = self.t
        if t.data.data_ptr() != self.data.data_ptr() or t.dtype != self.data.dtype or t.device != self.data.device:
            t.data = self.data
        if t.grad is not self.grad:
            t.grad = self.grad
        grad = self.grad
        if grad is not None and (grad.dtype != self.grad_data.dtype or grad.data_ptr() != self.grad_data.data_ptr()):
            grad.data = self.grad_data


class InitializeUndo:
    """Taken before amp.initialize changes anything (references only: no tensor is copied);
    :meth:`restore` after a failure puts every object it recorded back as it was."""

    def __init__(self, models: list, optimizers: list) -> None:
        modules: dict[int, torch.nn.Module] = {}
        params: dict[int, torch.Tensor] = {}
        for model in models:
            for module in model.modules():
                modules.setdefault(id(module), module)
            for p in model.parameters():
                params.setdefault(id(p), p)
        self.objects = [_Attributes(m) for m in modules.values()]
        for opt in optimizers:
            inner = getattr(opt, "optim", None)  # apex.parallel.LARC keeps the groups in the optimizer it wraps
            for o in (opt,) if inner is None else (opt, inner):
                self.objects.append(_Attributes(o))
                self.objects.extend(_group_records(o))
                for p in (q for g in o.param_groups for q in g["params"] if isinstance(q, torch.Tensor)):
                    params.setdefault(id(p), p)
        self.tensors = [_Tensor(p) for p in params.values()]
        self.amp_state = _Attributes(_amp_state)
        self.fp8_layers = _fp8.REGISTRY.layers
        self.patched = [(module, name, getattr(module, name)) for module, name, _ in _registry]

    def restore(self) -> None:
        for module, name, fn in self.patched:
            if getattr(module, name) is not fn:
                setattr(module, name, fn)
        _fp8.REGISTRY.layers = self.fp8_layers
        self.amp_state.restore()
        for obj in self.objects:
            obj.restore()
        for t in self.tensors:
            t.restore()


class _Dict:
    """A plain dict's contents (an optimizer's param group or a per-param state entry)."""

    def __init__(self, d: dict) -> None:
        self.d, self.items = d, list(d.items())
        self.params = list(d["params"]) if isinstance(d.get("params"), list) else None

    def restore(self) -> None:
        _put_back(self.d, self.items)
        if self.params is not None:
            self.d["params"][:] = self.params  # SWAP put masters into the group's own list


def _group_records(opt: Any) -> list:
    """The param groups' and per-param state's own contents (SWAP swaps masters into the groups'
    lists; a fused optimizer's masters are added to the state entries)."""
    out = [_Dict(g) for g in opt.param_groups]
    out.extend(_Dict(s) for s in opt.state.values() if isinstance(s, dict))
    return out
