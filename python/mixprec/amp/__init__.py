"""mixprec.amp: Apex's amp API (initialize, scale_loss, O0-O3, master weights, decorators, state
dicts) on today's PyTorch: torch.autocast for O1, mixprec's device-side loss scaling and fused
optimizers for the rest, fp16 or bf16, with complete checkpoints.

    from mixprec import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")   # dtype=torch.bfloat16 for bf16
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
"""

from ._casts import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ._checkpoint import checkpoint_state, load_checkpoint_state, load_state_dict, state_dict
from ._handle import loss_scale, scale_history, scale_loss, skipped_steps
from ._initialize import initialize
from ._o1_handle import AmpHandle, InitializeHandle, NoOpHandle, init
from ._o1_scale import OptimWrapper
from ._optimizer import master_params
from ._properties import opt_levels
from ._scaler import _amp_state  # noqa: F401  (Apex code reads amp._amp_state)

__all__ = [
    "AmpHandle",
    "InitializeHandle",
    "NoOpHandle",
    "OptimWrapper",
    "checkpoint_state",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_checkpoint_state",
    "load_state_dict",
    "loss_scale",
    "master_params",
    "opt_levels",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_history",
    "scale_loss",
    "skipped_steps",
    "state_dict",
]
