# Type signature of amp.initialize for type checkers: the models and optimizers come back as the
# types given (a model alone when optimizers is None), which the implementation's Apex-style
# untyped signature cannot say. Keep in step with _initialize.py (tests/typing checks user code).
from typing import Any, Literal, Optional, Sequence, TypeVar, Union, overload

import torch

from mixprec.fp8 import Fp8Recipe

_Models = TypeVar("_Models", bound=Union[torch.nn.Module, Sequence[torch.nn.Module]])
_Optimizers = TypeVar("_Optimizers", bound=Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]])
_OptLevel = Literal["O0", "O1", "O2", "O3"]
_LossScale = Union[float, Literal["dynamic"], None]

@overload
def initialize(
    models: _Models, optimizers: None = None, enabled: bool = True, opt_level: _OptLevel = "O1",
    cast_model_type: Optional[torch.dtype] = None, patch_torch_functions: Optional[bool] = None,
    keep_batchnorm_fp32: Union[bool, str, None] = None, master_weights: Optional[bool] = None,
    loss_scale: _LossScale = None, cast_model_outputs: Optional[torch.dtype] = None, num_losses: int = 1,
    verbosity: int = 1, min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0**24, *,
    dtype: Optional[torch.dtype] = None, scale_history: int = 0, process_group: Any = None,
    layer_kernels: Optional[bool] = None, fp8: Union[bool, Fp8Recipe, None] = None,
) -> _Models: ...
@overload
def initialize(
    models: _Models, optimizers: _Optimizers, enabled: bool = True, opt_level: _OptLevel = "O1",
    cast_model_type: Optional[torch.dtype] = None, patch_torch_functions: Optional[bool] = None,
    keep_batchnorm_fp32: Union[bool, str, None] = None, master_weights: Optional[bool] = None,
    loss_scale: _LossScale = None, cast_model_outputs: Optional[torch.dtype] = None, num_losses: int = 1,
    verbosity: int = 1, min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0**24, *,
    dtype: Optional[torch.dtype] = None, scale_history: int = 0, process_group: Any = None,
    layer_kernels: Optional[bool] = None, fp8: Union[bool, Fp8Recipe, None] = None,
) -> tuple[_Models, _Optimizers]: ...
