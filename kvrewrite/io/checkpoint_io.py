"""Atomic, verifiable checkpoint directories.

A compiled checkpoint is built in a temporary sibling directory and swapped into place only when every file is
written, so an interrupted or failed compile never leaves a half-written output (and never destroys the previous
one). Every weight file is recorded with its SHA-256 so a later load can tell a damaged copy from a good one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError, ModelSourceError, OutputError
from kvrewrite.io.atomic_files import current_umask, directory_lock, exchange_paths, rename_no_replace
from kvrewrite.io.fault_injection import exchange_disabled, fault_point

CHECKSUM_FILE = "kvrewrite_checksums.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
SINGLE_SHARD_FILE = "model.safetensors"

_HASH_CHUNK = 4 * 1024 * 1024  # stream in 4 MiB pieces so multi-GB shards never sit in memory whole


# ----------------------------------------------------------------------------------------------------------------
# Atomic output directory
# ----------------------------------------------------------------------------------------------------------------


def _unused_sibling(parent: Path, prefix: str) -> Path:
    """A name in `parent` that does not exist yet (random suffix; collisions are retried, not assumed away)."""
    for _ in range(100):
        candidate = parent / f"{prefix}{secrets.token_hex(4)}"
        if not os.path.lexists(candidate):
            return candidate
    raise InvalidArgumentError(f"could not find a free temporary name next to {parent}; clean up '{prefix}*' entries")


def _remove_path(path: Path) -> None:
    """Delete a file or directory tree; best effort, used on cleanup paths that must not mask the real error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def refuse_existing_output(out_dir: Path, overwrite: bool) -> None:
    """An existing output is never replaced unless asked, and --overwrite replaces only a kvrewrite checkpoint
    (checked before a compile starts, and again at the final swap)."""
    from kvrewrite.io.output_safety import is_kvrewrite_checkpoint

    if not os.path.lexists(out_dir):
        return
    if not overwrite:
        raise InvalidArgumentError(
            f"output directory {out_dir} already exists; pass `overwrite` to replace it or choose another `output`"
        )
    if not is_kvrewrite_checkpoint(out_dir):
        raise InvalidArgumentError(
            f"output {out_dir} exists and is not a kvrewrite checkpoint; `overwrite` only replaces a directory "
            "kvrewrite wrote, so nothing was deleted. Move it away or choose another `output`"
        )


