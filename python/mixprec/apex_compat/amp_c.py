"""Apex's ``amp_C`` extension for code that imports it directly (Megatron-LM, NeMo): each op keeps
Apex's call ``op(chunk_size, noop_flag, tensor_lists, *args)`` and is a thin call into mixprec's ops.

``noop_flag`` is Apex's one-element int32 tensor. It is turned into mixprec's float32 ``found_inf``
and back with device ops (no host sync). Whether an op skips its work when the flag is already set,
and which values it checks, follows Apex's kernels op by op (see each docstring): only SGD skips.
``chunk_size`` is accepted and ignored; mixprec's kernels pick their own chunking.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch

from .. import _ops
from ._errors import named as _named
from ._errors import not_provided_getattr

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(call: str, chunk_size, noop_flag, tensor_lists, depths: Sequence[int]) -> list[list[torch.Tensor]]:
    """Apex's multi_tensor_apply checks, with errors that name the argument: chunk_size a positive
    int, noop_flag a one-element int32 tensor, ``len(tensor_lists)`` in ``depths``, lists of one
    length whose i-th tensors have one numel, on noop_flag's device, contiguous, float32/float16/
    bfloat16. Returns the lists with every i-th tensor viewed in list 0's shape (Apex compares
    numels only; mixprec's ops compare shapes).

    Like Apex, tensors dense in channels_last (or channels_last_3d) are taken too: Apex's kernels
    walk their memory in order, so the i-th tensors of every list are handed to mixprec's ops as
    flat views of their memory; they must then share one shape and strides (Apex would pair
    elements by memory order and silently mix up a channels_last x with a contiguous out)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{call}: invalid chunk_size {chunk_size!r}; expected a positive int")
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.dtype != torch.int32 or noop_flag.numel() != 1:
        got = f"{noop_flag.dtype} tensor of {noop_flag.numel()} elements" if isinstance(noop_flag, torch.Tensor) \
            else type(noop_flag).__name__
        raise TypeError(f"{call}: invalid noop_flag ({got}); expected a one-element int32 tensor "
                        "such as torch.cuda.IntTensor([0])")
    if not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) not in depths:
        got = len(tensor_lists) if isinstance(tensor_lists, (list, tuple)) else type(tensor_lists).__name__
        want = " or ".join(str(d) for d in depths)
        raise ValueError(f"{call}: tensor_lists has {got} lists; expected {want}")
    lists = [list(lst) for lst in tensor_lists]
    n = len(lists[0])
    for k, lst in enumerate(lists):
        if len(lst) != n:
            raise ValueError(f"{call}: tensor_lists[{k}] has {len(lst)} tensors but tensor_lists[0] has {n}")
        for i, t in enumerate(lst):
            where = f"{call}: tensor_lists[{k}][{i}]"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where} is a {type(t).__name__}; expected a tensor")
            if t.dtype == torch.float64:
                raise NotImplementedError(f"{where} is float64: mixprec's multi-tensor ops take float32, "
                                          "float16 and bfloat16 only")
            if t.dtype not in _KERNEL_DTYPES:
                raise TypeError(f"{where} has dtype {t.dtype}; expected float32, float16 or bfloat16")
            if t.device != noop_flag.device:
                raise ValueError(f"{where} is on {t.device} but noop_flag is on {noop_flag.device}; "
                                 "expected one device")
            if not t.is_contiguous() and not _channels_last(t):
                raise ValueError(f"{where} is not contiguous; expected a contiguous tensor (or one dense in "
                                 "channels_last)")
            if k and t.numel() != lists[0][i].numel():
                raise ValueError(f"{where} has {t.numel()} elements but tensor_lists[0][{i}] has "
                                 f"{lists[0][i].numel()}; expected equal sizes")
            if k and t.shape != lists[0][i].shape and t.is_contiguous() and lists[0][i].is_contiguous():
                lst[i] = t.view(lists[0][i].shape)
    for i in range(n):
        row = [lst[i] for lst in lists]
        if all(t.is_contiguous() for t in row):
            continue
        for k, t in enumerate(row[1:], 1):
            if t.shape != row[0].shape or t.stride() != row[0].stride():
                raise ValueError(f"{call}: tensor_lists[{k}][{i}] has shape {tuple(t.shape)} and strides "
                                 f"{t.stride()} but tensor_lists[0][{i}] has {tuple(row[0].shape)} and "
                                 f"{row[0].stride()}; a channels_last tensor needs its peers in the same layout")
        for lst in lists:  # the memory in order, as Apex's kernels read it
            lst[i] = lst[i].as_strided((lst[i].numel(),), (1,))
    return lists


