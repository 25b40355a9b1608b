"""Checkpoints under amp: Apex's amp.state_dict()/load_state_dict() of the loss scalers, and
checkpoint_state()/load_checkpoint_state(), which save and restore models, optimizers (with
their fp32 master weights, which Apex lost) and scalers together, validated before any change."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch

from .._loss_scale import INT32_MAX, _check_number, check_scale, validate_extra_state
from . import _fp8, _optimizer
from ._optimizer import SWAP
from ._scaler import _amp_state

FORMAT = "mixprec.amp.checkpoint"
VERSION = 1


def _require_initialized() -> None:
    if not _amp_state.initialized:
        raise RuntimeError("mixprec.amp is not initialized: call amp.initialize(...) first")


def state_dict(destination=None) -> dict:
    """The loss scalers' state, Apex's format: ``{"loss_scaler0": {"loss_scale", "unskipped"}, ...}``
    plus mixprec's keys (``_skipped_steps``, ``_hysteresis_tracker``, ...). Syncs."""
    _require_initialized()
    if destination is None:
        destination = {}
    elif not isinstance(destination, MutableMapping):  # checked before anything is written into it
        raise TypeError(f"amp.state_dict: destination must be a dict (or None), got {type(destination).__name__}")
    for idx, scaler in enumerate(_amp_state.loss_scalers):
        entry = {"loss_scale": scaler.state.get_scale(), "unskipped": scaler.state.get_growth_tracker()}
        entry.update(scaler.state.extra_state())
        destination[f"loss_scaler{idx}"] = entry
    _fp8.save_into(destination)  # the FP8 layers' scales and amax histories, under "fp8"
    return destination


def _validated_scalers(state: Any, where: str) -> list[tuple[int, dict, dict]]:
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected a dict of loss scalers, got {type(state).__name__}")
    fp8_entry = _fp8.validated(state, where)
    state = {k: v for k, v in state.items() if k != _fp8.KEY}
    unexpected = [k for k in state if not (isinstance(k, str) and k.startswith("loss_scaler"))]
    if unexpected:
        # Apex's words (code may match them), then the call and what is expected.
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{k}"' for k in unexpected) + f". ({where}: expected only 'loss_scaler<i>' "
                           f"keys and '{_fp8.KEY}')")
    if len(state) != len(_amp_state.loss_scalers):
        raise ValueError(f"{where}: it holds {len(state)} loss scalers but amp was initialized with num_losses="
                         f"{len(_amp_state.loss_scalers)}")
    out = []
    for idx in range(len(_amp_state.loss_scalers)):
        key = f"loss_scaler{idx}"
        entry = state.get(key)
        if not isinstance(entry, dict) or "loss_scale" not in entry or "unskipped" not in entry:
            raise ValueError(f"{where}[{key!r}] must be a dict with 'loss_scale' and 'unskipped'")
        check_scale(f"{where}[{key!r}]['loss_scale']", entry["loss_scale"])
        # The growth tracker is an int32 on the device: a larger count could not be stored.
        _check_number(f"{where}[{key!r}]['unskipped']", entry["unskipped"], integer=True, lo=0, hi=INT32_MAX)
        extra = validate_extra_state(entry, f"{where}[{key!r}]")
        # A dynamic scale outside its bounds would skip steps (above) or never recover (below) until
        # the update brought it back; GradScaler.load_state_dict refuses the same.
        current = _amp_state.loss_scalers[idx].state
        low, high = extra.get("min_scale", current.min_scale), extra.get("max_scale", current.max_scale)
        if high and entry["loss_scale"] > high:  # 0 or None: no bound (as saved by extra_state)
            raise ValueError(f"{where}[{key!r}]['loss_scale'] must be <= max_scale ({high}), got {entry['loss_scale']}")
        if low and entry["loss_scale"] < low:
            raise ValueError(f"{where}[{key!r}]['loss_scale'] must be >= min_scale ({low}), got {entry['loss_scale']}")
        out.append((idx, entry, extra))
    if fp8_entry is not None:
        out.append((-1, fp8_entry, {}))  # applied by _apply_scalers with the scalers
    return out


