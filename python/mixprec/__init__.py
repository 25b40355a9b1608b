"""mixprec: mixed-precision training for PyTorch: loss scaling, fused optimizers, apex.amp API.

Importing loads the compiled op library (torch.ops.mixprec) and never initializes CUDA.
"""

from . import _library
from ._ops_fp8 import fp8_amax_, fp8_quantize, fp8_update_scale_
from ._ops import (
    adagrad_,
    adam_,
    lamb_,
    layer_norm,
    linear,
    linear_bias_grad,
    linear_weight_bias_grad,
    multi_tensor_norm,
    non_finite_check_and_unscale_,
    novograd_,
    rms_norm,
    scale_,
    sgd_,
    update_scale_,
)

from ._cross_entropy import cross_entropy  # noqa: E402  (registers its autograd on the loaded op)
from . import optimizers  # noqa: E402  (needs the ops loaded above)
from .grad_scaler import GradScaler  # noqa: E402
from . import amp  # noqa: E402
from . import diagnostics  # noqa: E402
from .apex_alias import enable_apex_alias  # noqa: E402
from . import apex_alias as _apex_alias  # noqa: E402

_apex_alias.enable_from_env()  # MIXPREC_APEX_ALIAS=1: `import apex` resolves to mixprec

__version__ = "0.1.0"

#: Put this on CMAKE_PREFIX_PATH (beside torch.utils.cmake_prefix_path) for find_package(mixprec).
cmake_prefix_path = _library.cmake_prefix_path()

__all__ = [
    "GradScaler",
    "amp",
    "diagnostics",
    "enable_apex_alias",
    "adagrad_",
    "adam_",
    "fp8_amax_",
    "fp8_quantize",
    "fp8_update_scale_",
    "lamb_",
    "layer_norm",
    "linear",
    "linear_bias_grad",
    "linear_weight_bias_grad",
    "novograd_",
    "rms_norm",
    "sgd_",
    "cmake_prefix_path",
    "cross_entropy",
    "multi_tensor_norm",
    "optimizers",
    "non_finite_check_and_unscale_",
    "scale_",
    "update_scale_",
]
