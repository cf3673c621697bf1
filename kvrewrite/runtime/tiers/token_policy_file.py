"""token_policy.json: the cache policy a `kvrewrite budget` split recorded in a checkpoint, read at load time.

The record's "policy" is a CachePolicy's dict (runtime.cache_policy: the load() keywords that rebuild it). Files
written before the policy object hold the same keywords under "load" (rate, recent_window, kv_codec, evict) and are
read the same way. The compiler side (kvrewrite.compile.token_budget) measures the split and writes the file; the
runtime only reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError
from kvrewrite.runtime.cache_policy import CachePolicy

TOKEN_POLICY_FILE = "token_policy.json"
POLICY_KEY = "policy"
# The fields each format must hold: every field of the policy, or the keywords the earlier "load" record wrote.
REQUIRED = {
    POLICY_KEY: {"rate", "recent_window", "kv_codec", "important", "evict"},
    "load": {"rate", "recent_window", "kv_codec", "evict"},
}


def policy_record(policy: CachePolicy) -> dict:
    """The part of token_policy.json that load() reads."""
    return {POLICY_KEY: policy.to_dict()}


def read_cache_policy(directory: Path) -> CachePolicy | None:
    """The cache policy recorded by a budget split, or None."""
    path = Path(directory) / TOKEN_POLICY_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        key = POLICY_KEY if POLICY_KEY in record else "load"
        options = record[key]
        missing = REQUIRED[key] - set(options)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{path}: unreadable token policy ({exc}); delete it or re-run kvrewrite budget"
        ) from exc
    if missing:
        raise CorruptCheckpointError(
            f"{path}: token policy lacks {sorted(missing)}; delete it or re-run kvrewrite budget"
        )
    try:  # a hand-edited value (bits 8.0, keep "0.5") is named here, not met as a TypeError in the first forward
        return CachePolicy.from_dict(options)
    except InvalidArgumentError as exc:
        raise CorruptCheckpointError(
            f"{path}: recorded load option {exc}; delete it or re-run kvrewrite budget"
        ) from None