def _apply_scalers(validated: list[tuple[int, dict, dict]]) -> None:
    for idx, entry, extra in validated:
        if idx < 0:
            _fp8.apply(entry)
            continue
        s = _amp_state.loss_scalers[idx].state
        s.hysteresis = extra.get("hysteresis", s.hysteresis)
        if "min_scale" in extra:
            s.min_scale = extra["min_scale"]
        if "max_scale" in extra:
            s.max_scale = extra["max_scale"]
        s.set_values(entry["loss_scale"], entry["unskipped"], extra.get("_hysteresis_tracker", s.hysteresis),
                     extra.get("_skipped_steps"))


def load_state_dict(state_dict: dict) -> None:
    """Loads :func:`state_dict`'s output (or Apex's), validating all of it before changing anything."""
    _require_initialized()
    _apply_scalers(_validated_scalers(state_dict, "amp.load_state_dict: state_dict"))


def _listify(value, cls, where: str) -> list:
    """One object of ``cls`` or a sequence of them, as a list; anything else (an optimizer passed as
    the models, say) is refused by name before anything is read or written."""
    if value is None:
        return []
    items = [value] if isinstance(value, cls) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(v, cls) for v in items):
        raise TypeError(f"{where} must be a {cls.__module__}.{cls.__qualname__} or a list of them, got "
                        f"{type(value).__name__}")
    return items


def _swap_masters(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    stash = getattr(opt, "_amp_stash", None)
    return list(stash.low_masters) if stash is not None and stash.kind == SWAP else []


def checkpoint_state(models, optimizers=None) -> dict:
    """Everything needed to resume: each model's ``state_dict()``, each optimizer's (a mixprec
    fused optimizer's holds its fp32 masters), the fp32 masters that Apex kept in the param
    groups (which ``optimizer.state_dict()`` does not hold), and the loss scalers. Plain data and
    tensors: ``torch.save`` it, ``torch.load(path, weights_only=True)`` reads it back.

    Example::

        torch.save(amp.checkpoint_state(model, optimizer), "ckpt.pt")
        ...
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        amp.load_checkpoint_state(torch.load("ckpt.pt", weights_only=True), model, optimizer)

    Call it between steps (after ``optimizer.step()``). Syncs.
    """
    _require_initialized()
    models = _listify(models, torch.nn.Module, "amp.checkpoint_state: models")
    optimizers = _listify(optimizers, torch.optim.Optimizer, "amp.checkpoint_state: optimizers")
    props = _amp_state.opt_properties
    return {
        "format": FORMAT,
        "version": VERSION,
        "opt_level": props.opt_level,
        "dtype": str(_amp_state.dtype).replace("torch.", ""),
        "models": [m.state_dict() for m in models],
        "optimizers": [o.state_dict() for o in optimizers],
        "masters": [[m.detach().clone() for m in _swap_masters(o)] for o in optimizers],
        "amp": state_dict(),
    }


_PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta",
                 "master_param", "exp_inf", "mu_product", "prev", "ax", "eta_prev")


def _validate_model(i: int, model: torch.nn.Module, saved: Any) -> None:
    where = f"amp.load_checkpoint_state: checkpoint['models'][{i}]"
    if not isinstance(saved, dict):
        raise ValueError(f"{where} is not a state_dict")
    current = model.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        raise ValueError(f"{where} does not match the model: missing keys {missing[:5]}, unexpected keys "
                         f"{unexpected[:5]}")
    for k, v in current.items():
        s = saved[k]
        if isinstance(v, torch.Tensor):
            if not isinstance(s, torch.Tensor):
                raise ValueError(f"{where}[{k!r}] is not a tensor")
            if s.shape != v.shape:
                raise ValueError(f"{where}[{k!r}] has shape {tuple(s.shape)} but the model's is {tuple(v.shape)}")
            if s.is_floating_point() != v.is_floating_point():
                raise ValueError(f"{where}[{k!r}] has dtype {s.dtype}, incompatible with the model's {v.dtype}")


