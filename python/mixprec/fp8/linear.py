"""The FP8 Linear: forward and both backward GEMMs on FP8 operands (torch._scaled_mm on CUDA, an
exact-cast emulation with fp32 matmuls on the CPU), per-tensor scales kept on the device. The math
is the C++ op mixprec::fp8_linear (csrc/ops/fp8_linear.cpp); this file is the module around it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import _ops_fp8
from .._ops import _ops
from . import distributed
from .recipe import Fp8Recipe
from .state import Fp8ScalingState

#: _scaled_mm's rule: every GEMM dimension a multiple of 16 (its FP8 tensor-core tiles). The rule
#: itself is the library's (the fp8_linear_ineligibility op, the C++ front's too).
ALIGN = 16
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def ineligibility(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` cannot become an :class:`Fp8Linear` (None if it can): it must be an
    ``nn.Linear`` whose in_features and out_features are both multiples of 16."""
    if not isinstance(module, torch.nn.Linear):
        return f"{type(module).__name__} is not an nn.Linear"
    # The op reads a weight's shape and dtype only: a meta stand-in serves any weight (a DTensor,
    # a lazy module's), shaped by the module's features as the C++ front's options are.
    weight = torch.empty((module.out_features, module.in_features), dtype=module.weight.dtype, device="meta")
    return _ops.fp8_linear_ineligibility(weight, None) or None


def _falls_back(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp8_linear runs plain linear for (x, weight): the library's rule, asked eagerly.
    torch.compile cannot trace an op that returns a str, so its trace evaluates the rule's
    arithmetic here (over symbolic shapes, which it guards); tests/python/test_front_rules.py
    checks that both answer alike across the boundaries."""
    if torch.compiler.is_compiling():
        k = weight.shape[1]
        tokens = x.numel() // k if k else 0
        return (x.dtype not in _FLOATS or weight.dtype not in _FLOATS or x.dim() == 0 or x.shape[-1] != k
                or not all(d > 0 and d % ALIGN == 0 for d in (weight.shape[0], k, tokens)))
    if type(x) not in _PLAIN or type(weight) not in _PLAIN:  # subclasses' dispatch knows no mixprec op
        x, weight = (torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (x, weight))
    return bool(_ops.fp8_linear_ineligibility(weight, x))


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, emulate: Optional[bool] = None):
    """``(a * scale_a) @ (b * scale_b) (+ bias)`` for FP8 ``a`` (row-major) and ``b`` (column-major),
    accumulated in fp32 and rounded once to ``out_dtype``. ``emulate`` (default: off CUDA) widens
    the FP8 values exactly to fp32 and multiplies there, as the tensor cores do, so the CPU checks
    the same numerics; otherwise torch._scaled_mm. (The fp8_scaled_mm op, as the C++ front's.)"""
    return _ops_fp8.fp8_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, emulate)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: Fp8ScalingState):
    """``F.linear`` through FP8 GEMMs with ``state``'s scales, where the shapes allow (weight dims
    and the token count multiples of 16, float inputs); otherwise plain ``F.linear``. The GEMMs,
    casts and scale updates are the C++ op ``mixprec::fp8_linear`` (the C++ front's too); under a
    process group the ranks' amaxes are reduced as :mod:`.distributed` describes."""
    if _falls_back(x, weight):
        state.fallbacks += 1
        return F.linear(x, weight, bias)
    r = state.recipe
    group = distributed.group_of(r)
    delayed = r.scaling == "delayed"
    reducer = distributed.delayed_reducer(group) if group is not None and delayed else None
    if reducer is not None:
        reducer.before_forward(state)
    y = _ops_fp8.fp8_linear(x, weight, bias, state.scale, state.amax, state.amax_history, r.forward_dtype,
                            r.backward_dtype, delayed=delayed, margin=r.margin, reduction=r.amax_reduction,
                            group_name=group.group_name if group is not None and not delayed else None,
                            saturation=state.saturation if state.track_saturation else None)
    if reducer is not None:
        reducer.after_forward(state, y)
    return y


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