def _channels_last(t: torch.Tensor) -> bool:
    return (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or \
        (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def _fp32_state(call: str, lists, k: int, what: str, allow_bf16: bool = False) -> None:
    """mixprec keeps optimizer state in float32 (Adam: or bfloat16); Apex's older kernels also
    ran fp16 state beside fp16 params, which mixprec's ops cannot express."""
    allowed = (torch.float32, torch.bfloat16) if allow_bf16 else (torch.float32,)
    for i, t in enumerate(lists[k]):
        if t.dtype not in allowed:
            raise NotImplementedError(f"{call}: tensor_lists[{k}][{i}] ({what}) is {t.dtype}: mixprec keeps "
                                      f"this optimizer state in {' or '.join(map(str, allowed))}")


def _momentum_state(call: str, lists) -> None:
    """SGD's momentum buffers: float32, or the dtype of the weight the step updates (list 1: the
    fp32 master when there are four lists, so float32 there)."""
    for i, (buf, weight) in enumerate(zip(lists[2], lists[1])):
        if buf.dtype not in (torch.float32, weight.dtype):
            raise NotImplementedError(f"{call}: tensor_lists[2][{i}] (momentum buffer) is {buf.dtype} beside a "
                                      f"{weight.dtype} weight: mixprec keeps it in float32 or in the dtype of "
                                      "the weight the step updates")


def _found_inf(noop_flag: torch.Tensor) -> torch.Tensor:
    """mixprec's found_inf (float32, 1 element) holding the flag's current value: a device copy."""
    return noop_flag.reshape(1).to(torch.float32)


def _set_noop(noop_flag: torch.Tensor, bad: torch.Tensor) -> None:
    """noop_flag = 1 where the one-element bool ``bad`` is set, on the device; never cleared."""
    noop_flag.masked_fill_(bad.reshape(noop_flag.shape), 1)


def _device_scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((1,), float(value), dtype=torch.float32, device=like.device)


def _not_finite(norm: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(norm)


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """``dst = src * scale`` for ``tensor_lists = [src, dst]`` (any of float32/float16/bfloat16
    each, in place when dst is src), computed in float32 and rounded once. Sets noop_flag to 1 when
    src holds inf/NaN; like Apex it scales all the same, also when the flag was already set."""
    call = "amp_C.multi_tensor_scale"
    src, dst = _check(call, chunk_size, noop_flag, tensor_lists, (2,))
    if not src:
        return
    found = _found_inf(noop_flag)
    in_place = all(s is d for s, d in zip(src, dst))
    with _named(call):
        _ops.non_finite_check_and_unscale_(src, found, _device_scalar(scale, noop_flag), [] if in_place else dst)
    noop_flag.copy_(found.reshape(noop_flag.shape))


def _flag(call: str, name: str, value) -> bool:
    """A bool argument (Apex's binding takes a bool or None, no string: "False" is true to bool())."""
    if value is not None and value not in (True, False):
        raise TypeError(f"{call}: invalid {name} {value!r}; expected True or False")
    return bool(value)


def _device_tensor(call: str, name: str, value, what: str) -> None:
    """Apex's tensor arguments: a Python number there was a pybind TypeError; here it named none of them."""
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}: invalid {name} {value!r}; expected {what}")


def _l2norm(call, chunk_size, noop_flag, tensor_lists, per_tensor, inv_scale=None):
    per_tensor = _flag(call, "per_tensor", per_tensor)
    (tensors,) = _check(call, chunk_size, noop_flag, tensor_lists, (1,))
    if not tensors:
        total = torch.zeros(1, dtype=torch.float32, device=noop_flag.device)
        return total, total.new_empty(0)
    with _named(call):
        total, per = _ops.multi_tensor_norm(tensors, 2.0, per_tensor)
    total = total.reshape(1)
    if inv_scale is not None:
        # ||x * s|| = ||x|| * |s|: one multiply of the finished norms instead of a scaled copy.
        factor = inv_scale.reshape(1).abs()
        total = total * factor
        per = per * factor if per_tensor else per
    _set_noop(noop_flag, _not_finite(total))
    return total, per


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """Apex's L2 norm of ``tensor_lists = [tensors]``: returns ``(total, per_tensor_norms)``, a
    one-element float32 tensor and a float32 vector of ``len(tensors)`` (an empty tensor unless
    ``per_tensor``). Sets noop_flag to 1 when the norm is not finite; never skips (Apex's kernel
    propagates inf/NaN rather than skipping)."""
    return _l2norm("amp_C.multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, per_tensor)


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """The norms of ``tensors * inv_scale`` (``inv_scale`` a one-element float32 tensor, as
    Apex's), the tensors left unchanged; otherwise as :func:`multi_tensor_l2norm`."""
    call = "amp_C.multi_tensor_unscale_l2norm"
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1 or inv_scale.dtype != torch.float32:
        raise TypeError(f"{call}: invalid inv_scale {inv_scale!r}; expected a one-element float32 tensor")
    if inv_scale.device != noop_flag.device:
        raise ValueError(f"{call}: inv_scale is on {inv_scale.device} but noop_flag is on {noop_flag.device}")
    return _l2norm(call, chunk_size, noop_flag, tensor_lists, per_tensor, inv_scale)


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check) -> None:
    """``out = a * x + b * y`` for ``tensor_lists = [x, y, out]``, in float32, rounded once into
    out's dtype. Sets noop_flag to 1 when the checked input holds inf/NaN: ``arg_to_check`` -1
    checks x and y, 0 only x, 1 only y (Apex's codes). Never skips, like Apex.

    mixprec has no axpby op: the arithmetic is torch's foreach ops, the check mixprec's
    non_finite_check_and_unscale_ (read only)."""
    call = "amp_C.multi_tensor_axpby"
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"{call}: invalid arg_to_check {arg_to_check!r}; expected -1 (x and y), 0 (x) or 1 (y)")
    x, y, out = _check(call, chunk_size, noop_flag, tensor_lists, (3,))
    if not x:
        return
    checked = {-1: x + y, 0: x, 1: y}[arg_to_check]
    found = _found_inf(noop_flag)
    with _named(call):
        _ops.non_finite_check_and_unscale_(checked, found)
    acc = torch._foreach_mul([t.float() for t in x], float(a))
    torch._foreach_add_(acc, [t.float() for t in y], alpha=float(b))
    torch._foreach_copy_(out, acc)
    noop_flag.copy_(found.reshape(noop_flag.shape))


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov, first_run,
                     wd_after_momentum, scale) -> None:
    """Apex's fused SGD step. ``tensor_lists`` is ``[grads, weights, momentum_buffers]``, or with
    a fourth list ``[grads, fp32 weights, momentum_buffers, model weights]`` whose entries receive
    the updated fp32 weights rounded (Apex's fp16 copy). Grads are multiplied by ``scale``;
    ``first_run`` sets the momentum buffer to the gradient (torch.optim.SGD's first step). When
    noop_flag is already set the step does nothing (as Apex's kernel); the flag is only read.
    The momentum list is read only when ``momentum != 0``. A buffer is float32 or, with three
    lists, in its weight's dtype (Apex's all-fp16 case): the new buffer is then rounded to that
    dtype before the weight update uses it, as torch.optim.SGD does (Apex's kernel updates with the
    unrounded value, a difference within the buffer's rounding)."""
    call = "amp_C.multi_tensor_sgd"
    lists = _check(call, chunk_size, noop_flag, tensor_lists, (3, 4))
    if not lists[0]:
        return
    use_momentum = momentum != 0
    if len(lists) == 4:
        _fp32_state(call, lists, 1, "fp32 master weight")
        params, masters = lists[3], lists[1]
    else:
        params, masters = lists[1], []
    if use_momentum:
        _momentum_state(call, lists)
    scale = float(scale)
    # mixprec divides by a loss scale; Apex multiplies by its reciprocal (exact for powers of two).
    # A scale of 0 has no reciprocal: the op gets Apex's products (zeros, NaN for inf/NaN grads).
    grad_scale = None if scale in (0.0, 1.0) else _device_scalar(1.0 / scale, noop_flag)
    # Given a scale, mixprec's op writes the scaled gradients back (torch's fused contract);
    # Apex's kernel leaves them as they were: it gets copies then.
    if scale == 0.0:
        grads = [g * 0.0 for g in lists[0]]
    else:
        grads = lists[0] if grad_scale is None else [g.clone() for g in lists[0]]
    with _named(call):
        _ops.sgd_(params, grads, lists[2] if use_momentum else [], lr=float(lr), momentum=float(momentum),
                  dampening=float(dampening), weight_decay=float(wd), nesterov=bool(nesterov),
                  wd_after_momentum=bool(wd_after_momentum), master_params=masters,
                  step=1 if first_run else 2, grad_scale=grad_scale, found_inf=_found_inf(noop_flag))


