"""token_policy.json: the load() options a `kvrewrite budget` split recorded in a checkpoint, read at load time.

The compiler side (kvrewrite.compile.token_budget) measures the split and writes the file; the runtime only reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrewrite.errors import CorruptCheckpointError

TOKEN_POLICY_FILE = "token_policy.json"


def read_token_policy(directory: Path) -> dict | None:
    """The load() options recorded by a budget split, or None."""
    path = Path(directory) / TOKEN_POLICY_FILE
    if not path.is_file():
        return None
    try:
        options = json.loads(path.read_text(encoding="utf-8"))["load"]
        missing = {"rate", "recent_window", "kv_codec", "evict"} - set(options)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{path}: unreadable token policy ({exc}); delete it or re-run kvrewrite budget"
        ) from exc
    if missing:
        raise CorruptCheckpointError(
            f"{path}: token policy lacks {sorted(missing)}; delete it or re-run kvrewrite budget"
        )
    from kvrewrite.errors import InvalidArgumentError
    from kvrewrite.runtime.tiers.load_options import check_cache_keywords
    from kvrewrite.spec import validate_rate

    try:  # a hand-edited value (bits 8.0, keep "0.5") is named here, not met as a TypeError in the first forward
        validate_rate(options["rate"], "rate")
        check_cache_keywords(options["kv_codec"], options["recent_window"], None, options["evict"])
    except InvalidArgumentError as exc:
        raise CorruptCheckpointError(
            f"{path}: recorded load option {exc}; delete it or re-run kvrewrite budget"
        ) from None
    return options
