"""mixprec's Lightning precision plugin for the standalone `pytorch_lightning` package (same class
and behaviour as mixprec.integrations.lightning's; checkpoints use the same key)."""

from __future__ import annotations

try:
    from pytorch_lightning import LightningModule
    from pytorch_lightning.plugins.precision import Precision
except ImportError as err:  # an optional dependency: say what to install
    raise ImportError("mixprec.integrations.pytorch_lightning needs the `pytorch_lightning` package "
                      "(pip install pytorch-lightning); for `lightning` use mixprec.integrations.lightning") from err

from ._lightning_plugin import MixprecPrecisionBase


class MixprecPrecision(MixprecPrecisionBase, Precision):
    __doc__ = MixprecPrecisionBase.__doc__
    _lightning_module_cls = LightningModule


__all__ = ["MixprecPrecision"]
