"""amp.initialize(..., fp8=True): O2/O3 (bfloat16 by default) with every eligible nn.Linear in
FP8, and the FP8 scaling state's place in amp.state_dict(); amp.initialize and the checkpoint
code call in here. A keyword, not an opt level "O4": ROCm's Apex already spells bf16 O1 and O2
"O4" and "O5", and code written for it must not silently get FP8 here."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ._scaler import _is_rank0

logger = logging.getLogger("mixprec.amp")

#: The key of the FP8 layers' scaling state in amp.state_dict().
KEY = "fp8"


class _Registry:
    """The FP8 layers of the models amp initialized last, by "<model index>.<module name>"."""

    def __init__(self) -> None:
        self.layers: dict[str, Any] = {}


REGISTRY = _Registry()


def default_dtype(fp8: Any, dtype: Optional[torch.dtype], cast_model_type: Any) -> Optional[torch.dtype]:
    """FP8 runs beside bfloat16 unless dtype= or cast_model_type= says otherwise."""
    if fp8 not in (None, False) and dtype is None and cast_model_type is None:
        return torch.bfloat16
    return dtype


def checked_request(fp8: Any, opt_level: str, cast: Optional[torch.dtype]):
    """amp.initialize's fp8 argument as a recipe (None: off), or an error naming it."""
    from ..fp8 import Fp8Recipe

    if fp8 is None or fp8 is False:
        return None
    if fp8 is not True and not isinstance(fp8, Fp8Recipe):
        raise TypeError(f"amp.initialize: fp8 must be True, False, None or a mixprec.fp8.Fp8Recipe, got {fp8!r}")
    if cast is None:
        raise ValueError(f"amp.initialize: fp8 needs a model cast to bfloat16 or float16 (opt_level O2 or O3); "
                         f"opt_level {opt_level} does not cast it")
    return Fp8Recipe() if fp8 is True else fp8


def after_cast(models: list, props, verbosity: int) -> None:
    """With fp8, turns the eligible Linears of the cast models into Fp8Linear and logs the rest;
    always records the models' FP8 layers (converted here, or by mixprec.fp8.convert before
    amp.initialize) for amp.state_dict()."""
    from .. import fp8

    recipe = getattr(props, "fp8", None)
    REGISTRY.layers = {}
    for index, model in enumerate(models):
        if recipe is not None:
            converted, skipped = fp8.convert(model, recipe)
            if verbosity > 0 and _is_rank0():
                lines = "".join(f"\n  {name or '(model)'}: {why}" for name, why in skipped.items())
                logger.info(f"fp8: models[{index}]: {len(converted)} nn.Linear in FP8 ({recipe}), {len(skipped)} "
                            f"left in {props.cast_model_type} (not eligible){':' if skipped else '.'}{lines}")
        for name, module in model.named_modules():
            if isinstance(module, fp8.Fp8Linear):
                REGISTRY.layers[f"{index}.{name}"] = module


def save_into(destination: dict) -> None:
    if REGISTRY.layers:
        destination[KEY] = {name: {k: v.detach().clone() for k, v in m.fp8_state.state_dict().items()}
                            for name, m in REGISTRY.layers.items()}


def validated(state: dict, where: str) -> Optional[dict]:
    """The FP8 part of an amp state dict, checked whole against the FP8 layers amp holds (same
    names, shapes of this recipe, finite positive scales); None when there is none."""
    if KEY not in state:
        return None
    entry = state[KEY]
    if not isinstance(entry, dict):
        raise ValueError(f"{where}[{KEY!r}] must be a dict of FP8 layer states, got {type(entry).__name__}")
    missing = sorted(set(REGISTRY.layers) - set(entry))
    unexpected = sorted(set(entry) - set(REGISTRY.layers))
    if missing or unexpected:
        raise ValueError(f"{where}[{KEY!r}] does not match the FP8 layers amp initialized: missing {missing}, "
                         f"unexpected {unexpected}")
    for name, layer in REGISTRY.layers.items():
        layer.fp8_state.check_state_dict(entry[name], f"{where}[{KEY!r}][{name!r}]")
    return entry


def apply(entry: dict) -> None:
    for name, layer in REGISTRY.layers.items():
        layer.fp8_state.load_state_dict(entry[name])
