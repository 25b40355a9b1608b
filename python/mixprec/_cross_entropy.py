"""mixprec.cross_entropy: the loss of a language model straight from fp16/bf16 logits, in fp32.

``F.cross_entropy(logits.float(), target)`` materializes an fp32 copy of the logits and runs
log_softmax and both backwards over it: for GPT-2 small (16x1024 tokens, V=50304) about 25 GB of
traffic per step. The fused ops read the low-precision logits once forward and once backward
(plus the gradient written in the logits' dtype), about 5 GB, with the same fp32 math.
"""

from __future__ import annotations

import torch

from ._ops import _ops

_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_forward(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses, lse)`` for contiguous ``logits`` [N, V] (fp32/fp16/bf16) and int64 ``target``
    [N]: float32 [N] each; ``losses[i] = lse[i] - logits[i, target[i]]`` (0 where ignored), ``lse``
    the row's log-sum-exp (not differentiable). Targets outside [0, V) raise on the CPU; on CUDA
    they make that row's loss NaN (and its gradient NaN) instead of synchronizing the host."""
    return _ops.cross_entropy_forward(logits, target, ignore_index)


def cross_entropy_backward(
    grad_losses: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The gradient of ``cross_entropy_forward``'s losses with respect to ``logits``, in the
    logits' dtype: ``grad_losses[i] * (softmax(logits[i]) - onehot(target[i]))``, computed in fp32
    and rounded once; rows whose target is ``ignore_index`` are zero."""
    return _ops.cross_entropy_backward(grad_losses, logits, target, lse, ignore_index)


def _setup_context(ctx, inputs, output) -> None:
    logits, target, ignore_index = inputs
    _, lse = output
    # lse has no gradient formula here: marking it keeps a graph through it from silently
    # getting a zero gradient (torch raises instead).
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, target, lse)
    ctx.ignore_index = ignore_index


def _backward(ctx, grad_losses, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    grad_logits = None
    if ctx.needs_input_grad[0]:
        # A mean or sum reduction hands back an expanded (stride-0) gradient; the op wants [N] dense.
        grad_logits = _ops.cross_entropy_backward(
            grad_losses.float().contiguous(), logits, target, lse, ctx.ignore_index
        )
    return grad_logits, None, None


torch.library.register_autograd("mixprec::cross_entropy_forward", _backward, setup_context=_setup_context)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` [..., V] (float32, float16 or bfloat16) against class indices
    ``target`` [...] (int64), computed in float32 without an fp32 copy of the logits.

    Equals ``torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1),
    ignore_index=ignore_index, reduction=reduction)``, reshaped to ``target``'s shape for
    ``reduction="none"``. Unlike torch the class dimension is the LAST one (a language model's
    ``[batch, seq, V]``), and ``logits`` must be contiguous (a copy would cost the traffic this op
    exists to save). ``"mean"`` divides by the number of targets that are not ``ignore_index``
    (NaN if there are none, as in torch). The result is float32; the gradient with respect to
    ``logits`` comes back in the logits' dtype, rounded once from fp32.

    Targets outside [0, V) other than ``ignore_index`` raise an IndexError on the CPU. On CUDA the
    check would stall the host, so such a row's loss is NaN instead (and its gradient row NaN),
    which a loss scaler's non-finite check catches.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"mixprec.cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if logits.dim() < 1:
        raise ValueError("mixprec.cross_entropy: logits must have a class dimension, got a 0-dim tensor")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"mixprec.cross_entropy: target has shape {tuple(target.shape)} but logits of shape "
            f"{tuple(logits.shape)} need target shape {tuple(logits.shape[:-1])}"
        )
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError("mixprec.cross_entropy: logits have 0 classes (last dimension of size 0); expected at "
                         "least one")
    losses, _ = _ops.cross_entropy_forward(logits.reshape(-1, vocab), target.reshape(-1), ignore_index)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