def _step(call: str, step) -> int:
    """The step count, which bias corrections raise betas to: Apex's binding takes an int only;
    a fractional one (a float counter) would be truncated here into another step's correction."""
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value != int(value):
        raise TypeError(f"{call}: invalid step {step!r}; expected an int (the count including this step)")
    return int(value)


def _mode(call: str, name: str, value) -> bool:
    if value not in (0, 1):
        raise ValueError(f"{call}: invalid {name} {value!r}; expected 0 (L2 regularization) or 1 "
                         "(decoupled weight decay)")
    return value == 1


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction,
                      weight_decay) -> None:
    """Apex's Adam step over ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``: ``mode``
    0 adds L2 decay to the gradient, 1 decays decoupled (AdamW); ``step`` counts this step.
    Moments are float32 (or bfloat16). Like Apex's kernel it neither reads nor sets noop_flag."""
    call = "amp_C.multi_tensor_adam"
    adam_w = _mode(call, "mode", mode)
    g, p, m, v = _check(call, chunk_size, noop_flag, tensor_lists, (4,))
    if not g:
        return
    _fp32_state(call, [g, p, m, v], 2, "exp_avg", allow_bf16=True)
    _fp32_state(call, [g, p, m, v], 3, "exp_avg_sq", allow_bf16=True)
    with _named(call):
        _ops.adam_(p, g, m, v, lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(epsilon),
                   weight_decay=float(weight_decay), adam_w_mode=adam_w, bias_correction=bool(bias_correction),
                   step=_step(call, step))


