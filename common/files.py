"""Files replaced whole, on every platform: written beside the target under this process's own temporary name,
then renamed over it, so a reader or a crash sees the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO


def check_writable(directory: Path, key: str, shown: str | None = None) -> None:
    """Before any work: a file can be created in `directory`, or in its nearest existing ancestor when it is yet to
    be made (by trying: permission bits say nothing to root, an ACL or a read-only mount). A UserError naming the
    setting (as `shown`, by default key=directory) otherwise, rather than a traceback once the work is done."""
    from common.errors import UserError

    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        where = "" if existing == directory else f" (its folder {existing} can't hold it)"
        raise UserError(
            f"{shown or f'{key}={directory}'} is not writable{where}: {err.strerror or err}; name a directory you can "
            "write to"
        ) from None


def refuse_links(directory: Path, names: Iterable[str], key: str) -> None:
    """Before writing into `directory`: none of the files it will write there may be a symbolic link. Appending to,
    locking or truncating one would write wherever it points (a run directory from someone else could aim its
    config.yaml at a shell start-up file). A UserError naming the first link otherwise."""
    from common.errors import UserError

    for name in sorted(names):
        if (directory / name).is_symlink():
            target = os.readlink(directory / name)
            raise UserError(
                f"{key}={directory} holds {name} as a symbolic link (to {target}), and nothing is written through "
                f"links; remove it, or use another {key}"
            )


@contextlib.contextmanager
def unless_disk_full(path: Path) -> Iterator[None]:
    """Around writing `path`: no space left on its disk (or a spent quota) is DiskFull, one line naming the file,
    the disk and what it has left, instead of a traceback."""
    from common.errors import DiskFull

    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise
        free = shutil.disk_usage(path.parent).free
        raise DiskFull(
            f"{path} not written: the disk holding {path.parent} is full ({free / 2**20:,.1f} MiB free)"
        ) from None


def temporary_beside(path: Path) -> Path:
    """This process's temporary for `path`: another writer, even one that bypassed a lock, never renames it."""
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def discard_temporaries(path: Path) -> None:
    """Remove what killed writers left of `path` (their temporary_beside files); only while no writer can be
    running, i.e. holding the run's lock."""
    pattern = re.compile(rf"{re.escape(path.name)}\.\d+\.tmp")
    for stale in path.parent.glob(f"{path.name}.*.tmp"):
        # a link too (never followed: opening one for a temporary would write where it points)
        if pattern.fullmatch(stale.name) and (stale.is_symlink() or stale.is_file()):
            stale.unlink(missing_ok=True)


def open_temporary(path: Path) -> BinaryIO:
    """A temporary (temporary_beside's), created afresh for writing: whatever had its name, a killed writer's
    leftover or a link planted there, is removed first and never written through."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    return os.fdopen(os.open(path, flags, 0o644), "wb")


def write_text_atomically(path: Path, text: str) -> None:
    tmp = temporary_beside(path)
    with open_temporary(tmp) as f:
        f.write(text.encode("utf-8"))
    replace_file(tmp, path)


def replace_file(source: Path, target: Path, attempts: int = 10) -> None:
    """os.replace, the atomic step on every platform. Windows refuses to replace a file another process has
    open (a sample.py reading the checkpoint): a reader holds it briefly, so there try again, waiting longer."""
    for attempt in range(attempts):
        try:
            os.replace(source, target)
            return
        except PermissionError:
            if sys.platform != "win32" or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable where the platform can: POSIX fsyncs the directory itself. Windows
    can't open a directory (PermissionError), and some filesystems can't fsync one (EINVAL, ENOTSUP): there
    os.replace is all there is. Any other error (EIO: the rename may be lost) is raised."""
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
