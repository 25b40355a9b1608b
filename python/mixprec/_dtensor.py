"""DTensor inputs (FSDP2's sharded parameters, tensor parallelism) to mixprec's ops: every op
runs on each rank's local shards; ops that need norms of whole tensors (LAMB's trust ratio,
NovoGrad's second moments, multi_tensor_norm) reduce the shards' norms across ranks."""

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


def _shard_of(t) -> torch.Tensor:
    """A DTensor's local shard as the tensor that holds its storage. ``to_local()`` returns the
    same storage through an autograd Function, about 10 us a call: 3 ms a step for FSDP2's
    GPT-2 small (4 lists of 150 tensors), on a host that FSDP2 already makes the bottleneck.
    ``_local_tensor`` is DTensor's own attribute for it (FSDP2 reads it too); without it (a renamed
    attribute in some future torch) the public call serves."""
    shard = getattr(t, "_local_tensor", None)
    if shard is None:
        with torch.no_grad():  # the storage itself, not an autograd view of it
            return t.to_local()
    return shard.detach() if shard.requires_grad else shard


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (sharing its storage, so in-place updates land in the
    DTensor), or ``t`` itself."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the common case, cheaply
        return t
    cls = dtensor_type()
    if cls is None or not isinstance(t, cls):
        return t
    return _shard_of(t)


def local_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local` of each; ``tensors`` itself while no DTensor can exist."""
    return tensors if dtensor_type() is None else [local(t) for t in tensors]


def local_lists(op: str, lists: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """``lists`` (params first, then grads, states, masters: entry i of each belongs together)
    with every DTensor replaced by its local shard.

    Shard and Replicate placements are accepted when every DTensor of entry i has the placements
    of ``lists[0][i]`` (so the shards line up element by element); Partial placements (values
    still to be summed across ranks) are refused. Ops that take norms of whole tensors reduce
    their per-shard norms across ranks with :func:`shard_layout` and :func:`reduce_shard_norms`."""
    cls = dtensor_type()
    head = lists[0]
    # Only the first list is scanned (every step, so cheaply): state made from a DTensor
    # parameter is a DTensor, state of a plain one is plain.
    # (A plain loop, and map: a generator or comprehension costs Python calls on every step.)
    if cls is None:
        return list(map(list, lists))
    for t in head:
        if isinstance(t, cls):
            break
    else:
        return list(map(list, lists))
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
            spec = t._spec
            ref = head[i] if i < len(head) else None
            ref_spec = ref._spec if ref is not None and ref is not t and isinstance(ref, cls) else None
            # A tensor laid out as its parameter (FSDP2's gradients and states) passes on the
            # comparison alone: the parameter was checked for Partial placements as list 0.
            if ref_spec is None or (spec is not ref_spec and (spec.placements != ref_spec.placements or (
                    spec.mesh is not ref_spec.mesh and spec.mesh != ref_spec.mesh))):
                if any(placement.is_partial() for placement in spec.placements):
                    raise ValueError(f"mixprec::{op}: list {li} index {i} is a DTensor with Partial placements "
                                     f"{t.placements}; reduce it first (FSDP2 hands the optimizer Shard placements)")
                if ref_spec is not None:
                    raise ValueError(f"mixprec::{op}: list {li} index {i} is laid out as {t.placements} but the "
                                     f"parameter as {ref.placements}; their local shards would not line up")
            converted.append(_shard_of(t))
        out.append(converted)
    return out


#: Which tensors of a list are sharded over which mesh dimension: {(mesh, mesh dim): [indices]}.
ShardLayout = dict


def shard_layout(tensors: Sequence[torch.Tensor]) -> Optional[ShardLayout]:
    """For each (device mesh, mesh dimension) some of ``tensors`` are sharded over, the indices of
    those tensors; None when none is sharded (plain tensors, replicated DTensors), the case where
    a norm of the local tensor is the norm of the whole one."""
    cls = dtensor_type()
    if cls is None:
        return None
    layout: ShardLayout = {}
    for i, t in enumerate(tensors):
        if isinstance(t, cls):
            for dim, placement in enumerate(t.placements):
                if placement.is_shard():
                    layout.setdefault((t.device_mesh, dim), []).append(i)
    return layout or None


def reduce_shard_norms(layout: ShardLayout, norms: torch.Tensor, ord: float) -> torch.Tensor:
    """Norms of whole tensors from ``norms`` (float32 ``[..., n]``: each rank's norms of its
    shards of n tensors): the squares summed (``ord`` 2) or the maxima taken (``ord`` inf) over
    the process group of every mesh dimension each tensor is sharded over. One all-reduce per
    mesh dimension, queued on the device like any collective (no host sync on NCCL)."""
    import torch.distributed as dist

    l2 = ord == 2
    values = norms.square() if l2 else norms.clone()
    op = dist.ReduceOp.SUM if l2 else dist.ReduceOp.MAX
    n = values.shape[-1]
    # Mesh dimensions in turn: a tensor sharded over several is summed over each, which sums it
    # over all of their ranks.
    for (mesh, dim), indices in layout.items():
        group = mesh.get_group(dim)
        if len(indices) == n:  # the usual case under FSDP2: every tensor sharded alike
            dist.all_reduce(values, op=op, group=group)
            continue
        where = torch.tensor(indices, dtype=torch.int64).to(values.device, non_blocking=True)
        part = values.index_select(-1, where)
        dist.all_reduce(part, op=op, group=group)
        values.index_copy_(-1, where, part)
    return values.sqrt() if l2 else values
