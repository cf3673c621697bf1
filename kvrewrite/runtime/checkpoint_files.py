"""A compressed checkpoint's files checked before and after transformers loads them: where the directory is, its
manifest (io/manifest.py) and the spec its weights were written with, and a load that dropped or re-initialised no
weight; and the refusal of a request to run code shipped with a checkpoint.

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
    """The manifest (every file as written, nothing load-relevant added) and config.json against the shards' spec."""
    from kvrewrite.io.manifest import verify_manifest

    verify_manifest(directory)
    check_spec_matches_weights(directory)


def _spec_differences(config_spec: dict, written: dict) -> list[str]:
    """Each field of config.json's spec that differs from the spec the weights were written with, by name."""

    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."

    problems = []
    # Scalar fields first (a changed head count or codec explains the per-layer differences that follow).
    for name in sorted(set(config_spec) | set(written), key=lambda n: (n in ("layers", "rate_table"), n)):
        have, want = config_spec.get(name), written.get(name)
        if have == want:
            continue
        if name == "layers" and isinstance(have, list) and isinstance(want, list) and len(have) == len(want):
            for i, (a, b) in enumerate(zip(have, want)):
                a, b = (a if isinstance(a, dict) else {}), (b if isinstance(b, dict) else {})
                problems += [
                    f"layer {i} {field} is {short(a.get(field))} in config.json but {short(b.get(field))} "
                    "in the weights"
                    for field in sorted(set(a) | set(b))
                    if a.get(field) != b.get(field)
                ]
        elif name == "rate_table" and isinstance(have, dict) and isinstance(want, dict):
            problems += [
                f"rate_table entry {key} is {short(have.get(key))} in config.json but {short(want.get(key))} "
                "in the weights"
                for key in sorted(set(have) | set(want))
                if have.get(key) != want.get(key)
            ]
        else:
            problems.append(f"{name} is {short(have)} in config.json but {short(want)} in the weights")
    return problems


def check_spec_matches_weights(directory: Path) -> None:
    """Refuse a config.json spec that differs in any field from the spec the weights were written with (kept in the
    shards): the ranks, the rate table, the codec, the target rate and the key modes all change what is computed,
    and most of them would load without any shape error.
    """
    from kvrewrite.io.checkpoint_io import _shard_filenames, read_safetensors_metadata

    written_json = read_safetensors_metadata(directory).get("kvrewrite_spec")
    config_path = Path(directory) / "config.json"
    try:
        config_spec = json.loads(config_path.read_text())["kvrewrite"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{config_path}: unreadable or has no kvrewrite spec ({exc})") from exc
    if written_json is None or config_spec is None:
        return  # weights re-saved by plain transformers carry no spec to compare with
    try:
        written = json.loads(written_json)
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"the kvrewrite_spec metadata of the weights in {directory} is not JSON ({exc}); re-run the compile"
        ) from None
    if not isinstance(config_spec, dict) or not isinstance(written, dict):
        raise CorruptCheckpointError(f"{config_path}: the kvrewrite spec is not a JSON object; restore config.json")
    shard = Path(directory) / _shard_filenames(Path(directory))[0]
    problems = _spec_differences(config_spec, written)
    if problems:
        shown = "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        raise CorruptCheckpointError(
            f"{config_path} does not match the weights in {shard}: {shown}. The checkpoint was edited after "
            "compiling; restore config.json or re-run the compile"
        )


def verify_mla_files(directory: Path) -> None:
    """An MLA export's manifest (weights, config and its marker, side files, tokenizer); an export written before
    exports had one loads with a warning that nothing of it is verified."""
    import warnings

    from kvrewrite.errors import KVRewriteWarning
    from kvrewrite.io.manifest import MANIFEST_FILE, verify_manifest

    if (directory / MANIFEST_FILE).is_file():
        verify_manifest(directory)
        return
    warnings.warn(
        f"{directory} has no {MANIFEST_FILE}: it was exported by a kvrewrite that wrote no manifest, so "
        "none of its files can be verified. Re-export it to get one",
        KVRewriteWarning,
        stacklevel=3,
    )


def refuse_remote_code(kwargs: dict) -> None:
    """Drop a trust_remote_code keyword (every load passes False itself); refuse a request to run shipped code."""
    if kwargs.pop("trust_remote_code", None):
        from kvrewrite.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "kvrewrite never runs code shipped with a checkpoint: its models are built-in "
            "classes, so load without trust_remote_code"
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
            problems.append(
                f"{kind.replace('_', ' ')}: {', '.join(named(k) for k in keys[:8])}{' ...' if len(keys) > 8 else ''}"
            )
    if info.get("error_msgs"):
        problems.append("; ".join(info["error_msgs"]))
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint {directory} does not match its compression spec: "
            + " | ".join(problems)
            + ". Re-download it or re-run the compile"
        )
