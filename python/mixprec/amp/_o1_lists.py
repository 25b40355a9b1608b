"""O1's cast lists for amp.init's handle (Apex's functional/torch/tensor overrides, with today's
names added): which torch attribute gets which cast rule. Data only; _o1_patch applies it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.rnn import RNNBase

# Rules (the wrapper each kind gets is in _o1_patch):
#   half      floating args -> the handle's low dtype (fp16, or bf16); leaf weights are cached
#   float     floating args -> float32
#   promote   floating args -> the widest floating dtype among them (cat/stack: inside the sequence)
#   match     in-place Tensor methods: the other args -> self's dtype
#   inplace   in-place versions of the float list (x.exp_(), torch.exp_(x)): error on a
#             low-precision self, the other args -> float32
#   banned    error on any low-precision arg (float with allow_banned=True)
#   to_cpu    Tensor.cpu: low -> float32 before leaving the device
#   rnn_check RNNBase.check_input: accepts an input whose dtype differs from the fp32 weights

# -- torch.* ------------------------------------------------------------------------------------
TORCH_HALF = (
    # the functions behind nn layers, whose weights come in as arguments
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
    "prelu",
    # BLAS
    "addmm", "addmv", "addr", "matmul", "mm", "mv", "bmm", "baddbmm", "addbmm", "chain_matmul",
)
TORCH_FLOAT = (
    # point-wise functions whose range or accuracy fp16 does not hold
    "acos", "asin", "cosh", "sinh", "tan", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "pow",
    # reductions
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "var", "sum", "logsumexp", "renorm",
    # softmax and the normalizations torch exposes here (F's versions call these)
    "softmax", "log_softmax", "layer_norm", "group_norm",
)
TORCH_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "vdot",
    "add", "sub", "rsub", "mul", "div", "true_divide", "remainder", "fmod", "hypot",
    "maximum", "minimum", "fmax", "fmin",
    "eq", "equal", "ge", "gt", "le", "lt", "ne",
    "index_put",
    # sequence arguments: the widest type over the whole sequence
    "cat", "concat", "concatenate", "stack",
)

# -- torch.nn.functional ------------------------------------------------------------------------
FUNCTIONAL_HALF = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
    "linear", "prelu",
)
FUNCTIONAL_FLOAT = (
    "interpolate", "softplus", "softmin", "log_softmax", "softmax",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    # losses
    "poisson_nll_loss", "gaussian_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss",
    "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss", "binary_cross_entropy_with_logits",
    "smooth_l1_loss", "huber_loss", "soft_margin_loss", "triplet_margin_loss",
    "triplet_margin_with_distance_loss", "ctc_loss",
)
FUNCTIONAL_PROMOTE = ("bilinear",)
#: Needs its input already in fp32 (the output of a sigmoid, which fp16 rounds to exactly 0 or 1).
BANNED = ("binary_cross_entropy",)
BANNED_MESSAGE = (
    "amp (O1): F.binary_cross_entropy (and nn.BCELoss) got a float16/bfloat16 input; it is not safe in "
    "low precision, and amp does not cast it for you. Most models put a sigmoid right before it: use "
    "F.binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss), which fuses the two and runs in fp32 "
    "under amp. Or call amp.register_float_function(torch, 'sigmoid') before amp.init(). To run it in "
    "fp32 anyway, pass allow_banned=True to amp.init().")

LINALG_HALF = ("multi_dot",)
LINALG_FLOAT = ("norm", "vector_norm", "matrix_norm")

# -- torch.Tensor -------------------------------------------------------------------------------
TENSOR_HALF = ("__matmul__", "__rmatmul__")
TENSOR_FLOAT = ("__pow__", "__rpow__")
TENSOR_INPLACE_FLOAT = ("__ipow__",)
TENSOR_PROMOTE = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__div__", "__rdiv__", "__eq__", "__ne__", "__ge__", "__gt__", "__le__", "__lt__",
)
TENSOR_MATCH = ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__")

# -- RNNs: nn.RNN/LSTM/GRU and the cells call these through torch._VF --------------------------
VF_HALF = ("rnn_tanh", "rnn_relu", "lstm", "gru", "rnn_tanh_cell", "rnn_relu_cell", "lstm_cell", "gru_cell")


def _existing(owner, names):
    return [n for n in names if hasattr(owner, n)]


def patch_table(allow_banned: bool) -> list[tuple[object, str, str]]:
    """(owner, attribute, rule) for every attribute amp.init's handle replaces, each once, in
    the order they are installed (and reversed when removed). Names missing from the running
    torch are left out."""
    T = torch.Tensor
    rows: list[tuple[object, str, str]] = []

    def add(owner, names, kind):
        rows.extend((owner, n, kind) for n in _existing(owner, names))

    add(torch, TORCH_HALF, "half")
    add(torch, TORCH_FLOAT, "float")
    add(torch, TORCH_PROMOTE, "promote")
    add(torch, [n + "_" for n in TORCH_FLOAT], "inplace")
    add(F, FUNCTIONAL_HALF, "half")
    add(F, FUNCTIONAL_FLOAT, "float")
    add(F, FUNCTIONAL_PROMOTE, "promote")
    add(F, BANNED, "float" if allow_banned else "banned")
    add(torch.linalg, LINALG_HALF, "half")
    add(torch.linalg, LINALG_FLOAT, "float")
    # Tensor methods follow the torch lists (x.mm, x.sum, x.add ...), plus the operators.
    add(T, TENSOR_HALF + TORCH_HALF, "half")
    add(T, TENSOR_FLOAT + TORCH_FLOAT, "float")
    add(T, TENSOR_PROMOTE + TORCH_PROMOTE, "promote")
    add(T, TENSOR_INPLACE_FLOAT + tuple(n + "_" for n in TORCH_FLOAT), "inplace")
    add(T, TENSOR_MATCH + tuple(n + "_" for n in TORCH_HALF + TORCH_PROMOTE), "match")
    add(T, ("cpu",), "to_cpu")
    add(torch._VF, VF_HALF, "half")
    add(RNNBase, ("check_input",), "rnn_check")

    seen: set = set()
    table = []
    for owner, name, kind in rows:
        if (id(owner), name) not in seen:  # the first rule listed for a name wins
            seen.add((id(owner), name))
            table.append((owner, name, kind))
    return table
