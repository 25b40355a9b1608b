"""Errors of the Apex stand-ins: a mixprec op's error re-raised with the Apex call's name first."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def named(call: str):
    """Errors from mixprec's ops name the Apex call first (the op's own message says which
    argument and index). mixprec's ops validate before they write, so a refused call changes
    nothing."""
    try:
        yield
    except NotImplementedError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        message = f"{call}: {e}"
        try:
            renamed = type(e)(message)
        except TypeError:  # an error class whose constructor takes more than a message
            renamed = RuntimeError(message)
        raise renamed from e


def not_provided_getattr(module: str, not_provided: dict[str, str], exc_type=AttributeError):
    """A module ``__getattr__``: a name Apex has and mixprec does not raises ``exc_type`` saying
    what to use instead; any other name is a plain AttributeError."""

    def __getattr__(name: str):
        if name in not_provided:
            raise exc_type(f"{module}.{name} is not provided by mixprec's apex alias; use {not_provided[name]}")
        raise AttributeError(f"module {module!r} (mixprec's stand-in) has no attribute {name!r}")

    return __getattr__
