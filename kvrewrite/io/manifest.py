"""One manifest per output: the SHA-256 of every file a checkpoint or an MLA export was written with.

The manifest is `kvrewrite_checksums.json` (the name the shard checksums always had, so an older kvrewrite still
verifies a newer checkpoint): a JSON object from relative path to digest. A writer lists every file it wrote —
weight shards, config.json, generation_config.json, tokenizer files, codec tables, side files
(kvrewrite_rates/...), the modeling stub, the report — and `kvrewrite budget` adds token_policy.json when it records
one. Files written later that change nothing a model computes (README.md, eval_results*.json, rank_heatmap.png) are
not listed and need not be.

Verification (every load, eval, budget and push): every listed file exists and matches, and no file that changes
what the model computes or how it loads is present without being listed (a token_policy.json or a `*.py` dropped in
afterwards). A manifest that does not list config.json was written before this rule (it held the shard digests
only): its listed files are verified, an unlisted token policy is still refused, and one warning says that its
config and tokenizer are not covered (the config is still checked field by field against the shards' spec,
runtime/load.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from kvrewrite.errors import CorruptCheckpointError, KVRewriteWarning
from kvrewrite.io.checkpoint_io import CHECKSUM_FILE, SAFETENSORS_INDEX_FILE, verify_checksums, write_checksums

MANIFEST_FILE = CHECKSUM_FILE
MODELING_FILE = "modeling_kvrewrite.py"  # kvrewrite's own stub (compile/passes/emit.py); never imported by kvrewrite
TOKEN_POLICY_FILE = "token_policy.json"
# What a tokenizer or a model load reads besides the weights and config.json.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
LOAD_FILES = ("config.json", "generation_config.json", TOKEN_POLICY_FILE, SAFETENSORS_INDEX_FILE, *TOKENIZER_FILES)


def changes_the_model(name: str) -> bool:
    """A file (relative posix path) that changes what the model computes or how it loads: it must be listed."""
    return name in LOAD_FILES or name.endswith((".safetensors", ".py")) or name.startswith("additional_chat_templates/")


def written_files(directory: Path) -> list[str]:
    """Every regular file under `directory` a manifest lists: all but the manifest and hidden entries."""
    directory = Path(directory)
    names = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if path.is_file() and rel.as_posix() != MANIFEST_FILE and not any(p.startswith(".") for p in rel.parts):
            names.append(rel.as_posix())
    return names


def write_manifest(directory: Path) -> list[str]:
    """List every file written in `directory` with its SHA-256 (the writer's last step); returns the names listed."""
    names = written_files(directory)
    write_checksums(directory, names)
    return names


def read_manifest(directory: Path) -> dict[str, str]:
    """The verified manifest's entries (call verify_manifest first)."""
    return json.loads((Path(directory) / MANIFEST_FILE).read_text(encoding="utf-8"))


def is_full_manifest(entries: dict[str, str]) -> bool:
    """True for a manifest of every file; False for one written before (shard digests only)."""
    return "config.json" in entries


def verify_manifest(directory: Path) -> None:
    """Every listed file matches, and nothing that changes the model is present unlisted; a message names the file."""
    directory = Path(directory)
    verify_checksums(directory)
    entries = read_manifest(directory)
    manifest = directory / MANIFEST_FILE
    if not is_full_manifest(entries):
        if (directory / TOKEN_POLICY_FILE).is_file() and TOKEN_POLICY_FILE not in entries:
            raise _unlisted(directory / TOKEN_POLICY_FILE, manifest)
        warnings.warn(
            f"{manifest} lists the weight files only (written by a kvrewrite before its manifest covered "
            "every file): config.json and the tokenizer are not checksummed, config.json is checked "
            "against the weights' spec. Re-run the compile to get a full manifest",
            KVRewriteWarning,
            stacklevel=2,
        )
        return
    unlisted = [name for name in written_files(directory) if changes_the_model(name) and name not in entries]
    if unlisted:
        raise _unlisted(directory / unlisted[0], manifest, len(unlisted) - 1)


def _unlisted(path: Path, manifest: Path, more: int = 0) -> CorruptCheckpointError:
    also = f" (and {more} more unlisted file(s))" if more else ""
    return CorruptCheckpointError(
        f"{path} is not listed in {manifest.name}{also}: it was added after the checkpoint was written and would "
        "change what the model computes or how it loads. Delete it, or re-run the command that writes it"
    )
