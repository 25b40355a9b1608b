"""mixprec's Lightning precision plugin for the standalone `pytorch_lightning` package (the same
behaviour as mixprec.integrations.lightning's; checkpoints use the same key, "MixprecPrecision")."""

from ._lightning_plugin import plugin_class

MixprecPrecision = plugin_class("pytorch_lightning", "pip install pytorch-lightning; for the `lightning` "
                                "package use mixprec.integrations.lightning", __name__)

__all__ = ["MixprecPrecision"]
