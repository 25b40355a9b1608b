"""mixprec under torch.distributed (DDP, FSDP2): every rank agrees on skipping a step, FSDP2's
MixedPrecisionPolicy for O2-style training, checkpoints through torch.distributed.checkpoint, and
messages from rank 0 only. The recipes are in docs/distributed.md."""

from __future__ import annotations

import enum
import warnings
from typing import Any, Iterable, Optional, Union

import torch

from ._device_copy import to_device
from ._dtensor import any_dtensor, local

__all__ = [
    "LOCAL",
    "CheckpointState",
    "agree_found_inf_",
    "is_rank0",
    "local",
    "mixed_precision_policy",
    "rank0_warn",
    "reduction_group",
]


class _NoReduction(enum.Enum):
    # An enum member pickles to itself, so a scaler built with LOCAL keeps it across pickling.
    LOCAL = "local"


#: Pass as ``process_group`` to mixprec.GradScaler or amp.initialize to keep found_inf local to
#: the rank (for processes that train unrelated models; under DDP or FSDP2 ranks then drift apart).
LOCAL = _NoReduction.LOCAL


def is_initialized() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def is_rank0() -> bool:
    """True on global rank 0, and in any process outside torch.distributed."""
    return not is_initialized() or torch.distributed.get_rank() == 0


