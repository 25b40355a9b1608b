"""The `mixprec` command line (`mixprec compare`) and the Task type its --task entry points return."""

from .task import Task

__all__ = ["Task"]