@contextlib.contextmanager
def atomic_output_dir(out_dir: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces `out_dir` only if the block finishes without an exception.

    The temporary directory lives in the same parent as `out_dir` so the final swap is a rename within one
    filesystem (atomic). On any exception — KeyboardInterrupt included — the temporary directory is deleted and a
    previous `out_dir` is left untouched. The temporary directory is flock'ed while it is written, so the next
    run can tell a live concurrent write from a partial one left by a killed process (output_safety.py).
    """
    out_dir = Path(out_dir)
    refuse_existing_output(out_dir, overwrite)
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    name = out_dir.name
    if not name:
        raise InvalidArgumentError(f"output path {out_dir!s} has no directory name; choose another `output`")

    with contextlib.ExitStack() as held:
        tmp = _locked_temp_dir(parent, f".{name}.tmp-", held)
        try:
            fault_point("emit:tmp")
            yield tmp
            _swap_into_place(tmp, out_dir, overwrite)
        except OSError as exc:
            _remove_path(tmp)
            kept = "the previous output is unchanged" if os.path.lexists(out_dir) else "nothing was left behind"
            what = f"{exc.strerror} ({exc.filename})" if exc.strerror and exc.filename else str(exc)
            raise OutputError(f"could not write the checkpoint to {out_dir}: {what}; {kept}") from exc
        except BaseException:
            _remove_path(tmp)
            raise


def _locked_temp_dir(parent: Path, prefix: str, held: contextlib.ExitStack) -> Path:
    for _ in range(10):
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        held.enter_context(directory_lock(tmp))
        # A cleanup in another process may have removed it between mkdtemp and the lock; then take another.
        if tmp.is_dir():
            # mkdtemp makes the directory 0700; give the final output the permissions a plain mkdir would have.
            os.chmod(tmp, 0o777 & ~current_umask())
            return tmp
    raise InvalidArgumentError(f"could not create a temporary directory in {parent}; is another process deleting it?")


def _swap_into_place(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Put the finished `tmp` at `out_dir`: one atomic exchange where the system has it, else two renames that the
    next run can finish (output_safety.recover_leftovers restores an `.old-*` left without its output)."""
    fault_point("swap:start")
    with directory_lock(out_dir.parent):  # one swap at a time, and never while a recovery looks at the leftovers
        if not os.path.lexists(out_dir):
            try:
                rename_no_replace(tmp, out_dir)
            except FileExistsError:
                raise InvalidArgumentError(
                    f"output directory {out_dir} appeared while writing; pass `overwrite` or choose another `output`"
                ) from None
            return
        try:
            refuse_existing_output(out_dir, overwrite)
        except InvalidArgumentError as exc:
            # Someone created it while we were writing; never clobber it silently.
            raise InvalidArgumentError(f"{exc} (it appeared while writing)") from None
        if not exchange_disabled() and exchange_paths(tmp, out_dir):
            fault_point("swap:exchanged")
            old = tmp  # the exchange left the previous output at the temporary name
        else:
            old = _unused_sibling(out_dir.parent, f".{out_dir.name}.old-")
            os.rename(out_dir, old)
            try:
                fault_point("swap:old-moved")
                os.replace(tmp, out_dir)
            except BaseException:
                # Put the previous output back so a failed swap leaves things as they were.
                try:
                    os.rename(old, out_dir)
                except OSError as exc:
                    warnings.warn(
                        f"could not restore previous output {out_dir} from {old}: {exc}; rename it back by hand",
                        stacklevel=3,
                    )
                raise
        fault_point("swap:replaced")
    _remove_path(old)
    if os.path.lexists(old):
        warnings.warn(f"could not delete the replaced output at {old}; delete it by hand", stacklevel=3)


# ----------------------------------------------------------------------------------------------------------------
# Safetensors shards
# ----------------------------------------------------------------------------------------------------------------


def _prepare_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two tensors sharing storage (safetensors refuses shared storage)."""
    prepared: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for key, tensor in state_dict.items():
        if not isinstance(key, str):
            raise InvalidArgumentError(f"state dict key {key!r} is not a string; tensor names must be strings")
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"state dict entry {key!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.device.type == "meta":
            raise InvalidArgumentError(
                f"tensor {key!r} is on the meta device (no data); materialise the model weights before saving"
            )
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storages or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            # Shares memory with an earlier tensor, or is a slice of a larger buffer: save an independent copy.
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if t.numel() > 0:
            seen_storages.add(ptr)
        prepared[key] = t
    return prepared


def write_safetensors_shards(
    directory: Path,
    state_dict: dict[str, torch.Tensor],
    metadata: dict[str, str],
    max_shard_size: int | str = "2GB",
) -> list[str]:
    """Write `state_dict` as HF-style safetensors shard(s) in `directory`; return the shard filenames in order.

    One shard is named `model.safetensors`; several are `model-0000i-of-0000n.safetensors` plus the standard
    `model.safetensors.index.json`. Every shard carries the same `metadata` (with `format: pt` added).
    """
    directory = Path(directory)
    if not state_dict:
        raise InvalidArgumentError("state dict is empty; there are no weights to write")
    meta = dict(metadata)
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgumentError(
                f"safetensors metadata must map str to str, got {k!r}: {type(v).__name__}; json.dumps non-string values"
            )
    if meta.setdefault("format", "pt") != "pt":
        # transformers only loads safetensors whose format is "pt".
        raise InvalidArgumentError(f"metadata 'format' is {meta['format']!r}; it must be 'pt' for transformers")

    tensors = _prepare_tensors(state_dict)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    directory.mkdir(parents=True, exist_ok=True)

    filenames = list(split.filename_to_tensors.keys())
    for filename in filenames:
        shard = {name: tensors[name] for name in split.filename_to_tensors[filename]}
        _save_shard(shard, directory / filename, meta)

    if split.is_sharded:
        index = {
            "metadata": {"total_size": int(split.metadata["total_size"])},
            "weight_map": dict(sorted(split.tensor_to_filename.items())),
        }
        (directory / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return filenames


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file with the permissions every other written file has: safetensors creates its file
    0600, which would leave a shard unreadable to the other users of a shared checkpoint."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except OSError:
        raise
    except Exception as exc:  # safetensors reports a full disk as its own SafetensorError
        raise OSError(f"{exc} while writing {Path(path).name}") from exc
    os.chmod(path, 0o666 & ~current_umask())


def _save_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    save_safetensors(tensors, path, metadata)


class ShardWriter:
    """Write tensors to safetensors shards as they come, so a checkpoint never sits in memory whole.

    Tensors are buffered until the next one would push the shard past `max_shard_size` bytes; then the
    shard is written and the buffer freed. `finish` names the shards the Hugging Face way
    (`model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`) and
    returns their names. Use it inside `atomic_output_dir`: a failure part-way leaves nothing behind.
    """

    def __init__(self, directory: Path, metadata: dict[str, str], max_shard_size: int):
        self.directory = Path(directory)
        self.metadata = {**metadata, "format": "pt"}
        self.max_shard_size = int(max_shard_size)
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._parts: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buffer or any(name in names for _, names in self._parts):
            raise InvalidArgumentError(f"tensor {name!r} was written twice")
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_size:
            self.flush()
        self._buffer.update(_prepare_tensors({name: tensor}))
        self._buffer_bytes += size
        self.total_size += size

    def flush(self) -> None:
        if not self._buffer:
            return
        part = f".part-{len(self._parts) + 1:05d}.safetensors"
        _save_shard(self._buffer, self.directory / part, self.metadata)
        fault_point(f"emit:shard-{len(self._parts) + 1}")
        self._parts.append((part, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    @property
    def shards_written(self) -> int:
        return len(self._parts)

    def finish(self) -> list[str]:
        self.flush()
        if not self._parts:
            raise InvalidArgumentError("no tensors were written")
        n = len(self._parts)
        names = [SINGLE_SHARD_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {}
        for (part, tensors), final in zip(self._parts, names):
            os.replace(self.directory / part, self.directory / final)
            weight_map.update({t: final for t in tensors})
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return names


def _shard_filenames(directory: Path) -> list[str]:
    """The checkpoint's shard filenames: from the index if sharded, else the single file, else any *.safetensors."""
    index_path = directory / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            return sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"{index_path} is not a valid safetensors index ({exc}); re-run the compile to rewrite the checkpoint"
            ) from exc
    if (directory / SINGLE_SHARD_FILE).is_file():
        return [SINGLE_SHARD_FILE]
    return sorted(p.name for p in directory.glob("*.safetensors"))


