"""The saved result of `kvrewrite eval`: DIR/eval_results.json, which the model card's evaluation table cites."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.io.atomic_files import atomic_write_text

EVAL_RESULTS_FILE = "eval_results.json"
# Continuation-mode results (`kvrewrite eval --positions`) are kept apart: the card's table is the windows' table.
CONTINUATION_RESULTS_FILE = "eval_results_continuation.json"
EVAL_TEXT = "held-out Wikipedia articles (gensim's enwiki slice; never used for calibration)"


def eval_results_document(
    rows: list[dict],
    *,
    tokens: int,
    seq_len: int,
    command: str,
    text: str = EVAL_TEXT,
    positions: list[str] | None = None,
) -> dict:
    """What `kvrewrite eval` saves: the rows plus how they were measured, so a model card can cite them.
    positions: the scored position ranges of a continuation evaluation (seq_len is then the window length)."""
    from kvrewrite import __version__

    settings = {"tokens": tokens, "seq_len": seq_len, "text": text}
    if positions:
        settings["positions"] = positions
    return {
        "rows": rows,
        "settings": settings,
        "command": command,
        "kvrewrite_version": __version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_eval_results(directory: Path, document: dict, file_name: str = EVAL_RESULTS_FILE) -> Path:
    return atomic_write_text(Path(directory) / file_name, json.dumps(document, indent=2) + "\n")


def read_eval_results(directory: Path) -> dict | None:
    """The saved evaluation of a checkpoint, or None if `kvrewrite eval` was never run on it."""
    path = Path(directory) / EVAL_RESULTS_FILE
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        rows = document["rows"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "perplexity" in r for r in rows):
            raise ValueError("rows must be a list of result objects with a perplexity")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{path} is not a kvrewrite evaluation result ({exc}); re-run `kvrewrite eval`"
        ) from exc
    return document
