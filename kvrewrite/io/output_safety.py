"""Where a checkpoint may be written, checked before any work, and what an interrupted run left behind.

kvrewrite never deletes what it did not write: an output that is, contains or lies inside the source is refused,
and --overwrite replaces only a directory that holds a kvrewrite checkpoint. Leftovers of interrupted runs
(`.NAME.tmp-*` partial checkpoints, `.NAME.old-*` outputs moved aside mid-swap) are ours by name and lock, and
are removed or restored at the next run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.atomic_files import directory_lock

CHECKPOINT_MARKERS = ("config.json", "kvrewrite_checksums.json")
# Room beyond the estimated weights: tokenizer, metadata, report, and the filesystem's own bookkeeping.
SPACE_MARGIN = 1.10
SPACE_SLACK_BYTES = 64 * 1024 * 1024


def is_kvrewrite_checkpoint(directory: Path) -> bool:
    """A directory kvrewrite wrote: config.json with a kvrewrite spec beside kvrewrite's manifest, or an MLA export
    (config.json with the `kvrewrite_mla` marker; exports written before exports had a manifest have none)."""
    directory = Path(directory)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        return False
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False
    if not isinstance(config, dict):
        return False
    if isinstance(config.get("kvrewrite_mla"), dict):
        return True
    return "kvrewrite" in config and all((directory / m).is_file() for m in CHECKPOINT_MARKERS)


def _absolute(path: Path) -> Path:
    # resolve() follows symlinks of the parts that exist, so `-o link-to-source` is caught too.
    return Path(os.path.abspath(Path(path).expanduser())).resolve()


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def check_output_location(
    out: Path, *, source: Path | None = None, overwrite: bool = False, need_bytes: int | None = None
) -> None:
    """Refuse, before any work, an output that would destroy the source or user files, or cannot be written."""
    out_abs = _absolute(out)
    if out_abs == out_abs.parent:
        raise InvalidArgumentError(f"output path {out!s} is the filesystem root; choose a new directory as `output`")
    if source is not None:
        src = _absolute(source)
        if out_abs == src:
            raise InvalidArgumentError(
                f"output {out_abs} is the source model directory; writing there would replace the model being "
                "compressed. Choose a new directory as `output`"
            )
        if out_abs in src.parents:
            raise InvalidArgumentError(
                f"output {out_abs} contains the source model {src}; replacing it would delete the source and "
                "everything beside it. Choose a new directory as `output`, outside the source"
            )
        if src in out_abs.parents:
            raise InvalidArgumentError(
                f"output {out_abs} lies inside the source model directory {src}; choose a directory outside it"
            )
    if os.path.lexists(out_abs):
        if not out_abs.is_dir():
            raise InvalidArgumentError(f"output {out_abs} exists and is not a directory; choose another `output`")
        if not overwrite:
            raise InvalidArgumentError(
                f"output directory {out_abs} already exists; pass `overwrite` to replace it or choose another `output`"
            )
        if not is_kvrewrite_checkpoint(out_abs):
            raise InvalidArgumentError(
                f"output {out_abs} exists and is not a kvrewrite checkpoint (no config.json with a kvrewrite spec "
                "beside kvrewrite_checksums.json, nor an MLA export); `overwrite` only replaces a directory kvrewrite wrote, so nothing "
                "was deleted. Move it away or choose another `output`"
            )
    anchor = _nearest_existing(out_abs.parent)
    if not anchor.is_dir():
        raise InvalidArgumentError(f"cannot create output {out_abs}: {anchor} is a file, not a directory")
    _check_writable(anchor, out_abs)
    if need_bytes:
        free = shutil.disk_usage(anchor).free
        need = int(need_bytes * SPACE_MARGIN) + SPACE_SLACK_BYTES
        if free < need:
            raise InvalidArgumentError(
                f"not enough free space for output {out_abs}: the checkpoint needs about {_mib(need)} "
                f"(weights {_mib(need_bytes)} plus margin) but {anchor} has {_mib(free)} free. "
                "Free some space or choose another `output`"
            )


def _check_writable(directory: Path, out: Path) -> None:
    # Create a real file: os.access says yes to root on a read-only mount, and ignores ACLs.
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".kvrewrite-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot write output {out}: {directory} is not writable ({exc.strerror}); choose another `output`"
        ) from None


def check_writable_file(path: Path, option: str) -> None:
    """A file the command will write at the end (eval --json, inspect --plot): its directory must exist and be writable."""
    target = _absolute(path)
    if target.is_dir():
        raise InvalidArgumentError(f"{option} {path} is a directory; give a file path")
    if not target.parent.is_dir():
        raise InvalidArgumentError(f"{option} {path}: directory {target.parent} does not exist; create it first")
    try:
        fd, probe = tempfile.mkstemp(dir=target.parent, prefix=".kvrewrite-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InvalidArgumentError(f"{option} {path}: {target.parent} is not writable ({exc.strerror})") from None


def leftover_names(out: Path) -> tuple[str, str]:
    """Prefixes of the hidden siblings a write of `out` creates: (partial checkpoints, outputs moved aside)."""
    return f".{out.name}.tmp-", f".{out.name}.old-"


def recover_leftovers(out: Path) -> list[str]:
    """Remove or restore what interrupted runs left beside `out`; return one line per action, for the user.

    A `.tmp-*` directory still locked by a live run (a concurrent compile) is left alone. If `out` is missing
    but an `.old-*` copy exists, a kill struck between the two renames of a swap: the old output is put back.
    """
    out = _absolute(out)
    parent = out.parent
    if not parent.is_dir():
        return []
    tmp_prefix, old_prefix = leftover_names(out)
    notes: list[str] = []
    try:
        with directory_lock(parent):  # the swap holds it too, so we never act on a half-done swap
            entries = sorted(parent.iterdir())
            for entry in entries:
                if entry.name.startswith(tmp_prefix) and entry.is_dir() and not entry.is_symlink():
                    with directory_lock(entry, blocking=False) as free:
                        if not free:
                            notes.append(f"{entry} is being written by another kvrewrite run; left alone")
                            continue
                        shutil.rmtree(entry)
                    notes.append(f"removed {entry}, a partial checkpoint left by an interrupted run")
            olds = sorted(
                (e for e in entries if e.name.startswith(old_prefix) and e.is_dir()), key=lambda e: e.stat().st_mtime
            )
            if olds and not os.path.lexists(out):
                os.rename(olds.pop(), out)
                notes.append(f"restored {out} from its copy moved aside by an interrupted run")
            for old in olds:
                shutil.rmtree(old)
                notes.append(f"removed {old}, an output an interrupted run had already replaced")
    except OSError as exc:
        notes.append(
            f"could not clean up leftovers of interrupted runs beside {out} ({exc}); "
            f"delete '{tmp_prefix}*' and '{old_prefix}*' there by hand"
        )
    return notes
