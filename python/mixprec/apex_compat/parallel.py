"""The ``apex.parallel`` of mixprec's apex alias: LARC only. Apex's distributed pieces are not
provided; importing one raises an ImportError that names torch's replacement."""

from __future__ import annotations

from ._errors import not_provided_getattr
from .larc import LARC

#: Apex's apex.parallel names mixprec does not provide, and what to use instead.
NOT_PROVIDED = {
    "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "Reducer": "torch.nn.parallel.DistributedDataParallel (its bucketed all-reduce is built in)",
    "SyncBatchNorm": "torch.nn.SyncBatchNorm",
    "convert_syncbn_model": "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
    "create_syncbn_process_group": "torch.distributed.new_group",
    "distributed": "torch.nn.parallel.DistributedDataParallel",
    "optimized_sync_batchnorm": "torch.nn.SyncBatchNorm",
    "optimized_sync_batchnorm_kernel": "torch.nn.SyncBatchNorm",
    "sync_batchnorm": "torch.nn.SyncBatchNorm",
    "sync_batchnorm_kernel": "torch.nn.SyncBatchNorm",
    "multiproc": "torchrun",
}


# ImportError, not AttributeError: `from apex.parallel import X` keeps the message only so.
__getattr__ = not_provided_getattr("apex.parallel", NOT_PROVIDED, ImportError)

__all__ = ["LARC"]
