"""Apex's opt levels O0-O3 and their properties, with Apex's validation of user overrides, plus
mixprec's choice of the low-precision dtype (float16 or bfloat16) at every level."""

from __future__ import annotations

import logging

import torch

from .._loss_scale import check_scale

logger = logging.getLogger("mixprec.amp")

LOW_DTYPES = (torch.float16, torch.bfloat16)


def warn_or_err(msg: str) -> None:
    # Apex's hard_override switch is off in every released version: inconsistent options raise.
    raise RuntimeError(msg)


class Properties:
    """The options an opt level sets, each overridable through amp.initialize's keywords."""

    def __init__(self) -> None:
        self.options = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def __getattr__(self, name):
        if "options" in self.__dict__ and name in self.__dict__["options"]:
            return self.__dict__["options"][name]
        raise AttributeError(f"'Properties' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        if "options" not in self.__dict__:
            super().__setattr__(name, value)
            return
        if name not in self.options:
            super().__setattr__(name, value)
            return
        if name == "cast_model_type":
            if self.opt_level == "O1" and value is not None and value is not False and value is not torch.float32:
                warn_or_err("O1 inserts casts around Torch functions rather than model weights, so with O1, the "
                            "model weights themselves should remain FP32. If you wish to cast the model to a "
                            "different type, use opt_level='O2' or 'O3'. To run O1 in bfloat16, pass "
                            f"dtype=torch.bfloat16. cast_model_type was {value}")
            if value not in (None, False, torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"cast_model_type must be None, torch.float32, torch.float16 or torch.bfloat16, "
                                 f"got {value!r}")
            self.options[name] = value
        elif name == "patch_torch_functions":
            if self.opt_level != "O1" and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'.")
            self.options[name] = bool(value)
        elif name == "keep_batchnorm_fp32":
            if self.opt_level == "O1" and value is not None:
                warn_or_err("With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
                            f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}")
            if value == "False":
                self.options[name] = False
            elif value == "True":
                self.options[name] = True
            else:
                if not (value is True or value is False or value is None):
                    raise AssertionError("keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', "
                                         f"or None, found keep_batchnorm_fp32={value}")
                self.options[name] = value
        elif name == "master_weights":
            if self.opt_level == "O1" and value is not None:
                warn_or_err("It doesn't make sense to use master_weights with O1. With O1, your model weights "
                            "themselves should be FP32.")
            self.options[name] = value
        elif name == "loss_scale":
            if value == "dynamic":
                self.options[name] = value
            else:
                if isinstance(value, str):  # Apex accepted numbers written as strings ("128.0")
                    try:
                        value = float(value)
                    except ValueError:
                        raise ValueError(f"loss_scale must be 'dynamic' or a number, got {value!r}") from None
                self.options[name] = check_scale("loss_scale", value)
        else:
            self.options[name] = value


class O3:
    brief = "O3:  Pure FP16 training."
    more = ("Calls .half() on your model, converting the entire model to FP16.\n"
            "A casting operation is also inserted to cast incoming Tensors to FP16,\n"
            "so you don't need to change your data pipeline.\n"
            "This mode is useful for establishing a performance ceiling.\n"
            "It's also possible training may 'just work' in this mode.\n"
            "If not, try other optimization levels.")

    def __call__(self, properties: Properties, low: torch.dtype) -> Properties:
        properties.enabled = True
        properties.opt_level = "O3"
        properties.cast_model_type = low
        properties.patch_torch_functions = False
        properties.keep_batchnorm_fp32 = False
        properties.master_weights = False
        properties.loss_scale = 1.0
        return properties


class O2:
    brief = "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n"
    more = ("Calls .half() on your model, converting the entire model (except for batchnorms)\n"
            "to FP16.  Batchnorms are retained in FP32 for additional stability.\n"
            "The forward pass is patched to cast incoming Tensors to FP16, so you don't need to change\n"
            "your data pipeline.\n"
            "O2 creates FP32 master weights outside the model and patches any optimizers to update\n"
            "these master weights, then copy the master weights into the FP16 model weights.\n"
            "Master weights can also improve convergence and stability.")

    def __call__(self, properties: Properties, low: torch.dtype) -> Properties:
        properties.enabled = True
        properties.opt_level = "O2"
        properties.cast_model_type = low
        properties.patch_torch_functions = False
        properties.keep_batchnorm_fp32 = True
        properties.master_weights = True
        properties.loss_scale = "dynamic" if low == torch.float16 else 1.0
        return properties


class O1:
    brief = "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n"
    more = ("The type of your model's weights is not altered.  However, internally,\n"
            "Pytorch functions run in FP16 where that is safe and in FP32 where it is not: mixprec\n"
            "runs the model's forward under torch.autocast (it patches no torch function).\n"
            "Loss scaling is dynamic for float16.")

    def __call__(self, properties: Properties, low: torch.dtype) -> Properties:
        properties.enabled = True
        properties.opt_level = "O1"
        properties.cast_model_type = None
        properties.patch_torch_functions = True
        properties.keep_batchnorm_fp32 = None
        properties.master_weights = None
        properties.loss_scale = "dynamic" if low == torch.float16 else 1.0
        return properties


class O0:
    brief = "O0:  Pure FP32 training.\n"
    more = ("Your models are checked to make sure parameters are FP32, but otherwise the\n"
            "types of weights and internal Pytorch operations are not altered.  This mode disables any\n"
            "FP16 arithmetic, although other optimizations like DDP interop may still be requested.\n")

    def __call__(self, properties: Properties, low: torch.dtype) -> Properties:
        properties.enabled = True
        properties.opt_level = "O0"
        properties.cast_model_type = torch.float32
        properties.patch_torch_functions = False
        properties.keep_batchnorm_fp32 = None
        properties.master_weights = False
        properties.loss_scale = 1.0
        return properties


opt_levels = {"O3": O3(), "O2": O2(), "O1": O1(), "O0": O0()}
