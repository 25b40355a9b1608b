"""amp's FP8 opt level O4 (bf16 O2 plus every eligible nn.Linear in FP8) and the FP8 scaling
state's place in amp.state_dict(); amp.initialize and the checkpoint code call in here."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ._scaler import _is_rank0

logger = logging.getLogger("mixprec.amp")

#: The key of the FP8 layers' scaling state in amp.state_dict().
KEY = "fp8"


class O4:
    brief = "O4:  O2 in bfloat16 with every eligible nn.Linear running its GEMMs in FP8.\n"
    more = ("Everything O2 does (the model cast to bf16 except BatchNorm, fp32 master weights in the\n"
            "optimizer), then every nn.Linear whose in_features and out_features are multiples of 16\n"
            "becomes a mixprec.fp8.Fp8Linear: E4M3 inputs and weights, E5M2 output gradients, per-tensor\n"
            "current scaling, fp32 accumulation (torch._scaled_mm on Hopper). The others stay bf16 and\n"
            "are listed. Pass dtype=torch.float16 for fp16 with dynamic loss scaling instead.")

    def __call__(self, properties, low: torch.dtype):
        properties.enabled = True
        properties.opt_level = "O4"
        properties.cast_model_type = low
        properties.patch_torch_functions = False
        properties.keep_batchnorm_fp32 = True
        properties.master_weights = True
        properties.loss_scale = "dynamic" if low == torch.float16 else 1.0
        return properties


class _Registry:
    """The FP8 layers of the models amp initialized last, by "<model index>.<module name>"."""

    def __init__(self) -> None:
        self.layers: dict[str, Any] = {}


REGISTRY = _Registry()


def default_dtype(opt_level: str, dtype: Optional[torch.dtype], cast_model_type: Any) -> Optional[torch.dtype]:
    """O4 is a bfloat16 level unless dtype= or cast_model_type= says otherwise."""
    if opt_level == "O4" and dtype is None and cast_model_type is None:
        return torch.bfloat16
    return dtype


def after_cast(models: list, props, verbosity: int) -> None:
    """Under O4, turns the eligible Linears of the cast models into Fp8Linear and logs the rest;
    at every level, records the models' FP8 layers (converted here or by mixprec.fp8.convert
    before amp.initialize) for amp.state_dict()."""
    from .. import fp8

    REGISTRY.layers = {}
    for index, model in enumerate(models):
        if props.opt_level == "O4":
            converted, skipped = fp8.convert(model)
            if verbosity > 0 and _is_rank0():
                lines = "".join(f"\n  {name or '(model)'}: {why}" for name, why in skipped.items())
                logger.info(f"O4: models[{index}]: {len(converted)} nn.Linear in FP8, {len(skipped)} left in "
                            f"{props.cast_model_type} (not eligible){':' if skipped else '.'}{lines}")
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