def _validate_optimizer(i: int, opt: torch.optim.Optimizer, saved: Any, masters: Any) -> None:
    where = f"amp.load_checkpoint_state: checkpoint['optimizers'][{i}]"
    if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
        raise ValueError(f"{where} is not an optimizer state_dict (needs 'state' and 'param_groups')")
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise ValueError(f"{where} has {len(groups) if isinstance(groups, list) else '?'} param groups, the "
                         f"optimizer {len(opt.param_groups)}")
    id_to_param = {}
    for gi, (g, cur) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) or len(g["params"]) != len(cur["params"]):
            raise ValueError(f"{where}: param group {gi} does not match the optimizer's ({len(cur['params'])} params)")
        id_to_param.update(zip(g["params"], cur["params"]))
    if not isinstance(saved["state"], dict):
        raise ValueError(f"{where}['state'] is not a dict")
    for pid, st in saved["state"].items():
        if pid not in id_to_param:
            raise ValueError(f"{where}: state for unknown parameter id {pid!r}")
        if not isinstance(st, dict):
            raise ValueError(f"{where}: state[{pid!r}] is not a dict")
        p = id_to_param[pid]
        for k in _PARAM_SHAPED:
            v = st.get(k)
            if v is not None and (not isinstance(v, torch.Tensor) or v.shape != p.shape):
                raise ValueError(f"{where}: state[{pid!r}][{k!r}] must be a tensor of shape {tuple(p.shape)}")
    expected = _swap_masters(opt)
    where = f"amp.load_checkpoint_state: checkpoint['masters'][{i}]"
    if not isinstance(masters, list) or len(masters) != len(expected):
        raise ValueError(f"{where} holds {len(masters) if isinstance(masters, list) else '?'} master weights, the "
                         f"optimizer {len(expected)}")
    for j, (m, cur) in enumerate(zip(masters, expected)):
        if (not isinstance(m, torch.Tensor) or m.layout != torch.strided or m.dtype != torch.float32
                or m.shape != cur.shape):
            raise ValueError(f"{where}[{j}] must be a dense float32 tensor of shape {tuple(cur.shape)}")


def _read(source: Any, where: str) -> Any:
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as err:  # not a corrupt checkpoint: the OS's error
        raise type(err)(err.errno, f"{where}: cannot open checkpoint {source}: {err.strerror}") from err
    except Exception as err:  # torch's own message ("negative seek value", ...) does not say what is wrong
        name = source if isinstance(source, (str, os.PathLike)) else type(source).__name__
        raise ValueError(f"{where}: checkpoint {name} could not be read as a torch.save file (truncated, corrupt, "
                         f"or holding more than tensors and plain data): {err}") from err


