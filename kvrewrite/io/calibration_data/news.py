"""News stories from the Lee corpus that ships inside the gensim wheel: a second held-out domain for evaluation.

gensim's test data holds ``lee_background.cor``: 300 short Australian news stories, one per line. The first half is
free for calibration experiments (benchmarks use it as a "user's own files" source); the second half is held out,
so a checkpoint calibrated on Wikipedia can be scored on text of another domain.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvrewrite.errors import CalibrationError

__all__ = ["news_stories", "news_split"]

_CORPUS_RELPATH = ("test", "test_data", "lee_background.cor")


def news_stories() -> list[str]:
    """Every story of the corpus, in file order."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise CalibrationError("the news text ships with gensim; install it with `pip install 'kvrewrite[compile]'`")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_CORPUS_RELPATH)
    if not path.is_file():
        raise CalibrationError(f"gensim is installed but its news corpus {path} is missing; reinstall gensim")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def news_split() -> tuple[list[str], list[str]]:
    """(first half, held-out second half) of the stories, in file order."""
    stories = news_stories()
    half = len(stories) // 2
    return stories[:half], stories[half:]
