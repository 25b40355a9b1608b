"""amp.initialize: Apex's signature and opt-level semantics, with the low-precision dtype chosen
by ``dtype=`` (float16 or bfloat16); casts models, patches their forward, processes optimizers
and creates the loss scalers."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Optional

import torch

from ..distributed import has_dtensor_params
from . import _fp8
from ._casts import apply_registry, patch_forward
from ._layers import use_layer_kernels
from ._o1_handle import InitializeHandle, NoOpHandle
from ._o1_patch import STATE as cast_state
from ..optimizers import FusedOptimizer
from ._optimizer import OPTIMIZER_TYPES, refresh_masters_from_model
from ._process import process_optimizer
from ._properties import LOW_DTYPES, Properties, logger, opt_levels, warn_or_err
from ._scaler import LossScaler, _amp_state, _is_rank0
from ._undo import InitializeUndo


def _maybe_log(msg: str, verbosity: int) -> None:
    if verbosity > 0 and _is_rank0():
        logger.info(msg)


def _resolve_dtype(dtype: Optional[torch.dtype], cast_model_type: Any) -> torch.dtype:
    if dtype is not None and dtype not in LOW_DTYPES:
        raise ValueError(f"amp.initialize: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    if cast_model_type in LOW_DTYPES:
        if dtype is not None and dtype != cast_model_type:
            raise ValueError(f"amp.initialize: dtype={dtype} conflicts with cast_model_type={cast_model_type}")
        return cast_model_type
    return dtype if dtype is not None else torch.float16


def _check_flags(**flags: Any) -> None:
    # Apex tested these for truth, so enabled="False" or master_weights="False" (a config file, an
    # argparse string) silently meant True; only bools, 0/1 and None (the opt level's value) pass
    # (and master_weights="remainder", the lean form, which the caller checks on its own).
    for name, v in flags.items():
        if not (v is None or isinstance(v, bool) or (isinstance(v, numbers.Integral) and v in (0, 1))):
            default = "" if name == "enabled" else " (or None: the opt level's choice)"
            if name == "master_weights":
                default += " or 'remainder'"
            raise TypeError(f"amp.initialize: {name} must be True or False{default}, got {v!r}")


def _check_loss_scale_bounds(min_loss_scale: Any, max_loss_scale: Any) -> None:
    for name, v in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
        if v is None and name == "min_loss_scale":
            continue
        # numbers.Real: numpy scalars too (a sweep's np.float32), not bools.
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"amp.initialize: {name} must be a positive finite number, got {v!r}")
    if min_loss_scale is not None and max_loss_scale < min_loss_scale:
        raise ValueError(f"amp.initialize: max_loss_scale ({max_loss_scale}) < min_loss_scale ({min_loss_scale})")


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
               cast_model_outputs=None, num_losses=1, verbosity=1, min_loss_scale=None, max_loss_scale=2.**24,
               *, dtype: Optional[torch.dtype] = None, scale_history: int = 0, process_group: Any = None,
               layer_kernels: Optional[bool] = None, fp8: Any = None):
    """Initializes models and optimizers for mixed precision, as ``apex.amp.initialize`` did.

    Returns the models and optimizers in the shape given (one, a list, or the model alone when
    ``optimizers`` is None): the same objects, changed in place. Opt levels:

    - ``O0``: fp32 throughout (a baseline).
    - ``O1``: fp32 weights; the model's forward runs under ``torch.autocast`` (ops in fp16/bf16
      where safe, fp32 where not; torch's functions are not patched); dynamic loss scaling.
      The forward's floating outputs are cast to fp32, so that the loss, computed outside the
      forward, runs in fp32 as Apex's patched loss functions made it (and a loss such as
      ``mse_loss(fp16 output, fp32 target)``, which fails in backward on CUDA, works); pass
      ``cast_model_outputs=torch.float16`` (or bfloat16) to keep them low.
    - ``O2``: the model cast to fp16/bf16 except BatchNorm; fp32 master weights (a mixprec fused
      optimizer keeps them itself and writes the model copy in its kernel; any other optimizer
      gets Apex's masters in its param groups, copied to the model after each step); inputs cast
      to the low dtype and outputs to fp32; dynamic loss scaling.
    - ``O3``: pure fp16/bf16 (outputs still cast to fp32, as Apex did); static scale 1.

    mixprec's keywords: ``dtype=torch.bfloat16`` picks bfloat16 at every level (O2/O3 also
    accept ``cast_model_type=torch.bfloat16``); loss scaling is then off by default (a static
    scale of 1: no check, no skip) unless ``loss_scale="dynamic"`` is passed. ``scale_history=n``
    keeps each loss scaler's last n (scale, overflow) pairs on the device for
    :func:`mixprec.amp.scale_history`. Under torch.distributed every overflow check is agreed
    over ``process_group`` (None: the world group; ``mixprec.distributed.LOCAL``: none), so all
    ranks skip the same steps: wrap the model in DistributedDataParallel after this call
    (docs/distributed.md). Under FSDP2, O2/O3 go through ``fully_shard``'s MixedPrecisionPolicy
    (``mixprec.distributed.mixed_precision_policy``) instead. ``layer_kernels`` (default: on
    where the model is cast, O2 and O3) turns every plain ``nn.Linear`` and ``nn.LayerNorm`` into
    a subclass that runs on mixprec's layer kernels (:func:`mixprec.linear`,
    :func:`mixprec.layer_norm`): the same math, faster bias and LayerNorm gradients; pass False to
    keep torch's.
    ``fp8=True`` (or a :class:`mixprec.fp8.Fp8Recipe`) at O2/O3, bfloat16 by default, also turns
    every eligible ``nn.Linear`` into a :class:`mixprec.fp8.Fp8Linear` (docs/fp8.md).

    Overrides are validated as Apex did (an O1 with master weights, a patched-function request
    outside O1, ... raise RuntimeError). Overflowing steps are skipped on the device with no
    host synchronization; a rate-limited "Gradient overflow" warning goes to the logger
    ``mixprec.amp`` on rank 0 (``verbosity=0`` silences it).
    """
    # Everything is checked before anything changes: a refused call leaves amp's globals, the
    # models and the optimizers as they were, so an earlier initialize stays in force.
    if isinstance(verbosity, bool) or not isinstance(verbosity, numbers.Integral) or verbosity < 0:
        raise ValueError(f"amp.initialize: verbosity must be an int >= 0 (0 silent, 1 default, 2 verbose), "
                         f"got {verbosity!r}")
    _check_flags(enabled=enabled, patch_torch_functions=patch_torch_functions,
                 master_weights=None if master_weights == "remainder" else master_weights)
    if not enabled:
        # Apex: a disabled amp is an initialized amp whose scale_loss and steps do nothing extra.
        _amp_state.reset(Properties(), int(verbosity), process_group)
        _amp_state.handle = _handle_for_initialize(NoOpHandle)
        return models if optimizers is None else (models, optimizers)
    if opt_level not in opt_levels:
        raise RuntimeError(f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note "
                           "that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero.")
    if isinstance(num_losses, bool) or not isinstance(num_losses, numbers.Integral) or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be a positive int, got {num_losses!r}")
    num_losses = int(num_losses)  # numpy ints too, as Apex's range(num_losses) took them
    _check_loss_scale_bounds(min_loss_scale, max_loss_scale)
    min_loss_scale = None if min_loss_scale is None else float(min_loss_scale)
    max_loss_scale = float(max_loss_scale)
    if cast_model_outputs is not None and cast_model_outputs not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"amp.initialize: cast_model_outputs must be a floating dtype, got {cast_model_outputs!r}")
    low = _resolve_dtype(_fp8.default_dtype(fp8, dtype, cast_model_type), cast_model_type)
    if layer_kernels is not None and not isinstance(layer_kernels, bool):
        raise TypeError(f"amp.initialize: layer_kernels must be True, False or None, got {layer_kernels!r}")
    if isinstance(scale_history, bool) or not isinstance(scale_history, numbers.Integral) or scale_history < 0:
        raise ValueError(f"amp.initialize: scale_history must be an int >= 0, got {scale_history!r}")
    scale_history = int(scale_history)

    props = opt_levels[opt_level](Properties(), low)
    # Apex's order of overrides; each setter validates against the opt level.
    if cast_model_type is not None:
        props.cast_model_type = cast_model_type
    if patch_torch_functions is not None:
        props.patch_torch_functions = patch_torch_functions
    if keep_batchnorm_fp32 is not None:
        props.keep_batchnorm_fp32 = keep_batchnorm_fp32
    if master_weights is not None:
        props.master_weights = master_weights
    if loss_scale is not None:
        props.loss_scale = loss_scale
    # Only an explicit master_weights=True is refused without a cast: O2's own default with
    # cast_model_type=False keeps, as in Apex, fp32 masters for the params that arrive in fp16/bf16.
    if master_weights and props.cast_model_type in (None, False, torch.float32):
        warn_or_err("master_weights=True needs a model cast to float16 or bfloat16 (opt_level O2, or "
                    "cast_model_type=torch.float16/bfloat16).")
    cast = props.cast_model_type if props.cast_model_type in LOW_DTYPES else None
    props.fp8 = _fp8.checked_request(fp8, props.opt_level, cast)
    if layer_kernels and cast is None:
        # autocast (O1) does not know mixprec's ops: the layers would run in fp32.
        raise ValueError(f"amp.initialize: layer_kernels=True needs a model cast to float16 or bfloat16 (O2, O3); "
                         f"opt_level {props.opt_level} does not cast it")
    model_list, models_was_list = _as_list(models, "models", torch.nn.Module)
    if optimizers is None:
        optimizer_list, optimizers_was_list = [], False
    else:
        optimizer_list, optimizers_was_list = _as_list(optimizers, "optimizers", OPTIMIZER_TYPES)
    _check_targets(model_list, optimizer_list, props)
    if props.master_weights == "remainder":
        _check_remainder(optimizer_list, cast)
    _check_rounding(optimizer_list, cast, props.master_weights)
    scalers = [LossScaler(props.loss_scale, i, min_loss_scale, max_loss_scale, scale_history)
               for i in range(num_losses)]

    # What is left to fail is the models' and optimizers' own code (a module's _apply, an
    # optimizer's state_dict) and the casts themselves (memory): all or nothing, so a call that
    # raises partway leaves no half-cast model, half-patched optimizer or uninitialized amp.
    undo = InitializeUndo(model_list, optimizer_list)
    try:
        _amp_state.reset(None, int(verbosity), process_group)  # not initialized while the models change
        _amp_state.min_loss_scale = min_loss_scale
        _amp_state.max_loss_scale = max_loss_scale
        _maybe_log(f"Selected optimization level {opt_levels[opt_level].brief}", verbosity)
        _maybe_log("After processing overrides, optimization options are:\n" +
                   "\n".join(f"{k:22} : {v}" for k, v in props.options.items()) + f"\n{'dtype':22} : {low}",
                   verbosity)
        optimizer_list = _initialize(model_list, optimizer_list, props, low, cast_model_outputs, layer_kernels)
        _amp_state.loss_scalers = scalers
        _amp_state.dtype = low
        _amp_state.opt_properties = props
        _amp_state.handle = _handle_for_initialize(InitializeHandle)
    except BaseException:
        undo.restore()
        raise

    if optimizers_was_list:
        return (model_list if models_was_list else model_list[0]), optimizer_list
    if len(optimizer_list) == 0:
        return model_list if models_was_list else model_list[0]
    return (model_list if models_was_list else model_list[0]), optimizer_list[0]


def _handle_for_initialize(kind: type):
    # An amp.init() handle that still patches torch stays the one Apex-era code finds.
    return cast_state.handle if cast_state.handle is not None else kind()


def _is_bn(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.affine is True


def _computes_in_fp32(module: torch.nn.Module) -> bool:
    """transformers' rotary position embeddings (LlamaRotaryEmbedding and its kin): parameterless,
    their forward multiplies positions by ``inv_freq`` in fp32 and casts cos/sin to the input's
    dtype itself. Rounded to bf16, inv_freq would turn the angles at position 1024 by up to a
    radian (cos off by 1.16 at head_dim 128); torch.amp, and transformers' own loading in bf16,
    keep it fp32."""
    cls = type(module)
    return (cls.__module__.startswith("transformers.") and cls.__name__.endswith("RotaryEmbedding")
            and not module._parameters and isinstance(getattr(module, "inv_freq", None), torch.Tensor))


def convert_network(network: torch.nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Casts floating params, their grads and buffers to ``dtype`` in place (same Parameter
    objects, so optimizers still hold them), leaving affine BatchNorms in fp32 when asked and
    transformers' rotary embeddings in fp32 (above). Each module is cast through its own
    ``_apply``, as ``module.to(dtype)`` casts it: modules that keep some tensors in fp32 on a cast
    (timm's rotary embeddings rebuild their frequency bands in fp32) have their say."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    # With torch.__future__'s overwrite flag on, _apply would put new Parameter objects in the
    # modules, and the optimizers would go on updating the old ones.
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(False)
    try:
        for module in network.modules():
            if (keep_batchnorm_fp32 and _is_bn(module)) or _computes_in_fp32(module):
                continue
            module._apply(cast, recurse=False)  # RNNs re-flatten their weights in their _apply
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


def _fp32_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    # Apex's O2StateDictHook: model.state_dict() gives fp32 values under O2/O3, same keys.
    for name in list(module._parameters) + list(module._buffers):
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and value.dtype in LOW_DTYPES:
            state_dict[key] = value.to(torch.float32)


def _as_list(value, what: str, cls) -> tuple[list, bool]:
    if isinstance(value, cls):
        return [value], False
    if isinstance(value, list) and all(isinstance(v, cls) for v in value):
        return value, True
    raise TypeError(f"{what} must be either a single {'model' if what == 'models' else 'optimizer'} or a list of "
                    f"{what}. (amp.initialize: {what} is a {type(value).__name__})")


def _check_targets(models: list, optimizers: list, props: Properties) -> None:
    """The checks on the models and optimizers themselves, made before any of them changes."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    for index, model in enumerate(models):
        if isinstance(model, parallel):
            raise RuntimeError(f"Incoming model is an instance of {type(model).__module__}.{type(model).__name__}. "
                               "Parallel wrappers should only be applied to the model(s) AFTER the model(s) have "
                               "been returned from amp.initialize.")
        if props.cast_model_type in LOW_DTYPES and has_dtensor_params(model):
            raise RuntimeError(f"amp.initialize: opt_level {props.opt_level} casts the model, but its parameters are "
                               "DTensors (fully_shard): FSDP2 owns their storage. Use fully_shard(..., mp_policy="
                               "mixprec.distributed.mixed_precision_policy('O2', dtype)) and no amp.initialize; see "
                               "docs/distributed.md")
        for name, param in model.named_parameters():
            if param.is_inference():
                # Otherwise the first scaled step fails inside an op ("Inference tensors do not track
                # version counter"), after amp cast the model.
                raise RuntimeError(f"amp.initialize: models[{index}] parameter {name} was created under "
                                   "torch.inference_mode() and cannot be trained; build the model outside "
                                   "inference_mode (or replace its parameters with clones made outside it)")
        if _amp_state.allow_incoming_model_not_fp32:
            continue  # Apex's escape hatch for models that arrive in fp16/bf16 on purpose
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != torch.float32:
                warn_or_err(f"Found param {name} with type {param.dtype}, expected torch.float32 (amp.initialize: "
                            f"models[{index}]).\nWhen using amp.initialize, you do not need to call .half() on your "
                            "model\nbefore passing it, no matter what optimization level you choose; a model that "
                            "already went through amp.initialize at O2 or O3 is cast: pass each model once (or set "
                            "amp._amp_state.allow_incoming_model_not_fp32 = True to pass it anyway).")
    seen: set[int] = set()
    for i, opt in enumerate(optimizers):
        if hasattr(opt, "_amp_stash") or id(opt) in seen:
            raise RuntimeError(f"A given optimizer should only be passed through amp.initialize once (optimizers[{i}], "
                               f"{type(opt).__name__}, was passed before).")
        seen.add(id(opt))


