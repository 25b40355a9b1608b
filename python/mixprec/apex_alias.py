"""The opt-in legacy alias: ``import apex``, ``from apex import amp``, ``from apex.optimizers
import FusedAdam`` (and apex.multi_tensor_apply, apex.parallel.LARC, apex.normalization and the
top-level ``amp_C``, see mixprec.apex_compat) resolve to mixprec when no real apex is installed.

Turn it on with ``mixprec.enable_apex_alias()`` or the environment variable
``MIXPREC_APEX_ALIAS=1``. The variable is read at interpreter start-up by the
``mixprec_apex_alias.pth`` file the wheel puts at the root of site-packages (source:
``python/mixprec_apex_alias.pth``), so Apex scripts that never ``import mixprec`` get the alias;
that line imports nothing, and imports mixprec only when ``import apex`` finds no real apex.
``import mixprec`` reads it too (for source checkouts on PYTHONPATH). A finder is appended to
``sys.meta_path``, so it is consulted only after every normal finder failed: an installed apex
always wins.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

#: apex module name -> the mixprec module that stands in for it.
ALIASES = {
    "apex": None,  # a small package module made here (see PACKAGES)
    "apex.amp": "mixprec.amp",
    "apex.optimizers": "mixprec.apex_compat.optimizers",  # Apex's defaults (FusedSGD's momentum dtype)
    "apex.multi_tensor_apply": "mixprec.apex_compat.multi_tensor_apply",
    "apex.parallel": "mixprec.apex_compat.parallel",
    "apex.parallel.LARC": "mixprec.apex_compat.larc",
    "apex.normalization": "mixprec.apex_compat.normalization",
    "apex.normalization.fused_layer_norm": "mixprec.apex_compat.normalization",
    "amp_C": "mixprec.apex_compat.amp_c",
}

#: Aliases that are packages in Apex (they have submodules): each is a module made here holding
#: Apex's public names of the package, taken from its mixprec module, so that importing a
#: submodule (which sets an attribute on its parent) never touches a mixprec module.
PACKAGES = {
    "apex": (),
    "apex.parallel": ("LARC",),
    "apex.normalization": ("FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"),
}

ENV_VAR = "MIXPREC_APEX_ALIAS"


def _apex_getattr(name: str):
    """``apex.<name>`` for an aliased submodule not imported yet (Apex's __init__ imports them all)."""
    if f"apex.{name}" in ALIASES:
        return importlib.import_module(f"apex.{name}")
    raise AttributeError(f"module 'apex' (mixprec's stand-in) has no attribute {name!r}")


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, fullname: str) -> None:
        self.fullname = fullname

    def create_module(self, spec):
        if self.fullname in PACKAGES:
            module = types.ModuleType(self.fullname, f"mixprec standing in for {self.fullname} "
                                                     "(mixprec.enable_apex_alias)")
            module.__path__ = []  # a package, so that its submodules are importable
            module.__mixprec_alias__ = True
            return module
        module = importlib.import_module(ALIASES[self.fullname])
        self._own_spec = module.__spec__  # the import system overwrites it; put back below
        return module

    def exec_module(self, module) -> None:
        own_spec = getattr(self, "_own_spec", None)
        if own_spec is not None:
            module.__spec__ = own_spec  # mixprec.amp stays mixprec.amp (reload, introspection)
        if self.fullname == "apex":
            module.amp = importlib.import_module("mixprec.amp")
            module.optimizers = importlib.import_module(ALIASES["apex.optimizers"])
            module.__getattr__ = _apex_getattr
        elif self.fullname in PACKAGES:
            target = importlib.import_module(ALIASES[self.fullname])
            module.__doc__ = target.__doc__
            if hasattr(target, "__getattr__"):
                module.__getattr__ = target.__getattr__  # names not provided say what to use instead
            # Submodules first, as Apex's __init__ does: importing one binds it on the package, and
            # the names bound next win (apex.parallel.LARC is the class, not the module).
            for child in ALIASES:
                if child.rpartition(".")[0] == self.fullname:
                    importlib.import_module(child)
            for name in PACKAGES[self.fullname]:
                setattr(module, name, getattr(target, name))


class _ApexAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in ALIASES:
            return None
        if fullname != "apex" and sys.modules.get("apex") is not None and \
                not getattr(sys.modules["apex"], "__mixprec_alias__", False):
            return None  # a real apex package is imported: its submodules and amp_C are its own
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname), is_package=fullname in PACKAGES)


def _installed() -> bool:
    return any(isinstance(f, _ApexAliasFinder) for f in sys.meta_path)


def enable_apex_alias() -> bool:
    """Makes ``import apex`` (and the submodules and ``amp_C`` in ALIASES) resolve to mixprec unless a
    real apex is importable. Returns True when the alias is active, False when a real apex was
    found (and is used instead). Idempotent."""
    real = sys.modules.get("apex")
    if real is not None and not getattr(real, "__mixprec_alias__", False):
        return False
    if real is None and importlib.machinery.PathFinder.find_spec("apex") is not None:
        return False
    if not _installed():
        sys.meta_path.append(_ApexAliasFinder())
    return True


def disable_apex_alias() -> None:
    """Removes the alias and forgets the aliased modules (for tests and embedding)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ApexAliasFinder)]
    if getattr(sys.modules.get("apex"), "__mixprec_alias__", False) or sys.modules.get("apex") is None:
        for name in ALIASES:
            module = sys.modules.get(name)
            if module is not None and (getattr(module, "__mixprec_alias__", False) or
                                       module.__name__.startswith("mixprec.")):
                del sys.modules[name]


def enable_from_env() -> bool:
    """Called by ``import mixprec``: enables the alias when MIXPREC_APEX_ALIAS is 1/true/yes/on."""
    if os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
        return enable_apex_alias()
    return False
