"""Writing files so readers see the old file or the complete new one, never a part."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def current_umask() -> int:
    # os.umask can only be read by setting it; restore immediately.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call write(f) on a temp file next to `path`, then rename it into place (atomic on one filesystem)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes the file owner-only
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


# renameat2 flags (linux/fs.h): fail if the target exists; swap two existing entries atomically.
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(2) where the C library has it; False when it is unavailable or the filesystem refuses the flag."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.renameat2
    except (OSError, AttributeError):
        return False
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing directory entries (Linux); False if this system or filesystem cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_no_replace(src: Path, dst: Path) -> None:
    """Rename, failing with FileExistsError if `dst` exists (atomically where renameat2 exists)."""
    if _renameat2(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise FileExistsError(17, "File exists", str(dst))
    os.rename(src, dst)


@contextlib.contextmanager
def directory_lock(path: Path, blocking: bool = True):
    """flock a directory for the block; yields False (without waiting) if `blocking` is off and it is held.

    The lock dies with its process, SIGKILL included, so a stale lock never outlives a crash.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no locking, callers behave as if uncontended
        yield True
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
