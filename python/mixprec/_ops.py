"""Typed Python wrappers of torch.ops.mixprec.*: one function per op, documented once here.

Every function is a thin call through the dispatcher, so the same kernels serve Python, C++ and
torch.compile. Device scalars (found_inf, inv_scale, ...) are one-element float32 tensors on the
device of the tensor lists. DTensors (FSDP2's sharded parameters) are taken by their local
shards (see ``_dtensor.local_lists``); where an op needs norms of whole tensors, the norms of the
shards are reduced across ranks between the op's passes (``_dtensor.reduce_shard_norms``).
"""

from __future__ import annotations

import operator
import threading
from typing import Optional, Sequence

import torch

from . import _library
from ._dtensor import local_lists, reduce_shard_norms, shard_layout

_library.load()


class _Overloads:
    """``torch.ops.mixprec``'s ops as their one overload each (``.default``), looked up once.
    Calling an OpOverload skips the OpOverloadPacket's per-call overload resolution: a few us
    a call on the host, paid by every op of every training step."""

    def __getattr__(self, name: str):
        op = getattr(torch.ops.mixprec, name).default
        setattr(self, name, op)
        return op


_ops = _Overloads()


class _OptimOp:
    """One fused optimizer op (``<family>_``, or its validate-only twin ``<family>_check``) called
    with its arguments picked by name from a wrapper's locals, in its schema's order: the keyword
    block of every optimizer wrapper comes from the schema (built in C++ from the family's
    declaration in mixprec/optim_args.h), so the wrappers never spell it out. Names the wrapper
    lacks (a hyper-parameter newer than its signature) take the schema's default."""

    def __init__(self, name: str):
        args = getattr(_ops, name)._schema.arguments
        self.op = getattr(_ops, name)
        self.positional = tuple(a.name for a in args if not a.kwarg_only)
        self.keywords = tuple(a.name for a in args if a.kwarg_only)

    def __call__(self, values: dict) -> None:
        self.op(*[values[n] for n in self.positional], **{n: values[n] for n in self.keywords if n in values})


# Every optimizer op and twin, looked up at import: torch.compile then traces only the calls.
_OPTIM_OPS = {name + suffix: _OptimOp(name + suffix)
              for name in ("adam", "sgd", "lamb", "adagrad", "novograd") for suffix in ("_", "_check")}


# A FusedOptimizer recording the op calls of a step, to hold them in C++ for the next steps
# (optimizers/_held.py), sets ``recorder.record`` (per thread) for the length of that step.
recorder = threading.local()


def _optim_step(family: str, validate_only: bool, values: dict) -> None:
    """Runs ``torch.ops.mixprec.<family>_`` (validate_only: ``<family>_check``, which makes every
    check of the step, layouts and aliasing included, and writes nothing) with ``values``."""
    record = getattr(recorder, "record", None)
    if record is not None and not validate_only:
        record(family, values)
    _OPTIM_OPS[family + ("_check" if validate_only else "_")](values)


def non_finite_check_and_unscale_(
    grads: Sequence[torch.Tensor],
    found_inf: Optional[torch.Tensor],
    inv_scale: Optional[torch.Tensor] = None,
    out: Sequence[torch.Tensor] = (),
    per_tensor_found: Optional[torch.Tensor] = None,
) -> None:
    """Sets ``found_inf`` to 1 if any element of ``grads`` is inf or NaN, in one pass.

    With ``inv_scale`` the gradients are also multiplied by it: in place, or into ``out`` (same
    shapes, any of float32/float16/bfloat16, e.g. fp32 master gradients from fp16 grads). With
    ``out`` and no ``inv_scale`` they are copied (converted) into ``out``; with neither, the op
    only reads. ``per_tensor_found`` (float32, ``len(grads)``) gets a 1 for each tensor that held
    a non-finite value, at no extra pass. Like ``found_inf`` it is only ever set, never cleared:
    zero both before a step. ``found_inf=None`` gives pure scaling.
    """
    grads, out = local_lists("non_finite_check_and_unscale_", (grads, out))
    _ops.non_finite_check_and_unscale_(grads, found_inf, inv_scale, out, per_tensor_found)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    hysteresis: int = 1,
    hysteresis_tracker: Optional[torch.Tensor] = None,
    skipped_steps: Optional[torch.Tensor] = None,
    min_scale: float = 0.0,
    max_scale: float = 0.0,
) -> None:
    """Updates the loss scale on the device, with no host synchronization.

    On overflow (``found_inf`` != 0) the growth tracker resets and, on the ``hysteresis``-th
    overflow since the scale last changed, the scale is multiplied by ``backoff_factor`` (not
    below ``min_scale``). After ``growth_interval`` clean steps in a row it is multiplied by
    ``growth_factor`` (capped at ``max_scale`` unless 0, and never to inf). ``growth_tracker`` and
    ``hysteresis_tracker`` are int32, ``skipped_steps`` int64 (counts overflows). With
    ``hysteresis=1`` and no bounds this equals ``torch._amp_update_scale_``.
    """
    _ops.update_scale_(
        scale, growth_tracker, hysteresis_tracker, skipped_steps, found_inf,
        growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
    )