def load_checkpoint_state(checkpoint: Any, models, optimizers=None) -> None:
    """Restores what :func:`checkpoint_state` saved into models and optimizers that went through
    ``amp.initialize`` with the same opt level and dtype. ``checkpoint`` is the dict (as
    ``torch.load(path, weights_only=True)`` returns it), or a path or binary file to read it
    from (with ``weights_only=True``, onto the CPU; a file that cannot be read raises ValueError). Everything is validated first: a
    corrupt or mismatched checkpoint raises ValueError and changes nothing. Training then
    continues bit-identically to a run that never stopped (given the same data and RNG)."""
    _require_initialized()
    models = _listify(models, torch.nn.Module, "amp.load_checkpoint_state: models")
    optimizers = _listify(optimizers, torch.optim.Optimizer, "amp.load_checkpoint_state: optimizers")
    where = "amp.load_checkpoint_state"
    if isinstance(checkpoint, (str, os.PathLike)) or hasattr(checkpoint, "read"):
        checkpoint = _read(checkpoint, where)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ValueError(f"{where}: not a mixprec.amp checkpoint (made by amp.checkpoint_state), got "
                         f"{type(checkpoint).__name__}; expected its dict, or a path or binary file holding it")
    if checkpoint.get("version") != VERSION:
        raise ValueError(f"{where}: checkpoint version {checkpoint.get('version')!r}, this mixprec reads {VERSION}")
    for key in ("opt_level", "dtype", "models", "optimizers", "masters", "amp"):
        if key not in checkpoint:
            raise ValueError(f"{where}: the checkpoint has no {key!r}")
    props = _amp_state.opt_properties
    dtype = str(_amp_state.dtype).replace("torch.", "")
    if checkpoint["opt_level"] != props.opt_level or checkpoint["dtype"] != dtype:
        raise ValueError(f"{where}: the checkpoint was saved under {checkpoint['opt_level']}/{checkpoint['dtype']}, "
                         f"amp is initialized with {props.opt_level}/{dtype}")
    for key, have, what in (("models", models, "models"), ("optimizers", optimizers, "optimizers"),
                            ("masters", optimizers, "optimizers")):
        if not isinstance(checkpoint[key], list) or len(checkpoint[key]) != len(have):
            n = len(checkpoint[key]) if isinstance(checkpoint[key], list) else "?"
            raise ValueError(f"{where}: checkpoint[{key!r}] has {n} entries for {len(have)} {what}")
    for i, (m, saved) in enumerate(zip(models, checkpoint["models"])):
        _validate_model(i, m, saved)
    for i, (o, saved, masters) in enumerate(zip(optimizers, checkpoint["optimizers"], checkpoint["masters"])):
        _validate_optimizer(i, o, saved, masters)
    scalers = _validated_scalers(checkpoint["amp"], f"{where}: checkpoint['amp']")

    # All of it or nothing: the loaders below still check what the validation above cannot (an
    # optimizer's own rules, a module's set_extra_state), so what they change is put back if
    # any of them raises.
    undo = _snapshot(models, optimizers)
    try:
        _load_validated(checkpoint, models, optimizers)
        _apply_scalers(scalers)
    except BaseException:
        _restore(undo, models, optimizers)
        raise


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _clone_tree(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tree(v) for v in value)
    return value


def _snapshot(models: list, optimizers: list) -> tuple:
    """Copies of what load_checkpoint_state changes (a loader may update tensors in place)."""
    scalers = [((s.state.get_scale(), s.state.get_growth_tracker(), s.state.get_hysteresis_tracker(),
                 s.state.get_skipped()), (s.state.hysteresis, s.state.min_scale, s.state.max_scale))
               for s in _amp_state.loss_scalers]
    return ([_clone_tree(m.state_dict()) for m in models], [_clone_tree(o.state_dict()) for o in optimizers],
            [[m.detach().clone() for m in _swap_masters(o)] for o in optimizers], scalers)


def _restore(undo: tuple, models: list, optimizers: list) -> None:
    model_states, optimizer_states, masters, scalers = undo
    with torch.no_grad(), _optimizer.refresh_suspended():
        for m, saved in zip(models, model_states):
            m.load_state_dict(saved)
        for o, saved, ms in zip(optimizers, optimizer_states, masters):
            o.load_state_dict(saved)
            for cur, old in zip(_swap_masters(o), ms):
                cur.copy_(old)
    for s, (values, (hysteresis, min_scale, max_scale)) in zip(_amp_state.loss_scalers, scalers):
        s.state.hysteresis, s.state.min_scale, s.state.max_scale = hysteresis, min_scale, max_scale
        s.state.set_values(*values)


def _load_validated(checkpoint: dict, models: list, optimizers: list) -> None:
    for o, saved in zip(optimizers, checkpoint["optimizers"]):
        o.load_state_dict(saved)
    with torch.no_grad(), _optimizer.refresh_suspended():
        # The masters come from the checkpoint, not from the (rounded) model values.
        for m, saved in zip(models, checkpoint["models"]):
            m.load_state_dict(saved)
        for o, masters in zip(optimizers, checkpoint["masters"]):
            stash = getattr(o, "_amp_stash", None)
            if stash is not None and stash.kind == SWAP:
                for cur, saved_m, low in zip(stash.low_masters, masters, stash.low_params):
                    cur.copy_(saved_m)
                    low.copy_(cur)
