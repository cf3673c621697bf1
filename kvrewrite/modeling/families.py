"""Stable import path for checkpoint stubs: re-exports every compressed family's classes (kvrewrite/modeling/__init__.py)."""

from kvrewrite.runtime.modeling.families import *  # noqa: F401,F403
