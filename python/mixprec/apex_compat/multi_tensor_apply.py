"""Apex's ``apex.multi_tensor_apply``: the ``multi_tensor_applier`` that calls an amp_C op as
``op(chunk_size, noop_flag, tensor_lists, *args)``. Always available: the ops are mixprec's."""

from __future__ import annotations


class MultiTensorApply:
    """Calls ``op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)``. mixprec's ops choose
    their own chunking, so ``chunk_size`` is only passed along (Apex's default: 2048 * 32)."""

    available = True  # Apex sets it False when its amp_C extension failed to import
    warned = False

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raises here when amp_C is missing; mixprec's stand-in is always importable."""

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
