"""Optional packages, each needed by one feature only, which the runtime never imports.

`pip install kvrewrite` loads and runs compressed checkpoints and compiles with synthetic or user-file calibration
(torch, transformers). gensim is needed only for the Wikipedia and news texts it ships (`--calibration wiki`, the
held-out evaluation), scikit-learn only for `--reduce kmeans`, matplotlib only for plots; `pip install
'kvrewrite[compile]'` installs all three. Checked with find_spec (nothing is imported), so a command refuses up
front, naming the package and the feature, instead of failing mid-run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from kvrewrite.errors import MissingDependencyError

# import name -> distribution name (what pip installs), in pyproject's `compile` extra.
COMPILE_EXTRA = {"gensim": "gensim", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}
INSTALL_COMPILE = "pip install 'kvrewrite[compile]'"
# The features that need one of them, as errors name them.
WIKI_TEXT = "the Wikipedia and news text (`--calibration wiki`, held-out evaluation; gensim ships it)"
KMEANS = "`--reduce kmeans`"
PLOTS = "plots"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed install counts as missing
        return False


def missing_compile_packages(modules: Iterable[str] | None = None) -> list[str]:
    """Distribution names of the `compile` extra (or of `modules`, import names from it) that are not installed."""
    return [COMPILE_EXTRA[m] for m in (modules if modules is not None else COMPILE_EXTRA) if not _installed(m)]


def require_package(module: str, feature: str) -> None:
    """Raise MissingDependencyError, one line naming the package and the feature, if `module` is not installed."""
    if not _installed(module):
        package = COMPILE_EXTRA[module]
        raise MissingDependencyError(
            f"{feature} needs {package}, which is not installed: `pip install {package}` (or `{INSTALL_COMPILE}` "
            "for every optional feature)"
        )


def require_compile_extra(what: str, modules: Iterable[str] | None = None) -> None:
    """Raise MissingDependencyError naming the missing packages and the install command if `what` cannot run."""
    missing = missing_compile_packages(modules)
    if missing:
        raise MissingDependencyError(
            f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"`{INSTALL_COMPILE}` (loading compressed checkpoints needs none of them)"
        )
