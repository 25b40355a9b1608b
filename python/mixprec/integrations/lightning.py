"""mixprec's Lightning precision plugin for the `lightning` package (lightning.pytorch Trainer and
lightning.fabric Fabric): ``Trainer(plugins=[MixprecPrecision("O2")])``; see docs/integrations.md."""

from __future__ import annotations

try:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.plugins.precision import Precision
except ImportError as err:  # an optional dependency: say what to install
    raise ImportError("mixprec.integrations.lightning needs the `lightning` package (pip install lightning); "
                      "for the `pytorch_lightning` package use mixprec.integrations.pytorch_lightning") from err

from ._lightning_plugin import MixprecPrecisionBase


class MixprecPrecision(MixprecPrecisionBase, Precision):
    __doc__ = MixprecPrecisionBase.__doc__
    _lightning_module_cls = LightningModule


__all__ = ["MixprecPrecision"]
