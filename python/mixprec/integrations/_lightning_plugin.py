"""The body of MixprecPrecision, shared by the `lightning` and `pytorch_lightning` namespaces: a
Lightning precision plugin that runs mixprec.amp (O0-O3, fp32 masters under O2) for Trainer and Fabric."""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch

from ._session import AmpSession

# The precision names Lightning users know, by (opt level, dtype). O2 has no Lightning twin (a
# low-precision model with fp32 masters); it is mixed, so it reports as the "-mixed" name.
_NAMES = {"O0": ("32-true", "32-true"), "O1": ("16-mixed", "bf16-mixed"), "O2": ("16-mixed", "bf16-mixed"),
          "O3": ("16-true", "bf16-true")}


class MixprecPrecisionBase:
    """Lightning precision plugin running ``mixprec.amp`` at an opt level.

    ``MixprecPrecision(opt_level="O2", dtype=torch.float16, loss_scale=None, **amp_kwargs)``:
    ``dtype`` is the low precision (float16 or bfloat16), ``loss_scale`` amp's (None: the level's
    default, dynamic for float16 and off for bfloat16; ``"dynamic"`` or a number), and the other
    keywords go to ``amp.initialize`` (``keep_batchnorm_fp32``, ``master_weights``,
    ``min_loss_scale``, ``max_loss_scale``, ``verbosity``, ``layer_kernels``, ...).

    - Trainer: ``Trainer(plugins=[MixprecPrecision("O2")])``; amp.initialize runs when training
      starts, on the LightningModule and the optimizers of ``configure_optimizers`` (a mixprec
      fused optimizer keeps the fp32 masters in its kernel; any other gets Apex's masters).
    - Fabric: Fabric never shows its precision plugin the optimizers, so call
      ``model, optimizer = plugin.initialize(model, optimizer)`` before ``fabric.setup``.

    An overflowing step is skipped on the device and the scale backs off; gradient clipping
    (``gradient_clip_val``, ``fabric.clip_gradients``) acts on the fp32 masters' unscaled
    gradients; the loss scalers' state is saved in Trainer checkpoints (Fabric: put the plugin in
    ``fabric.save``'s state dict, after the model and optimizer). Models whose training code
    calls submodules directly must feed them inputs of the model's dtype: amp casts the inputs
    of the LightningModule's own ``forward`` (as Apex cast the model's).
    """

    _lightning_module_cls: Optional[type] = None  # set by each namespace's subclass

    def __init__(self, opt_level: str = "O2", dtype: torch.dtype = torch.float16, loss_scale: Any = None,
                 **amp_kwargs: Any) -> None:
        super().__init__()
        self._session = AmpSession(type(self).__name__, opt_level, dtype, loss_scale, **amp_kwargs)
        self.precision = _NAMES[opt_level][dtype == torch.bfloat16]

    @property
    def opt_level(self) -> str:
        return self._session.opt_level

    @property
    def dtype(self) -> torch.dtype:
        return self._session.dtype

    # -- set-up ------------------------------------------------------------------------------
    def initialize(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """amp.initialize(model, optimizers) with this plugin's options (for Fabric, before
        ``fabric.setup``); returns ``model`` or ``(model, *optimizers)``, changed in place."""
        self._session.initialize(model, optimizers)
        return (model, *optimizers) if optimizers else model

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # The cast waits for connect (Trainer) or initialize (Fabric): O2's masters must start
        # from the fp32 values, which amp.initialize only sees with the optimizers beside the model.
        return module

    def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> Any:
        self._session.initialize(model, optimizers)
        return model, optimizers, lr_schedulers

    def forward_context(self) -> AbstractContextManager:
        self._session.check_current("forward_context")  # an un-cast fp32 forward would train silently wrong
        return nullcontext()  # amp patched the model's forward: casts (O2/O3) or autocast (O1) happen there

    # -- backward and step ---------------------------------------------------------------------
    def _under_trainer(self, module: Any) -> bool:
        # The class is Lightning's Trainer plugin, which Fabric also accepts; its Trainer hooks
        # (on_before_backward, LightningModule.backward) exist only for a module a Trainer runs.
        lm = self._lightning_module_cls
        return lm is not None and isinstance(module, lm) and getattr(module, "_trainer", None) is not None

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        return super().pre_backward(tensor, module) if self._under_trainer(module) else tensor

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        return super().post_backward(tensor, module) if self._under_trainer(module) else tensor

    def backward(self, tensor: torch.Tensor, model: Optional[torch.nn.Module], optimizer: Any = None, *args: Any,
                 **kwargs: Any) -> None:
        if self._under_trainer(model):
            run = lambda scaled: model.backward(scaled, *args, **kwargs)  # the hook users may override
        else:
            run = lambda scaled: scaled.backward(*args, **kwargs)
        self._session.backward(tensor, optimizer, run)

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Any = None, **kwargs: Any) -> Any:
        if closure is None:  # Fabric: the user's own loop ran forward and backward
            return optimizer.step(**kwargs)
        # amp's step takes no closure (Apex's rule): run Lightning's wrapped closure (forward,
        # scaled backward, unscale, gradient clipping) first, then step on unscaled gradients.
        result = self._wrap_closure(model, optimizer, closure)
        if result is None and getattr(model, "automatic_optimization", False):
            return None  # training_step returned None: Lightning skips this step
        return optimizer.step(**kwargs)

    def main_params(self, optimizer: Any):
        return self._session.master_params(optimizer)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self._session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._session.load_state_dict(state_dict)


def plugin_class(package: str, install: str, module: str) -> type:
    """MixprecPrecision on ``package``'s Precision base (``lightning.pytorch`` or
    ``pytorch_lightning``: two packages, two class hierarchies). Its name stays MixprecPrecision,
    the key under which Lightning saves the plugin's state in checkpoints."""
    try:
        framework = importlib.import_module(package)
        precision = importlib.import_module(f"{package}.plugins.precision").Precision
    except ImportError as err:  # an optional dependency: say what to install
        raise ImportError(f"{module} needs the `{package.split('.')[0]}` package ({install})") from err
    return type("MixprecPrecision", (MixprecPrecisionBase, precision),
                {"__doc__": MixprecPrecisionBase.__doc__, "__module__": module, "__qualname__": "MixprecPrecision",
                 "_lightning_module_cls": framework.LightningModule})