def read_safetensors_metadata(directory: Path) -> dict[str, str]:
    """Header metadata of the checkpoint's first shard (all shards carry the same metadata)."""
    directory = Path(directory)
    shards = _shard_filenames(directory)
    if not shards:
        raise CorruptCheckpointError(
            f"no *.safetensors weights found in {directory}; point to a kvrewrite output directory or re-run the compile"
        )
    path = directory / shards[0]
    if not path.is_file():
        raise CorruptCheckpointError(f"{path} is listed in the index but missing; re-run the compile")
    return dict(_open_safetensors_header(path))


def estimated_output_bytes(directory: Path, dtype: torch.dtype) -> int | None:
    """Bytes of the source's tensors re-stored in `dtype`, read from the shard headers (None if unreadable)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    try:
        for name in _shard_filenames(Path(directory)):
            with safe_open(str(Path(directory) / name), framework="pt") as f:
                for key in f.keys():
                    numel = 1
                    for dim in f.get_slice(key).get_shape():
                        numel *= dim
                    total += numel * itemsize
    except Exception:  # a damaged source is reported, naming the file, when it is loaded
        return None
    return total or None


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_safetensors_files(directory: Path) -> list[str]:
    """Check that every weight file of a checkpoint exists and is complete before anything reads it.

    Used on source models (which carry no checksums) so a missing or truncated shard fails with its file name
    instead of deep inside transformers. Only safetensors are accepted: kvrewrite never unpickles weights.
    """
    directory = Path(directory)
    shards = _shard_filenames(directory)
    if not shards:
        pickled = (
            sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES) if directory.is_dir() else []
        )
        if pickled:
            raise ModelSourceError(
                f"{directory} holds only pickled weights ({', '.join(pickled)}); kvrewrite reads safetensors only, "
                "because unpickling can run code. Convert them first (load with transformers and "
                "`save_pretrained(..., safe_serialization=True)`) or use the repo's safetensors revision"
            )
        raise CorruptCheckpointError(f"no *.safetensors weights found in {directory}")
    index = directory / SAFETENSORS_INDEX_FILE
    for name in shards:
        path = directory / name
        if not path.is_file():
            where = f"listed in {index}" if index.is_file() else "expected"
            raise CorruptCheckpointError(f"{path} is {where} but missing; re-download the model or re-run the compile")
        _open_safetensors_header(path)  # a truncated file fails here, naming itself
    return shards


def _open_safetensors_header(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError variants
        raise CorruptCheckpointError(
            f"{path} is truncated or its safetensors header is damaged ({exc}); re-download or re-run the compile"
        ) from exc


# ----------------------------------------------------------------------------------------------------------------
# Checksums
# ----------------------------------------------------------------------------------------------------------------


def _check_relative_name(directory: Path, filename: str) -> Path:
    """Refuse names that would escape the checkpoint directory (the checksum file names paths we will open)."""
    rel = PurePosixPath(filename)
    if not filename or rel.is_absolute() or ".." in rel.parts:
        raise InvalidArgumentError(f"checksum entry {filename!r} must be a relative path inside {directory}")
    return directory / rel


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(directory: Path, filenames: list[str], known: dict[str, str] | None = None) -> None:
    """Record the SHA-256 of each listed file (relative to `directory`) in `directory/CHECKSUM_FILE`.

    known: digests the caller has just verified (e.g. the existing entries when one file is added), reused instead
    of reading those files again."""
    directory = Path(directory)
    if not filenames:
        raise InvalidArgumentError("no files given to checksum; pass the shard filenames returned by the writer")
    sums: dict[str, str] = {}
    for filename in filenames:
        if filename == CHECKSUM_FILE:
            raise InvalidArgumentError(f"{CHECKSUM_FILE} cannot list itself")
        path = _check_relative_name(directory, filename)
        if not path.is_file():
            raise InvalidArgumentError(f"cannot checksum {path}: file does not exist")
        sums[filename] = known[filename] if known and filename in known else _sha256(path)
    # Write-then-rename so a crash never leaves a half-written checksum file that would fail every later verify.
    target = directory / CHECKSUM_FILE
    tmp = target.with_name(f".{CHECKSUM_FILE}.tmp-{secrets.token_hex(4)}")
    try:
        tmp.write_text(json.dumps(sums, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    except BaseException:
        _remove_path(tmp)
        raise


def verify_checksums(directory: Path) -> None:
    """Raise CorruptCheckpointError unless every file in `directory/CHECKSUM_FILE` exists and matches its SHA-256."""
    directory = Path(directory)
    sums_path = directory / CHECKSUM_FILE
    if not sums_path.is_file():
        raise CorruptCheckpointError(
            f"{sums_path} is missing, so the checkpoint cannot be verified; it was not written by kvrewrite or the "
            "write was interrupted — re-run the compile"
        )
    try:
        sums = json.loads(sums_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{sums_path} cannot be parsed ({exc}); the checkpoint is damaged — re-run the compile"
        ) from exc
    if (
        not isinstance(sums, dict)
        or not sums
        or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in sums.items())
    ):
        raise CorruptCheckpointError(
            f"{sums_path} does not map file names to SHA-256 digests; the checkpoint is damaged — re-run the compile"
        )

    for filename, expected in sorted(sums.items()):
        try:
            path = _check_relative_name(directory, filename)
        except InvalidArgumentError as exc:
            raise CorruptCheckpointError(f"{sums_path} lists an invalid path: {exc}") from exc
        if not path.is_file():
            raise CorruptCheckpointError(
                f"{path} is listed in {CHECKSUM_FILE} but missing; re-download or re-run the compile"
            )
        if path.suffix == ".safetensors":
            # Parsing the header first gives a precise "truncated" message instead of a bare digest mismatch.
            _open_safetensors_header(path)
        actual = _sha256(path)
        if actual != expected.lower():
            raise CorruptCheckpointError(
                f"{path} is corrupt or modified (SHA-256 {actual[:12]}… does not match the recorded "
                f"{expected[:12]}…); re-download or re-run the compile"
            )
