"""The FP8 Linear: forward and both backward GEMMs on FP8 operands (torch._scaled_mm on CUDA, an
exact-cast emulation with fp32 matmuls on the CPU), per-tensor scales kept on the device."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .recipe import Fp8Recipe
from .state import Fp8ScalingState

#: _scaled_mm's rule: every GEMM dimension a multiple of 16 (its FP8 tensor-core tiles).
ALIGN = 16
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def ineligibility(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` cannot become an :class:`Fp8Linear` (None if it can): it must be an
    ``nn.Linear`` whose in_features and out_features are both multiples of 16."""
    if not isinstance(module, torch.nn.Linear):
        return f"{type(module).__name__} is not an nn.Linear"
    bad = [f"{n}={v}" for n, v in (("in_features", module.in_features), ("out_features", module.out_features))
           if v % ALIGN]
    if bad:
        return f"{', '.join(bad)} not a multiple of {ALIGN}"
    if module.weight.dtype not in _FLOATS:
        return f"weight dtype {module.weight.dtype} is not float32, float16 or bfloat16"
    return None


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, emulate: Optional[bool] = None):
    """``(a * scale_a) @ (b * scale_b) (+ bias)`` for FP8 ``a`` (row-major) and ``b`` (column-major),
    accumulated in fp32 and rounded once to ``out_dtype``. ``emulate`` (default: off CUDA) widens
    the FP8 values exactly to fp32 and multiplies there, as the tensor cores do, so the CPU checks
    the same numerics; otherwise torch._scaled_mm."""
    if emulate is None:
        emulate = a.device.type != "cuda"
    if emulate:
        y = torch.mm(a.float(), b.float()).mul_(scale_a * scale_b)
        if bias is not None:
            y.add_(bias.float())
        return y.to(out_dtype)
    fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
    y = torch._scaled_mm(a, b, scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()),
                         bias=bias if fuse_bias else None, out_dtype=out_dtype)
    if bias is not None and not fuse_bias:
        y = (y.float() + bias.float()).to(out_dtype)
    return y


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with x, W cast to the forward FP8 dtype and the output gradient to the
    backward one. What backward keeps is FP8 (x^T and W^T, already in the column-major layout the
    gradient GEMMs read) plus two scalars: a quarter of the bf16 activations' memory."""

    @staticmethod
    def forward(ctx, x, weight, bias, state: Fp8ScalingState, need_dgrad: bool, need_wgrad: bool):
        k, n = weight.shape[1], weight.shape[0]
        x2 = x.reshape(-1, k).contiguous()
        xq, xq_t, x_inv = state.quantize(x2, 0, transpose=need_wgrad)
        wq, wq_t, w_inv = state.quantize(weight.contiguous(), 1, transpose=need_dgrad)
        y = scaled_mm(xq, wq.t(), x_inv, w_inv, x.dtype, bias)
        ctx.state, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = state, x.shape, x.dtype, weight.dtype
        ctx.flags = (need_dgrad, need_wgrad, bias is not None and bias.requires_grad)
        ctx.save_for_backward(xq_t, wq_t, x_inv, w_inv)
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        xq_t, wq_t, x_inv, w_inv = ctx.saved_tensors
        need_dgrad, need_wgrad, need_bgrad = ctx.flags
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n).contiguous()
        dx = dw = db = None
        if need_dgrad or need_wgrad:
            gq, gq_t, g_inv = ctx.state.quantize(dy2, 2, transpose=need_wgrad)
            if need_dgrad:
                dx = scaled_mm(gq, wq_t.t(), g_inv, w_inv, ctx.x_dtype).view(ctx.x_shape)
            if need_wgrad:
                dw = scaled_mm(gq_t, xq_t.t(), g_inv, x_inv, ctx.w_dtype)
        if need_bgrad:
            db = dy2.float().sum(0).to(ctx.w_dtype)  # the unquantized gradient: a sum needs no FP8
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: Fp8ScalingState):
    """``F.linear`` through FP8 GEMMs with ``state``'s scales, where the shapes allow (weight dims
    and the token count multiples of 16, float inputs); otherwise plain ``F.linear``."""
    k = weight.shape[1]
    tokens = x.numel() // k if k else 0
    if (x.dtype not in _FLOATS or weight.dtype not in _FLOATS or tokens == 0 or tokens % ALIGN
            or weight.shape[0] % ALIGN or k % ALIGN or x.shape[-1] != k):
        state.fallbacks += 1
        return F.linear(x, weight, bias)
    grad = torch.is_grad_enabled()
    return _Fp8LinearFunction.apply(x, weight, bias, state, grad and x.requires_grad,
                                    grad and weight.requires_grad)


class Fp8Linear(torch.nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 (see :class:`Fp8Recipe`). Parameters stay as
    they are (bf16 under amp O4, with fp32 masters in the optimizer); the scaling state is
    ``self.fp8_state``, kept out of the module's ``state_dict()`` (a checkpoint of the plain
    model loads unchanged) and saved by ``amp.state_dict()`` or ``fp8_state.state_dict()``."""

    fp8_state: Fp8ScalingState

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Optional[Fp8Recipe] = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        _attach(self, recipe)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Optional[Fp8Recipe] = None) -> "Fp8Linear":
        """Turns ``linear`` itself into an Fp8Linear (same object and parameters, so optimizers
        that hold them keep working); raises ValueError if it is not eligible."""
        why = ineligibility(linear)
        if why is not None:
            raise ValueError(f"mixprec.fp8.Fp8Linear.from_linear: linear is not eligible for FP8: {why}")
        if recipe is not None and not isinstance(recipe, Fp8Recipe):
            raise TypeError(f"mixprec.fp8.Fp8Linear.from_linear: recipe must be an Fp8Recipe, got "
                            f"{type(recipe).__name__}")
        linear.__class__ = cls
        _attach(linear, recipe)
        return linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_linear(input, self.weight, self.bias, self.fp8_state)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        # Only the device follows the module: a cast of the model to bf16 leaves the scales fp32.
        device = fn(self.fp8_state.scale).device
        self.fp8_state.to(device)
        return out

    def extra_repr(self) -> str:
        r = self.fp8_state.recipe
        fwd, bwd = (str(d).replace("torch.", "") for d in (r.forward_dtype, r.backward_dtype))
        return f"{super().extra_repr()}, fp8={fwd}/{bwd}, scaling={r.scaling}"


def _attach(module: torch.nn.Linear, recipe: Optional[Fp8Recipe]) -> None:
    state = Fp8ScalingState(recipe if recipe is not None else Fp8Recipe(), device=module.weight.device)
    state.fallbacks = 0  # host count of calls that ran plain F.linear (shapes FP8 cannot take)
    # In __dict__, not _modules: out of the model's state_dict and parameters().
    module.__dict__["fp8_state"] = state


def convert(model: torch.nn.Module, recipe: Optional[Fp8Recipe] = None) -> tuple[list[str], dict[str, str]]:
    """Turns every eligible ``nn.Linear`` of ``model`` (exactly that type, or amp's layer-kernel
    Linear) into an :class:`Fp8Linear` in place; subclasses with their own forward are left
    alone. Returns (names converted, {name: why not} for the Linears left in higher precision)."""
    from ..amp._layers import Linear as _AmpLinear

    converted, skipped = [], {}
    for name, module in model.named_modules():
        if type(module) not in (torch.nn.Linear, _AmpLinear):
            continue
        why = ineligibility(module)
        if why is None:
            Fp8Linear.from_linear(module, recipe)
            converted.append(name)
        else:
            skipped[name] = why
    return converted, skipped
