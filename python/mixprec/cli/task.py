"""What `mixprec compare` trains: the Task a user's entry point returns (model, optimizer, loss
function, data loaders, optional metric), and the loading of that entry point from a module
path or a .py file, with one-line errors for everything that can go wrong."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch


class TaskError(Exception):
    """The task could not be loaded or is malformed (the message is the one-line error)."""


@dataclass
class Task:
    """One training job. ``loss_fn(outputs, targets)`` returns a scalar tensor; the loaders
    yield ``(inputs, targets)`` pairs (tensors, or nested lists/tuples/dicts of them; the
    compare moves them to the device). ``metric_fn(outputs, targets)`` (a float or 0-dim tensor,
    averaged over batches weighted by batch size) judges the validation set; without it the
    validation loss is the metric (lower is better)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor]
    train_loader: Iterable
    val_loader: Iterable
    metric_fn: Optional[Callable[[Any, Any], Any]] = None
    metric_name: str = "accuracy"
    higher_is_better: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if self.metric_fn is None:
            self.metric_name, self.higher_is_better = "loss", False


_FIELDS = ("model", "optimizer", "loss_fn", "train_loader", "val_loader")


def as_task(value: Any, where: str) -> Task:
    """A Task from what an entry point returned: a Task, a dict with Task's field names, or a
    tuple (model, optimizer, loss_fn, train_loader, val_loader[, metric_fn])."""
    if isinstance(value, Task):
        task = value
    elif isinstance(value, dict):
        missing = [k for k in _FIELDS if k not in value]
        unknown = sorted(set(value) - set(Task.__dataclass_fields__))
        if missing or unknown:
            raise TaskError(f"{where} returned a dict {'missing ' + ', '.join(missing) if missing else ''}"
                            f"{' and ' if missing and unknown else ''}"
                            f"{'with unknown keys ' + ', '.join(unknown) if unknown else ''}")
        task = Task(**value)
    elif isinstance(value, (tuple, list)) and len(value) in (5, 6):
        task = Task(*value)
    else:
        raise TaskError(f"{where} must return a mixprec.cli.Task, a dict or a tuple (model, optimizer, loss_fn, "
                        f"train_loader, val_loader[, metric_fn]); got {type(value).__name__}")
    checks = [("model", torch.nn.Module), ("optimizer", torch.optim.Optimizer)]
    for name, cls in checks:
        if not isinstance(getattr(task, name), cls):
            raise TaskError(f"{where}: {name} must be a {cls.__module__}.{cls.__qualname__}, "
                            f"got {type(getattr(task, name)).__name__}")
    for name in ("loss_fn",) + (("metric_fn",) if task.metric_fn is not None else ()):
        if not callable(getattr(task, name)):
            raise TaskError(f"{where}: {name} must be callable, got {type(getattr(task, name)).__name__}")
    for name in ("train_loader", "val_loader"):
        if not hasattr(getattr(task, name), "__iter__"):
            raise TaskError(f"{where}: {name} must be iterable (a DataLoader or a list of batches), "
                            f"got {type(getattr(task, name)).__name__}")
    if not task.name:
        task.name = where
    return task


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def load_entry_point(spec: str) -> Callable[[torch.device], Any]:
    """``package.module:function`` or ``path/to/file.py:function`` (the function takes the
    device and returns a task). The current directory is importable, as with ``python -m``."""
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise TaskError(f"--task must look like 'package.module:function' or 'path/file.py:function', got {spec!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise TaskError(f"task file {module_name!r} does not exist")
            name = "mixprec_user_task_" + os.path.splitext(os.path.basename(module_name))[0]
            mod_spec = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            mod_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except TaskError:
        raise
    except BaseException as e:  # SyntaxError, ImportError, anything the module raises at import
        if isinstance(e, KeyboardInterrupt):
            raise
        raise TaskError(f"cannot import task module {module_name!r}: {_first_line(e)}") from e
    fn = getattr(module, func_name, None)
    if fn is None:
        raise TaskError(f"task module {module_name!r} has no attribute {func_name!r}")
    if not callable(fn):
        raise TaskError(f"task entry point {spec!r} is not callable")
    return fn


def build_task(factory: Callable, device: torch.device, where: str) -> Task:
    """Calls the entry point (with the device when it takes an argument) and checks the result."""
    try:
        takes_device = bool(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        takes_device = True
    value = factory(device) if takes_device else factory()
    return as_task(value, where)
