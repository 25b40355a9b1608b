"""DTensor inputs (FSDP2's sharded parameters, tensor parallelism) to mixprec's ops: element-wise
ops run on each rank's local shard; ops that take norms refuse shards, whose norm is not the
tensor's."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch


def dtensor_type() -> Optional[type]:
    """torch's DTensor class, or None while nothing has imported it (then no DTensor exists, and
    mixprec's hot paths pay one dictionary lookup instead of an import)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def any_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (sharing its storage, so in-place updates land in the
    DTensor), or ``t`` itself."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the common case, cheaply
        return t
    cls = dtensor_type()
    if cls is None or not isinstance(t, cls):
        return t
    with torch.no_grad():  # the storage itself, not an autograd view of it
        return t.to_local()


def local_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local` of each; ``tensors`` itself while no DTensor can exist."""
    return tensors if dtensor_type() is None else [local(t) for t in tensors]


def _kind(placement) -> str:
    if placement.is_shard():
        return "shard"
    if placement.is_partial():
        return "partial"
    return "replicate"


def local_lists(op: str, lists: Sequence[Sequence[torch.Tensor]], *, elementwise: bool) -> list[list[torch.Tensor]]:
    """``lists`` (params first, then grads, states, masters: entry i of each belongs together)
    with every DTensor replaced by its local shard.

    Element-wise ops (``elementwise=True``) accept Shard and Replicate placements when every
    DTensor of entry i has the placements of ``lists[0][i]`` (so the shards line up element by
    element); Partial placements (values still to be summed across ranks) are refused. Ops that
    take norms accept Replicate only: a norm of one shard is not the norm of the tensor."""
    cls = dtensor_type()
    head = lists[0]
    # Only the first list is scanned (every step, so cheaply): state made from a DTensor
    # parameter is a DTensor, state of a plain one is plain.
    if cls is None or not any(isinstance(t, cls) for t in head):
        return [list(lst) for lst in lists]
    out = []
    for li, lst in enumerate(lists):
        converted = []
        for i, t in enumerate(lst):
            if not isinstance(t, cls):
                if isinstance(t, torch.Tensor) and i < len(head) and isinstance(head[i], cls):
                    raise ValueError(f"mixprec::{op}: list {li} index {i} is a plain tensor but the parameter is "
                                     "a DTensor; create optimizer state from the (sharded) parameter")
                converted.append(t)
                continue
            kinds = {_kind(p) for p in t.placements}
            if "partial" in kinds:
                raise ValueError(f"mixprec::{op}: list {li} index {i} is a DTensor with Partial placements "
                                 f"{t.placements}; reduce it first (FSDP2 hands the optimizer Shard placements)")
            if not elementwise and "shard" in kinds:
                raise NotImplementedError(
                    f"mixprec::{op} takes norms of whole tensors, but list {li} index {i} is sharded "
                    f"({t.placements}): a norm of the local shard is not the tensor's. Use FusedAdam, FusedSGD "
                    "or FusedAdagrad with FSDP2, or keep these parameters replicated")
            ref = head[i] if i < len(head) else None
            if elementwise and ref is not None and t is not ref and isinstance(ref, cls) and (
                    t.placements != ref.placements or t.device_mesh != ref.device_mesh):
                raise ValueError(f"mixprec::{op}: list {li} index {i} is laid out as {t.placements} but the parameter "
                                 f"as {ref.placements}; their local shards would not line up")
            converted.append(local(t))
        out.append(converted)
    return out


def refuse_sharded(owner: str, params: Sequence[torch.Tensor], why: str) -> None:
    """NotImplementedError when any of ``params`` is a DTensor sharded across ranks."""
    cls = dtensor_type()
    if cls is None:
        return
    for i, p in enumerate(params):
        if isinstance(p, cls) and any(not pl.is_replicate() for pl in p.placements):
            raise NotImplementedError(
                f"{owner} does not support sharded parameters (FSDP2's fully_shard, tensor parallelism): parameter "
                f"{i} is laid out as {p.placements}. {why} Use FusedAdam, FusedSGD or FusedAdagrad, whose steps are "
                "element-wise, or keep these parameters replicated")