def _norm_ord(ord) -> float:
    """``ord`` as the op's float: "fro" is 2, as in torch.norm (the tensors' elements form one
    vector, whose Frobenius norm is its 2-norm); other strings and non-numbers are refused."""
    if isinstance(ord, str):
        if ord == "fro":
            return 2.0
        raise ValueError(f"mixprec::multi_tensor_norm: invalid ord {ord!r}; expected 2 (or 'fro', the same) or inf")
    if isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise TypeError(f"mixprec::multi_tensor_norm: ord is {type(ord).__name__}; expected 2 (or 'fro', the same) "
                        "or inf")
    return float(ord)


def multi_tensor_norm(
    tensors: Sequence[torch.Tensor], ord: float = 2.0, per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm (``ord`` 2, "fro" meaning 2 as in torch.norm, or inf) of all ``tensors``
    together, and of each one.

    Returns ``(total, per_tensor_norms)``: a 0-dim float32 tensor and a float32 vector of
    ``len(tensors)`` (empty unless ``per_tensor``). Accumulates in float32, deterministically.
    Sharded DTensors count whole: their shards' norms are combined across ranks (a collective
    every rank must join).
    """
    ord = _norm_ord(ord)
    layout = shard_layout(tensors)
    (tensors,) = local_lists("multi_tensor_norm", (tensors,))
    if layout is None:
        return _ops.multi_tensor_norm(tensors, ord, per_tensor)
    _, local_norms = _ops.multi_tensor_norm(tensors, ord, True)
    norms = reduce_shard_norms(layout, local_norms, ord)
    total = norms.amax() if ord != 2 else torch.linalg.vector_norm(norms)
    return total, norms if per_tensor else norms.new_empty(0)


def linear_bias_grad(grad: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a Linear layer from its output gradient ``grad`` [..., out_features]
    (float32, float16 or bfloat16, contiguous): ``grad`` summed over every dimension but the last,
    accumulated in float32 in a fixed order (the same result on every run of a GPU model) and
    rounded once to ``grad``'s dtype. Equals ``grad.reshape(-1, out_features).sum(0)`` up to
    the order of the additions."""
    if grad.dim() < 1:
        raise ValueError("mixprec::linear_bias_grad: grad must have an out_features dimension, "
                         "got a 0-dim tensor")
    return _ops.linear_bias_grad(grad.reshape(-1, grad.shape[-1]) if grad.dim() != 2 else grad)