def multi_tensor_adagrad(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay) -> None:
    """Apex's Adagrad step over ``tensor_lists = [grads, params, state_sums]``: ``mode`` 0 adds L2
    decay to the gradient, 1 decays decoupled; the sums are float32. Like Apex's kernel it neither
    reads nor sets noop_flag."""
    call = "amp_C.multi_tensor_adagrad"
    w_mode = _mode(call, "mode", mode)
    g, p, h = _check(call, chunk_size, noop_flag, tensor_lists, (3,))
    if not g:
        return
    _fp32_state(call, [g, p, h], 2, "state_sum")
    with _named(call):
        _ops.adagrad_(p, g, h, lr=float(lr), eps=float(epsilon), weight_decay=float(weight_decay),
                      adagrad_w_mode=w_mode, step=1)


def multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, bias_correction,
                      weight_decay, grad_averaging, mode, global_grad_norm, max_grad_norm, use_nvlamb=None) -> None:
    """Apex's LAMB step over ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``: grads
    divided by ``global_grad_norm / max_grad_norm`` when the norm (a one-element float32 tensor)
    exceeds ``max_grad_norm``; ``mode`` 0 L2, 1 decoupled decay; trust ratio ||w|| / ||u|| for
    tensors with decay (all with ``use_nvlamb``). Never skips; sets noop_flag when the params come
    out non-finite (Apex: when a param or update norm is non-finite, which is the same event).
    Apex leaves the update term in the grads as scratch; mixprec leaves the grads unchanged."""
    call = "amp_C.multi_tensor_lamb"
    adam_w = _mode(call, "mode", mode)
    _device_tensor(call, "global_grad_norm", global_grad_norm, "a one-element float32 tensor (the gradients' "
                   "global L2 norm, e.g. from multi_tensor_l2norm)")
    if not float(max_grad_norm) > 0:
        raise NotImplementedError(f"{call}: max_grad_norm {max_grad_norm!r} <= 0 zeroes every gradient in "
                                  "Apex; mixprec's lamb_ reads it as 'no clipping'. Pass a positive value")
    g, p, m, v = _check(call, chunk_size, noop_flag, tensor_lists, (4,))
    if not g:
        return
    _fp32_state(call, [g, p, m, v], 2, "exp_avg")
    _fp32_state(call, [g, p, m, v], 3, "exp_avg_sq")
    with _named(call):
        _ops.lamb_(p, g, m, v, lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(epsilon),
                   weight_decay=float(weight_decay), bias_correction=bool(bias_correction),
                   grad_averaging=bool(grad_averaging), adam_w_mode=adam_w, max_grad_norm=float(max_grad_norm),
                   use_nvlamb=bool(use_nvlamb), step=_step(call, step), global_grad_norm=global_grad_norm)
        total, _ = _ops.multi_tensor_norm(p, 2.0, False)
    _set_noop(noop_flag, _not_finite(total))


