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
        raise type(e)(f"{call}: {e}") from e