def linear_weight_bias_grad(grad: torch.Tensor, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear layer's weight and bias gradients from its output gradient ``grad``
    [rows, out_features] and its ``input`` [rows, in_features] (2-D, contiguous, one dtype):
    ``(grad.t() @ input, grad.sum(0))``. On CUDA in float16/bfloat16 one cuBLASLt GEMM computes
    both, the bias sum in the GEMM's epilogue (no second pass over ``grad``); elsewhere torch's mm
    and :func:`linear_bias_grad`."""
    return _ops.linear_weight_bias_grad(grad, input)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` whose backward computes the bias gradient with
    :func:`linear_bias_grad` (torch's ``sum(0)`` for float64). The forward and the backward's two
    GEMMs are ATen's own calls; the autograd node is C++, as torch's is. (Not
    :func:`linear_weight_bias_grad`: its GEMM was slower than torch's mm on some of GPT-2's shapes.)"""
    return _ops.linear(input, weight, bias)


def _norm_args(call: str, input: torch.Tensor, normalized_shape) -> list[int]:
    """normalized_shape as the op's int list, after the checks whose failures would otherwise read
    as some other error (a str split into digits, a float "not iterable", a sparse layout)."""
    if isinstance(input, torch.Tensor) and input.layout != torch.strided:
        raise ValueError(f"{call}: input must be a dense (strided) tensor, got layout {input.layout}")
    if isinstance(input, torch.Tensor) and not input.is_floating_point():
        # Otherwise ATen's kernel lookup answers ("... not implemented for 'Long'").
        raise TypeError(f"{call}: input has dtype {input.dtype}; expected float32, float16, bfloat16 or float64")
    dims = normalized_shape if isinstance(normalized_shape, Sequence) else [normalized_shape]
    try:
        if isinstance(dims, (str, bytes)) or any(isinstance(d, bool) for d in dims):
            raise TypeError
        return [operator.index(d) for d in dims]  # ints, numpy ints, 0-dim integer tensors
    except TypeError:
        raise TypeError(f"{call}: normalized_shape must be an int or a sequence of ints, "
                        f"got {normalized_shape!r}") from None


def layer_norm(input: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` on mixprec's kernels: one warp per row, statistics and
    gradients in float32, and the weight and bias gradients as deterministic sums accumulated
    while the input gradient is computed. float64 inputs, and on CUDA normalized sizes past
    12288, use torch's LayerNorm. The autograd node is C++, as torch's is."""
    return _ops.layer_norm(input, _norm_args("mixprec.layer_norm", input, normalized_shape), weight, bias, float(eps))


def scale_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiplies every tensor in place by the device scalar ``scale`` (e.g. a clip coefficient)."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        what = (f"a {scale.dtype} tensor of {scale.numel()} elements" if isinstance(scale, torch.Tensor)
                else type(scale).__name__)
        raise TypeError(f"mixprec.scale_: scale must be a one-element float32 tensor on the tensors' device, "
                        f"got {what}")
    if torch.is_grad_enabled():
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # The op writes outside autograd (no version bump): a graph that saved the tensor would
                # compute wrong gradients without a word; torch refuses in-place writes to such leaves.
                raise RuntimeError(f"mixprec.scale_: tensors[{i}] requires grad while grad mode is on; scale_ writes "
                                   "in place outside autograd: pass gradients, or call it under torch.no_grad()")
    (tensors,) = local_lists("scale_", (tensors,))
    _ops.non_finite_check_and_unscale_(tensors, None, scale, [], None)


def adam_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    maximize: bool = False,
    max_exp_avg_sqs: Sequence[torch.Tensor] = (),
    master_params: Sequence[torch.Tensor] = (),
    step_tensor: Optional[torch.Tensor] = None,
    step: int = 0,
    lr_tensor: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    validate_only: bool = False,
    exp_avg_scales: Sequence[torch.Tensor] = (),
    exp_avg_sq_scales: Sequence[torch.Tensor] = (),
) -> None:
    """One fused Adam (``adam_w_mode=False``: L2 decay) or AdamW step over lists of tensors.

    Grads are divided by ``grad_scale`` inside the kernel; when ``found_inf`` is non-zero nothing
    changes. With ``master_params`` (fp32) the masters are updated and ``params`` (fp16/bf16/fp32)
    receive the rounded result in the same pass. ``step_tensor`` (float32, one element) is
    incremented on the device unless ``found_inf`` is set and used for bias correction; without
    it the host ``step`` (counting this step) is used. amsgrad is on when ``max_exp_avg_sqs`` is
    given. Moments are float32, or bfloat16 to save memory, or 8-bit: with ``exp_avg_scales`` and
    ``exp_avg_sq_scales`` (float32, one per 256 elements of each param) ``exp_avgs`` are int8 and
    ``exp_avg_sqs`` uint8 codes, dequantized, updated and requantized in the pass (no amsgrad;
    the code map is in docs/optimizers.md). An empty ``params`` (every other list
    empty too) is a step over nothing: the hyper-parameters are checked, nothing is touched.

    Lean weights (every optimizer op): a ``master_params`` entry may instead be an int16
    remainder, the low 16 bits of a bf16 param's fp32 master, which the kernel rebuilds from
    (param, remainder), updates and splits back (the param gets the nearest bf16, ties toward
    zero; kernels/optim_common.h). ``stochastic_rounding=True`` (no master_params) rounds the
    update of bf16 params stochastically, from a hash of (``seed``, step count, tensor index,
    element index): identical bits on CPU and CUDA, repeated after a checkpoint.

    ``validate_only=True`` (every optimizer op takes it) runs every check the step makes, with the
    same error class and message (hyper-parameter ranges, devices, dtypes, shapes, layouts,
    tensors shared between lists) and changes nothing: ``torch.ops.mixprec.adam_check``. A
    caller stepping several param groups validates them all first, so a bad group refuses the
    whole step before any group is updated.
    """
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales, exp_avg_sq_scales = (
        local_lists("adam_", (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, exp_avg_scales,
                              exp_avg_sq_scales)))
    _optim_step("adam", validate_only, locals())


def sgd_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    wd_after_momentum: bool = False,
    maximize: bool = False,
    master_params: Sequence[torch.Tensor] = (),
    step_tensor: Optional[torch.Tensor] = None,
    step: int = 0,
    lr_tensor: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    validate_only: bool = False,
) -> None:
    """One fused SGD step with torch.optim.SGD's semantics (the first step sets the momentum
    buffer to the gradient). ``momentum_buffers`` is empty when ``momentum == 0``. The shared
    arguments (master_params, step_tensor, step, lr_tensor, grad_scale, found_inf, validate_only)
    are as in :func:`adam_`."""
    params, grads, momentum_buffers, master_params = local_lists(
        "sgd_", (params, grads, momentum_buffers, master_params))
    _optim_step("sgd", validate_only, locals())


def lamb_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    max_grad_norm: float = 1.0,
    use_nvlamb: bool = False,
    master_params: Sequence[torch.Tensor] = (),
    step_tensor: Optional[torch.Tensor] = None,
    step: int = 0,
    lr_tensor: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    global_grad_norm: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    validate_only: bool = False,
) -> None:
    """One fused LAMB step. ``global_grad_norm`` (float32, one element) is the norm of the
    unscaled gradients over every group, used for clipping to ``max_grad_norm``; when None it
    is computed from ``grads``. Shared arguments as in :func:`adam_`.

    Sharded DTensors (FSDP2) take whole-tensor norms: the global gradient norm, and between the
    op's two passes each tensor's ||w|| and ||u||, are reduced across ranks (collectives every
    rank must join, queued on the device); ``validate_only`` runs no collective."""
    layout = None if validate_only else shard_layout(params)
    if layout is not None and params and global_grad_norm is None and 0.0 < max_grad_norm < float("inf"):
        # The whole gradients' norm (multi_tensor_norm reduces the shards'); the op takes it unscaled.
        global_grad_norm = multi_tensor_norm(grads)[0].reshape(1)
        if grad_scale is not None:
            global_grad_norm = global_grad_norm / grad_scale
    params, grads, exp_avgs, exp_avg_sqs, master_params = local_lists(
        "lamb_", (params, grads, exp_avgs, exp_avg_sqs, master_params))
    values = locals()
    if layout is None or not params or (weight_decay == 0.0 and not use_nvlamb):
        _optim_step("lamb", validate_only, values)  # unsharded, or no trust ratio: one call
        return
    local_norms = torch.empty((2, len(params)), dtype=torch.float32, device=params[0].device)
    _optim_step("lamb", False, dict(values, local_norms=local_norms))  # step count, moments; shards' ||w||, ||u||
    trust_norms = reduce_shard_norms(layout, local_norms, 2.0)
    _optim_step("lamb", False, dict(values, trust_norms=trust_norms))  # the update, with whole-tensor norms


def adagrad_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    state_sums: Sequence[torch.Tensor],
    *,
    lr: float,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    lr_decay: float = 0.0,
    adagrad_w_mode: bool = False,
    maximize: bool = False,
    master_params: Sequence[torch.Tensor] = (),
    step_tensor: Optional[torch.Tensor] = None,
    step: int = 0,
    lr_tensor: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    validate_only: bool = False,
) -> None:
    """One fused Adagrad step (torch.optim.Adagrad's lr_decay; ``adagrad_w_mode`` decays weights
    decoupled as Apex does). Shared arguments as in :func:`adam_`."""
    params, grads, state_sums, master_params = local_lists(
        "adagrad_", (params, grads, state_sums, master_params))
    _optim_step("adagrad", validate_only, locals())


def novograd_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sq_norms: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    reg_inside_moment: bool = False,
    norm_type: float = 2.0,
    init_zero: bool = False,
    master_params: Sequence[torch.Tensor] = (),
    step_tensor: Optional[torch.Tensor] = None,
    step: int = 0,
    lr_tensor: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    validate_only: bool = False,
) -> None:
    """One fused NovoGrad step: per-tensor second moments in ``exp_avg_sq_norms`` (float32,
    ``len(params)``), from each gradient's norm (``norm_type`` 2 or inf). Shared arguments as in
    :func:`adam_`. Sharded DTensors (FSDP2) take the norms of whole gradients, reduced across
    ranks (a collective every rank must join; not with ``validate_only``); ``exp_avg_sq_norms`` is
    then the same on every rank."""
    # Sharded: the whole gradients' norms (multi_tensor_norm reduces the shards') replace the op's own.
    sharded = not validate_only and shard_layout(params) is not None
    grad_norms = multi_tensor_norm(grads, norm_type, per_tensor=True)[1] if sharded else None
    norm_type = float(norm_type)
    params, grads, exp_avgs, master_params = local_lists(
        "novograd_", (params, grads, exp_avgs, master_params))
    _optim_step("novograd", validate_only, locals())


def rms_norm(input: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` on mixprec's kernels: one warp per row, statistics and
    gradients in float32, the weight gradient a deterministic sum. ``weight`` may be float32 for
    fp16/bf16 inputs (Apex's MixedFusedRMSNorm); the output keeps the input's dtype. ``eps=None``
    is float32's epsilon (float64's for float64 input), as torch's kernels compute it. float64 inputs, and on CUDA normalized sizes
    past 24576, use torch's rms_norm. The autograd node is C++, as layer_norm's."""
    shape = _norm_args("mixprec.rms_norm", input, normalized_shape)
    return _ops.rms_norm(input, shape, weight, None if eps is None else float(eps))
