"""A compressed checkpoint's files checked before and after transformers loads them: where the directory is, its
checksums and the spec its weights were written with, and a load that dropped or re-initialised no weight.

Below both `load` (runtime/load.py) and the model classes' from_pretrained (runtime/modeling/families.py), which
each use them, so neither imports the other.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrewrite.errors import CorruptCheckpointError


def checkpoint_directory(name_or_path, revision: str | None = None) -> Path:
    """A local directory for a compressed checkpoint given as a path or a Hub id."""
    path = Path(str(name_or_path)).expanduser()
    if path.is_dir():
        return path
    from kvrewrite.io.sources import resolve_model_source

    return resolve_model_source(str(name_or_path), revision=revision).path


def verify_checkpoint_files(directory: Path) -> None:
    from kvrewrite.io.checkpoint_io import verify_checksums

    verify_checksums(directory)
    check_spec_matches_weights(directory)


# What the tensors were folded for. Ranks and the target rate are not here: they are a run-time choice among the
# rate table, and the weights serve them all.
_STRUCTURAL_FIELDS = ("format_version", "base_model_type", "num_layers", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "objective")


def check_spec_matches_weights(directory: Path) -> None:
    """Refuse a config.json spec that differs from the spec the weights were written with (kept in the shards).

    A changed key mode or rotary-pair order would otherwise load without any shape error and compute garbage.
    """
    from kvrewrite.io.checkpoint_io import _shard_filenames, read_safetensors_metadata

    written_json = read_safetensors_metadata(directory).get("kvrewrite_spec")
    config_path = Path(directory) / "config.json"
    try:
        config_spec = json.loads(config_path.read_text())["kvrewrite"]
    except (OSError, ValueError, KeyError) as exc:
        raise CorruptCheckpointError(f"{config_path}: unreadable or has no kvrewrite spec ({exc})") from exc
    if written_json is None or config_spec is None:
        return  # weights re-saved by plain transformers carry no spec to compare with
    written = json.loads(written_json)
    shard = Path(directory) / _shard_filenames(Path(directory))[0]
    problems = [f"{name} is {config_spec.get(name)!r} in config.json but {written.get(name)!r} in the weights"
                for name in _STRUCTURAL_FIELDS if config_spec.get(name) != written.get(name)]
    for i, (have, want) in enumerate(zip(config_spec.get("layers", []), written.get("layers", []))):
        for name in ("key_mode", "freq_order"):
            if have.get(name) != want.get(name):
                problems.append(f"layer {i} {name} is {have.get(name)!r} in config.json but {want.get(name)!r} in the weights")
    if problems:
        shown = "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        raise CorruptCheckpointError(
            f"{config_path} does not match the weights in {shard}: {shown}. The checkpoint was edited after "
            "compiling; restore config.json or re-run the compile"
        )


def ensure_complete_load(info: dict, directory: Path) -> None:
    """Refuse a load in which transformers would have re-initialised or dropped any weight (naming file and tensor)."""
    from kvrewrite.io.lazy_checkpoint import LazyCheckpoint

    try:
        where = LazyCheckpoint(directory).weight_map
    except Exception:  # the names alone still say what is wrong
        where = {}

    def named(key) -> str:
        if isinstance(key, (tuple, list)) and key:  # mismatched keys: (name, stored shape, expected shape)
            name, shapes = str(key[0]), [list(s) for s in key[1:] if hasattr(s, "__len__")]
            shape_text = f" (shape {shapes[0]} in the file, the spec needs {shapes[1]})" if len(shapes) == 2 else ""
        else:
            name, shape_text = str(key), ""
        file = f" in {Path(directory) / where[name]}" if name in where else ""
        return f"{name!r}{file}{shape_text}"

    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(info.get(kind) or [], key=str)
        if keys:
            problems.append(f"{kind.replace('_', ' ')}: {', '.join(named(k) for k in keys[:8])}{' ...' if len(keys) > 8 else ''}")
    if info.get("error_msgs"):
        problems.append("; ".join(info["error_msgs"]))
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint {directory} does not match its compression spec: " + " | ".join(problems)
            + ". Re-download it or re-run the compile"
        )