def _initialize(models: list, optimizers: list, props: Properties, low: torch.dtype, cast_model_outputs,
                layer_kernels: Optional[bool] = None) -> list:
    """Casts and patches validated models, processes the optimizers; returns the optimizers."""
    cast = props.cast_model_type if props.cast_model_type in LOW_DTYPES else None
    originals: dict[torch.Tensor, torch.Tensor] = {}
    if cast is not None:
        keep_bn = bool(props.keep_batchnorm_fp32)
        if props.master_weights:
            for model in models:  # fp32 values before the cast become the masters
                for module in model.modules():
                    if keep_bn and _is_bn(module):
                        continue
                    for p in module.parameters(recurse=False):
                        if p.is_floating_point() and p.dtype == torch.float32:
                            originals[p] = p.detach().clone()
        for model in models:
            convert_network(model, cast, keep_bn)
    if layer_kernels if layer_kernels is not None else cast is not None:
        for model in models:
            use_layer_kernels(model)
    _fp8.after_cast(models, props, _amp_state.verbosity)
    output_dtype = cast_model_outputs
    for model in models:
        if props.patch_torch_functions:
            patch_forward(model, autocast_dtype=low, output_dtype=output_dtype or torch.float32)
        elif props.cast_model_type:
            patch_forward(model, input_dtype=props.cast_model_type, output_dtype=output_dtype or torch.float32)
        elif output_dtype is not None:
            patch_forward(model, output_dtype=output_dtype)
        if cast is not None:
            for module in model.modules():
                module.register_state_dict_post_hook(_fp32_state_dict_hook)

    optimizers = list(optimizers)
    for i, opt in enumerate(optimizers):
        if cast is not None and not props.master_weights and opt.state:
            opt.load_state_dict(opt.state_dict())  # recast existing per-param state (Apex's trick)
        mode = props.master_weights if props.master_weights == "remainder" else bool(props.master_weights)
        optimizers[i] = process_optimizer(opt, mode, originals)
    if props.master_weights and optimizers:
        for model in models:
            model.register_load_state_dict_post_hook(
                functools.partial(_refresh_hook, optimizers=list(optimizers)))
    if props.patch_torch_functions:
        apply_registry()
    return optimizers