def multi_tensor_novograd(chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2, epsilon, step,
                          bias_correction, weight_decay, grad_averaging, mode, norm_type) -> None:
    """Apex's NovoGrad step over ``tensor_lists = [grads, params, exp_avgs]``. ``grad_norms``
    (float32, ``len(grads)``) is the per-tensor second moment, kept as a norm and blended in place
    with this step's gradient norms (``norm_type`` 2: L2, 0: max-norm), as Apex's kernel does on
    every step. ``mode`` 0 puts normalization and decay inside the moment (the paper's form).
    Never skips; sets noop_flag when a gradient norm is not finite."""
    call = "amp_C.multi_tensor_novograd"
    reg_inside_moment = not _mode(call, "mode", mode)
    _device_tensor(call, "grad_norms", grad_norms, "a float32 tensor of one second moment per gradient")
    if grad_norms is None:
        raise TypeError(f"{call}: invalid grad_norms None; expected a float32 tensor of one second moment per gradient")
    if norm_type not in (0, 2):
        raise ValueError(f"{call}: invalid norm_type {norm_type!r}; expected 2 (L2) or 0 (max-norm)")
    g, p, m = _check(call, chunk_size, noop_flag, tensor_lists, (3,))
    if not g:
        return
    _fp32_state(call, [g, p, m], 2, "exp_avg")
    ord = math.inf if norm_type == 0 else 2.0
    with _named(call):
        total, norms = _ops.multi_tensor_norm(g, ord, True)
        # The op with the norms given: no second norm pass, and the flag comes from the same norms.
        # init_zero=True: blend on every step, step 1 included, as Apex's kernel.
        torch.ops.mixprec.novograd_(
            p, g, m, grad_norms, [], None, lr=float(lr), beta1=float(beta1), beta2=float(beta2),
            eps=float(epsilon), weight_decay=float(weight_decay), bias_correction=bool(bias_correction),
            grad_averaging=bool(grad_averaging), reg_inside_moment=reg_inside_moment, norm_type=ord,
            init_zero=True, step=_step(call, step), grad_norms=norms)
    _set_noop(noop_flag, _not_finite(total))


#: amp_C names mixprec does not provide, and what to use instead.
NOT_PROVIDED = {
    "multi_tensor_l2norm_mp": "multi_tensor_l2norm (mixprec accumulates every dtype in float32)",
    "multi_tensor_l2norm_scale": "multi_tensor_l2norm and multi_tensor_scale",
    "multi_tensor_unscale_l2norm_mp": "multi_tensor_unscale_l2norm",
    "multi_tensor_adam_capturable": "mixprec.optimizers.FusedAdam(capturable=True)",
    "multi_tensor_adam_capturable_master": "mixprec.optimizers.FusedAdam(capturable=True, master_weights=True)",
    "multi_tensor_lamb_mp": "mixprec.optimizers.FusedLAMB",
    "multi_tensor_lamb_stage1_cuda": "multi_tensor_lamb or mixprec.optimizers.FusedLAMB",
    "multi_tensor_lamb_stage2_cuda": "multi_tensor_lamb or mixprec.optimizers.FusedLAMB",
    "update_scale_hysteresis": "mixprec.update_scale_(..., hysteresis=..., hysteresis_tracker=...)",
}


__getattr__ = not_provided_getattr("amp_C", NOT_PROVIDED)
