"""The optional `compile` extra: packages the compiler needs and the runtime never imports.

`pip install kvrewrite` is enough to load and run compressed checkpoints (torch, transformers);
compiling, evaluating on the bundled Wikipedia slice and drawing plots need `pip install 'kvrewrite[compile]'`.
Checked with find_spec (nothing is imported), so a command can refuse up front instead of failing mid-run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from kvrewrite.errors import MissingDependencyError

# import name -> distribution name (what pip installs), in pyproject's `compile` extra.
COMPILE_EXTRA = {"gensim": "gensim", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}
INSTALL_COMPILE = "pip install 'kvrewrite[compile]'"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed install counts as missing
        return False


def missing_compile_packages(modules: Iterable[str] | None = None) -> list[str]:
    """Distribution names of the `compile` extra (or of `modules`, import names from it) that are not installed."""
    return [COMPILE_EXTRA[m] for m in (modules if modules is not None else COMPILE_EXTRA) if not _installed(m)]


def require_compile_extra(what: str, modules: Iterable[str] | None = None) -> None:
    """Raise MissingDependencyError naming the missing packages and the install command if `what` cannot run."""
    missing = missing_compile_packages(modules)
    if missing:
        raise MissingDependencyError(
            f"{what} needs the compiler's extra dependencies; missing: {', '.join(missing)}. "
            f"Install them with `{INSTALL_COMPILE}` (loading compressed checkpoints needs none of them)"
        )