def rank0_warn(message: str, category: type = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` on rank 0 only (every rank hits the same condition; one message is enough).
    ``stacklevel`` means what it means to warnings.warn called where this function is called."""
    if is_rank0():
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def reduction_group(process_group: Any) -> Optional[Any]:
    """The group found_inf must be agreed over now, or None when there is nothing to agree with.

    ``process_group``: None means the default (world) group, as everywhere in torch.distributed;
    a ProcessGroup means itself; :data:`LOCAL` means no reduction. Nothing is reduced outside an
    initialized torch.distributed or in a group of one."""
    if process_group is LOCAL or not is_initialized():
        return None
    group = torch.distributed.group.WORLD if process_group is None else process_group
    if torch.distributed.get_world_size(group) == 1:
        return None
    return group


def agree_found_inf_(found: Union[torch.Tensor, dict], process_group: Any = None,
                     device: Optional[torch.device] = None) -> None:
    """Makes found_inf the maximum over the ranks of ``process_group`` (see
    :func:`reduction_group`), in place, so that every rank skips the same steps and updates its
    scale the same way: with FSDP2 each rank checks only its shard of the gradients, and under
    DDP a gradient can still go bad on one rank after the all-reduce (a hook, clipping, a
    fault). One all_reduce per call, on the device: NCCL orders it on the stream and the host
    does not wait; gloo on the CPU is synchronous by nature.

    ``found`` is one device scalar or a GradScaler's ``{device: found_inf}``; a rank with no
    gradients (an empty dict) still takes part, with a zero on ``device``, which is then added
    to the dict. Every rank of the group must call this the same number of times, in the same
    order (each call is a collective)."""
    group = reduction_group(process_group)
    if group is None:
        return
    if isinstance(found, torch.Tensor):
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
        return
    if not found:
        if device is None:
            raise ValueError("agree_found_inf_: an empty found_inf dict needs the device to reduce on")
        found[torch.device(device)] = torch.zeros((), dtype=torch.float32, device=device)
    values = list(found.values())
    if len(values) == 1:
        torch.distributed.all_reduce(values[0], op=torch.distributed.ReduceOp.MAX, group=group)
        return
    # Several devices on one rank: one collective for all of them, copied back without a sync.
    first = values[0]
    combined = torch.stack([to_device(v, first.device).reshape(()) for v in values]).amax()
    torch.distributed.all_reduce(combined, op=torch.distributed.ReduceOp.MAX, group=group)
    for v in values:
        v.copy_(to_device(combined, v.device).reshape(v.shape))


# -- FSDP2 ----------------------------------------------------------------------------------------

_LOW = (torch.float16, torch.bfloat16)


def mixed_precision_policy(opt_level: str = "O2", dtype: torch.dtype = torch.bfloat16, *, root: bool = True):
    """FSDP2's ``MixedPrecisionPolicy`` for an Apex opt level, the natural route to O2 under
    ``fully_shard``: the sharded parameters stay fp32 and are the master weights (the optimizer
    needs no ``master_weights``), FSDP2 casts them to ``dtype`` when it gathers them for the
    forward and backward, and reduce-scatters the gradients in fp32 into fp32 shards.

    - ``"O0"``: fp32 throughout (the default policy).
    - ``"O2"``: parameters gathered in ``dtype``, inputs cast to ``dtype``, outputs to fp32,
      gradients reduced in fp32 (Apex's O2 with fp32 master weights and fp32 master gradients).
    - ``"O3"``: as O2, but gradients are also reduced in ``dtype``.

    ``root=False`` gives the policy of the inner units (the blocks sharded before the whole
    model): the same, but their outputs stay in ``dtype``. Only the model's own output is cast
    to fp32, as Apex's O2 did; an inner unit that cast its output to fp32 would hand fp32
    activations to the low-precision layers after it (a final LayerNorm, an LM head kept in the
    root unit), which then fail on the mixed dtypes.

    O1 has no policy: keep the default one and run the forward under ``torch.autocast``. With
    ``dtype=torch.float16`` scale the loss with :class:`mixprec.GradScaler` (its found_inf is
    agreed over the ranks); bfloat16 needs no loss scaling."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if opt_level == "O1":
        raise ValueError("mixed_precision_policy: O1 casts per op, not per parameter: keep the default "
                         "MixedPrecisionPolicy() and run the forward under torch.autocast(dtype=...)")
    if opt_level not in ("O0", "O2", "O3"):
        raise ValueError(f"mixed_precision_policy: opt_level must be 'O0', 'O2' or 'O3', got {opt_level!r}")
    if dtype not in _LOW:
        raise ValueError(f"mixed_precision_policy: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    if opt_level == "O0":
        return MixedPrecisionPolicy()
    reduce_dtype = torch.float32 if opt_level == "O2" else dtype
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype,
                                output_dtype=torch.float32 if root else None, cast_forward_inputs=True)


def has_dtensor_params(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (or another DTensor API) has turned any of the model's parameters
    into DTensors."""
    return any_dtensor(list(model.parameters()))


# -- checkpoints ------------------------------------------------------------------------------------


class CheckpointState:
    """A model, its optimizers and a GradScaler as one ``torch.distributed.checkpoint`` item (it
    implements DCP's ``Stateful``): the model's parameters and buffers, each optimizer's state
    (moments, fp32 master weights and step counts of mixprec's fused optimizers, sharded as
    DTensors under FSDP2) and the scaler's scale, trackers and skipped-step count.

    Every rank calls, with the same path::

        state = {"train": mixprec.distributed.CheckpointState(model, optimizer, scaler)}
        torch.distributed.checkpoint.save(state, checkpoint_id=path)
        ...
        torch.distributed.checkpoint.load(state, checkpoint_id=path)   # restores in place

    Works for FSDP2 (each rank writes and reads its own shards; a checkpoint can be loaded on
    another number of ranks) and for DDP or a single process (replicated values are written
    once). ``options`` is a ``torch.distributed.checkpoint.state_dict.StateDictOptions``.
    A model that went through ``mixprec.amp.initialize`` at O2 with an optimizer other than
    mixprec's fused ones keeps its masters outside the optimizer's state: use
    ``amp.checkpoint_state`` for it (docs/distributed.md).
    """

    def __init__(self, model: torch.nn.Module, optimizers: Union[torch.optim.Optimizer, Iterable], scaler=None,
                 *, options=None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"CheckpointState: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        for i, opt in enumerate(self.optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"CheckpointState: optimizers[{i}] is a {type(opt).__name__}, not an optimizer")
            stash = getattr(opt, "_amp_stash", None)
            if stash is not None and stash.kind == "swap":
                raise ValueError(f"CheckpointState: optimizers[{i}] keeps amp's O2 master weights in its param "
                                 "groups, which torch.distributed.checkpoint cannot map to the model; save "
                                 "mixprec.amp.checkpoint_state(model, optimizer) instead")
        self.scaler = scaler
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        out: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        for key in ("model", "optim") + (("scaler",) if self.scaler is not None else ()):
            if key not in state_dict:
                raise KeyError(f"CheckpointState.load_state_dict: the checkpoint has no {key!r}")
        set_state_dict(self.model, self.optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self.options)
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