def _check_remainder(optimizers: list, cast: Any) -> None:
    """master_weights='remainder' (bf16 weights plus the low halves of their fp32 masters, kept by
    a mixprec fused optimizer's kernel): refused, before anything changes, where it cannot hold."""
    if cast is not torch.bfloat16:
        raise ValueError(f"amp.initialize: master_weights='remainder' needs cast_model_type=torch.bfloat16 (it "
                         f"keeps the low 16 bits of bf16 weights' fp32 masters); the model is cast to {cast}")
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, FusedOptimizer):
            raise ValueError(f"amp.initialize: master_weights='remainder' needs mixprec fused optimizers; optimizer "
                             f"{i} is {type(opt).__name__}")


def _check_rounding(optimizers: list, cast: Any, master_weights: Any) -> None:
    """A fused optimizer's rounding='stochastic' rounds bfloat16 weights kept without masters (O3,
    or O2 with master_weights=False, at bfloat16): refused here, before anything changes, where
    the level would make every step refuse it (masters on, or weights cast to float16)."""
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, FusedOptimizer):
            continue
        for j, group in enumerate(opt.param_groups):
            if group.get("rounding") != "stochastic":
                continue
            where = f"amp.initialize: optimizer {i} param group {j} has rounding='stochastic'"
            if master_weights:
                raise ValueError(f"{where}, which rounds weights kept without masters; this level keeps fp32 "
                                 "masters (O2): use opt_level='O3' (or master_weights=False) with "
                                 "cast_model_type=torch.bfloat16, or rounding='nearest'")
            if cast is not None and cast is not torch.bfloat16:
                raise ValueError(f"{where}, which rounds to bfloat16; the model is cast to {cast}: pass "
                                 "cast_model_type=torch.bfloat16 (or dtype=torch.bfloat16)")


def _refresh_hook(module, incompatible_keys, *, optimizers):
    refresh_masters_from_model(optimizers, module)
