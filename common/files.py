"""Files replaced whole, on every platform: written beside the target under this process's own temporary name,
then renamed over it, so a reader or a crash sees the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO


@contextlib.contextmanager
def unless_disk_full(path: Path) -> Iterator[None]:
    """Around writing `path`: a full disk (or a spent quota) is DiskFull, one line, instead of a traceback."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise
        raise _disk_full(path) from None


def _disk_full(path: Path) -> Exception:
    from common.errors import DiskFull

    free = shutil.disk_usage(path.parent).free
    return DiskFull(f"{path} not written: the disk holding {path.parent} is full ({free / 2**20:,.1f} MiB free)")


def temporary_beside(path: Path) -> Path:
    """This process's temporary for `path`: another writer, even one that bypassed a lock, never renames it."""
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def discard_temporaries(path: Path) -> None:
    """Remove what killed writers left of `path` (their temporary_beside files), holding the run's lock."""
    pattern = re.compile(rf"{re.escape(path.name)}\.\d+\.tmp")
    for stale in path.parent.glob(f"{path.name}.*.tmp"):
        if pattern.fullmatch(stale.name):
            stale.unlink(missing_ok=True)


def open_temporary(path: Path) -> BinaryIO:
    """A temporary_beside file, created exclusively: a planted link or a dead writer's leftover is removed, never
    written through."""
    path.unlink(missing_ok=True)
    return open(path, "xb")


def write_text_atomically(path: Path, text: str) -> None:
    tmp = temporary_beside(path)
    try:
        with unless_disk_full(path), open_temporary(tmp) as f:
            f.write(text.encode("utf-8"))
        replace_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_file(source: Path, target: Path) -> None:
    """os.replace, the atomic step on every platform."""
    try:
        os.replace(source, target)
    except PermissionError:
        if sys.platform != "win32":
            raise
        _replace_on_windows(source, target)


def _replace_on_windows(source: Path, target: Path, attempts: int = 10) -> None:
    """Windows refuses to replace a file another process has open (a sample.py reading the checkpoint); a reader
    holds it briefly, so try again, waiting longer."""
    for attempt in range(1, attempts):
        time.sleep(0.05 * attempt)
        try:
            os.replace(source, target)
            return
        except PermissionError:
            if attempt == attempts - 1:
                raise


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable where the platform can (Windows can't open a directory, some
    filesystems can't fsync one); any other error (EIO: the rename may be lost) is raised."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except PermissionError:
        return
    try:
        os.fsync(handle)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(handle)


def open_for_appending(path: Path) -> TextIO:
    """A log file to append to; a symbolic link there is refused (ELOOP), never written through."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    return open(os.open(path, flags, 0o644), "a", encoding="utf-8")
