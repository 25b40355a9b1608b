"""The opt-in legacy alias: ``import apex``, ``from apex import amp`` and ``from apex.optimizers
import FusedAdam`` resolve to mixprec when no real apex is installed.

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
    "apex": None,  # a small package module made here, with amp and optimizers attributes
    "apex.amp": "mixprec.amp",
    "apex.optimizers": "mixprec.optimizers",
}

ENV_VAR = "MIXPREC_APEX_ALIAS"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, fullname: str) -> None:
        self.fullname = fullname

    def create_module(self, spec):
        target = ALIASES[self.fullname]
        if target is not None:
            module = importlib.import_module(target)
            self._own_spec = module.__spec__  # the import system overwrites it; put back below
            return module
        module = types.ModuleType("apex", "mixprec standing in for apex (mixprec.enable_apex_alias)")
        module.__path__ = []  # a package, so that apex.amp and apex.optimizers are importable
        module.__mixprec_alias__ = True
        return module

    def exec_module(self, module) -> None:
        own_spec = getattr(self, "_own_spec", None)
        if own_spec is not None:
            module.__spec__ = own_spec  # mixprec.amp stays mixprec.amp (reload, introspection)
        if self.fullname == "apex":
            module.amp = importlib.import_module("mixprec.amp")
            module.optimizers = importlib.import_module("mixprec.optimizers")


class _ApexAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in ALIASES:
            return None
        if fullname != "apex" and not getattr(sys.modules.get("apex"), "__mixprec_alias__", False):
            return None  # a real apex package is imported: its submodules are its own
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname), is_package=fullname == "apex")


def _installed() -> bool:
    return any(isinstance(f, _ApexAliasFinder) for f in sys.meta_path)


def enable_apex_alias() -> bool:
    """Makes ``import apex`` (and ``apex.amp``, ``apex.optimizers``) resolve to mixprec unless a
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
    if getattr(sys.modules.get("apex"), "__mixprec_alias__", False):
        for name in list(ALIASES):
            sys.modules.pop(name, None)


def enable_from_env() -> bool:
    """Called by ``import mixprec``: enables the alias when MIXPREC_APEX_ALIAS is 1/true/yes/on."""
    if os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
        return enable_apex_alias()
    return False
