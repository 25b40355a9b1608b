"""The layer kernels of a cast model (O2/O3): amp.initialize turns every plain nn.Linear,
nn.LayerNorm and nn.RMSNorm into these subclasses, whose forward runs on mixprec's ops. The math is torch's
(the same forward and GEMMs for Linear, fp32 statistics for LayerNorm); what changes is the
kernels around it: the Linear's bias gradient is mixprec.linear_bias_grad's sum instead of
torch's generic reduction, and LayerNorm is mixprec.layer_norm (one warp per row, the parameter
gradients summed while the input gradient is computed). On an H200 this is 1.6-2.0 ms of a
42 ms O2 step of GPT-2 small (benchmarks/RESULTS.md, "e2e_gpt2.py")."""

from __future__ import annotations

import torch

from .. import _ops


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` whose forward is :func:`mixprec.linear`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _ops.linear(input, self.weight, self.bias)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose forward is :func:`mixprec.layer_norm`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _ops.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward is :func:`mixprec.rms_norm`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The kernels take a weight of the input's dtype or float32; any other pairing (an fp32
        # input reaching a cast fp16 weight) is torch's to promote.
        if self.weight is not None and self.weight.dtype not in (input.dtype, torch.float32):
            return super().forward(input)
        return _ops.rms_norm(input, self.normalized_shape, self.weight, self.eps)


_SWAPS = {torch.nn.Linear: Linear, torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm}


def use_layer_kernels(model: torch.nn.Module) -> int:
    """Turns every module of exactly type nn.Linear, nn.LayerNorm or nn.RMSNorm in ``model`` into its mixprec
    subclass in place (the same object, parameters and hooks; isinstance checks still hold).
    Subclasses of those types are left alone: their forward may do more. Returns the count."""
    swapped = 0
    for module in model.modules():
        mixprec_type = _SWAPS.get(type(module))
        if mixprec_type is not None:
            module.__class__ = mixprec_type
            swapped += 1
    return swapped
