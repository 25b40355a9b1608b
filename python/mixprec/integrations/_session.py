"""The framework-neutral half of mixprec's integrations: one amp.initialize with checked options,
then the scaled backward, the master params to clip and the scaler state that every plugin needs."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

from .. import amp
from ..amp._scaler import _amp_state

LOW_DTYPES = (torch.float16, torch.bfloat16)
# amp.initialize's keywords that a plugin passes through unchanged; the rest (models, optimizers,
# opt_level, dtype, loss_scale) the plugin sets itself.
PASSED_THROUGH = frozenset({"keep_batchnorm_fp32", "master_weights", "cast_model_outputs", "min_loss_scale",
                            "max_loss_scale", "verbosity", "scale_history", "layer_kernels", "cast_model_type"})


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Lightning's LightningOptimizer and
    Fabric's _FabricOptimizer hold it as ``_optimizer`` / ``optimizer``, accelerate's
    AcceleratedOptimizer as ``optimizer``): amp's bookkeeping lives on the inner object."""
    for _ in range(4):  # wrappers nest (a LightningOptimizer around an AcceleratedOptimizer, ...)
        if hasattr(optimizer, "_amp_stash"):
            return optimizer
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return optimizer
        optimizer = inner
    return optimizer


class AmpSession:
    """amp.initialize's options, checked when the plugin is built (so a typo fails at once, not
    after the framework has set up its run), and the models and optimizers one initialize made.

    amp's loss scalers are process-wide (as Apex's were): a later amp.initialize anywhere replaces
    them, and this session then refuses to scale or save rather than use another run's scale."""

    def __init__(self, owner: str, opt_level: str = "O2", dtype: torch.dtype = torch.float16,
                 loss_scale: Any = None, **amp_kwargs: Any) -> None:
        if opt_level not in amp.opt_levels:
            raise ValueError(f"{owner}: opt_level must be one of {sorted(amp.opt_levels)}, got {opt_level!r}")
        if dtype not in LOW_DTYPES:
            raise ValueError(f"{owner}: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        if loss_scale is not None and loss_scale != "dynamic" and (
                isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float))
                or not 0 < loss_scale < float("inf")):
            raise ValueError(f"{owner}: loss_scale must be None (the level's default), 'dynamic' or a positive "
                             f"finite number, got {loss_scale!r}")
        unknown = sorted(set(amp_kwargs) - PASSED_THROUGH)
        if unknown:
            raise TypeError(f"{owner}: unexpected keyword argument(s) {unknown}; amp.initialize keywords accepted "
                            f"here: {sorted(PASSED_THROUGH)}")
        self.owner, self.opt_level, self.dtype = owner, opt_level, dtype
        self.kwargs = dict(amp_kwargs, dtype=dtype)
        if loss_scale is not None:
            self.kwargs["loss_scale"] = loss_scale
        self.model: Optional[torch.nn.Module] = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._scalers: Optional[list] = None  # amp's scaler list when we initialized: identity marks our run

    @property
    def initialized(self) -> bool:
        return self.model is not None

    def initialize(self, model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """amp.initialize(model, optimizers) once. Calling again with the same model and no new
        optimizer (Lightning's validate after fit) changes nothing; another model is refused."""
        optimizers = [unwrap_optimizer(o) for o in optimizers]
        if self.initialized:
            if model is self.model and all(any(o is k for k in self.optimizers) for o in optimizers):
                return
            raise RuntimeError(f"{self.owner}: this plugin already initialized amp for "
                               f"{type(self.model).__name__} with {len(self.optimizers)} optimizer(s); amp casts and "
                               "patches them in place, so a new model or optimizer needs a new plugin (and model)")
        if optimizers:
            amp.initialize(model, optimizers, opt_level=self.opt_level, **self.kwargs)
        else:
            amp.initialize(model, opt_level=self.opt_level, **self.kwargs)
        self.model, self.optimizers, self._scalers = model, optimizers, _amp_state.loss_scalers

    def check_current(self, call: str) -> None:
        if not self.initialized:
            raise RuntimeError(f"{self.owner}.{call}: amp is not initialized for this plugin yet; under Lightning's "
                               "Trainer that happens when training starts, under Fabric call "
                               "plugin.initialize(model, optimizer) before fabric.setup(model, optimizer)")
        if _amp_state.loss_scalers is not self._scalers:
            raise RuntimeError(f"{self.owner}.{call}: amp.initialize was called again elsewhere after this plugin "
                               "initialized amp; amp's loss scalers are process-wide, so one amp-initialized run "
                               "trains at a time")

    def optimizers_for(self, optimizer: Any, call: str) -> list[torch.optim.Optimizer]:
        """The optimizers whose params a backward reaches: the one named, else all of ours."""
        if optimizer is None:
            if not self.optimizers:
                raise RuntimeError(f"{self.owner}.{call}: no optimizer went through amp.initialize (the run was set "
                                   "up without one), so there is nothing to step")
            return self.optimizers
        optimizer = unwrap_optimizer(optimizer)
        if not any(optimizer is o for o in self.optimizers):
            raise RuntimeError(f"{self.owner}.{call}: optimizer {type(optimizer).__name__} did not go through this "
                               "plugin's amp.initialize")
        return [optimizer]

    def backward(self, loss: torch.Tensor, optimizer: Any, run_backward, call: str = "backward") -> None:
        """``run_backward(scaled_loss)`` inside amp.scale_loss: the loss scaled, and on exit the
        gradients unscaled (into the fp32 masters under O2), checked and the scale updated."""
        self.check_current(call)
        with amp.scale_loss(loss, self.optimizers_for(optimizer, call)) as scaled:
            run_backward(scaled)

    def master_params(self, optimizer: Any) -> Iterator[torch.Tensor]:
        """What to clip: the fp32 masters under O2 (their .grad are unscaled), else the params."""
        return amp.master_params(unwrap_optimizer(optimizer))

    def state_dict(self) -> dict:
        if not self.initialized:
            return {}
        self.check_current("state_dict")
        return amp.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.check_current("load_state_dict")
        amp.load_state_dict(state)
