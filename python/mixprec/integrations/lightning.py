"""mixprec's Lightning precision plugin for the `lightning` package (lightning.pytorch Trainer and
lightning.fabric Fabric): ``Trainer(plugins=[MixprecPrecision("O2")])``; see docs/integrations.md."""

from ._lightning_plugin import plugin_class

MixprecPrecision = plugin_class("lightning.pytorch", "pip install lightning; for the standalone "
                                "pytorch_lightning package use mixprec.integrations.pytorch_lightning", __name__)

__all__ = ["MixprecPrecision"]
