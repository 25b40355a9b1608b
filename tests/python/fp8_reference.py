"""The FP8 Linear as mixprec's Python front ran it before the C++ op (commit 84cda34's
python/mixprec/fp8/linear.py and state.py, without the cross-rank reduction): the oracle that
test_fp8_linear_op.py holds mixprec::fp8_linear to, bit for bit, on fresh inputs."""

from __future__ import annotations

import torch

from mixprec import _ops_fp8


def _quantize(state, x: torch.Tensor, role: int, transpose: bool):
    scale, amax, history = state.scale[role:role + 1], state.amax[role:role + 1], state.amax_history[role]
    dtype = state.dtype_of(role)
    r = state.recipe
    if r.scaling == "current":
        _ops_fp8.fp8_amax_(x, amax)
        _ops_fp8.fp8_update_scale_(scale, history, amax, dtype, r.margin, "most_recent")
        out, out_t = _ops_fp8.fp8_quantize(x, scale, dtype, transpose=transpose)
    else:
        _ops_fp8.fp8_update_scale_(scale, history, amax, dtype, r.margin, r.amax_reduction)
        out, out_t = _ops_fp8.fp8_quantize(x, scale, dtype, transpose=transpose, amax=amax)
    seen = amax if r.scaling == "delayed" else history[0:1]
    return out, out_t, torch.where(seen.isfinite(), scale.reciprocal(), torch.nan)


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None):
    y = torch.mm(a.float(), b.float()).mul_(scale_a * scale_b)
    if bias is not None:
        y.add_(bias.float())
    return y.to(out_dtype)


class _Reference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state, need_dgrad: bool, need_wgrad: bool):
        k, n = weight.shape[1], weight.shape[0]
        x2 = x.reshape(-1, k).contiguous()
        xq, xq_t, x_inv = _quantize(state, x2, 0, transpose=need_wgrad)
        wq, wq_t, w_inv = _quantize(state, weight.contiguous(), 1, transpose=need_dgrad)
        y = _scaled_mm(xq, wq.t(), x_inv, w_inv, x.dtype, bias)
        ctx.state, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = state, x.shape, x.dtype, weight.dtype
        ctx.flags = (need_dgrad, need_wgrad, bias is not None and bias.requires_grad)
        ctx.save_for_backward(xq_t, wq_t, x_inv, w_inv)
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        xq_t, wq_t, x_inv, w_inv = ctx.saved_tensors
        need_dgrad, need_wgrad, need_bgrad = ctx.flags
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dw = db = None
        if need_dgrad or need_wgrad:
            gq, gq_t, g_inv = _quantize(ctx.state, dy2, 2, transpose=need_wgrad)
            if need_dgrad:
                dx = _scaled_mm(gq, wq_t.t(), g_inv, w_inv, ctx.x_dtype).view(ctx.x_shape)
            if need_wgrad:
                dw = _scaled_mm(gq_t, xq_t.t(), g_inv, x_inv, ctx.w_dtype)
        if need_bgrad:
            db = dy2.float().sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None, None


def reference_linear(x, weight, bias, state):
    """The pre-op Fp8Linear's forward on ``state`` (CPU; shapes already FP8-eligible)."""
    grad = torch.is_grad_enabled()
    return _Reference.apply(x, weight, bias, state, grad and x.requires_grad, grad and weight.requires_grad)
