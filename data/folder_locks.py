"""The locks of a data folder: `.prepare.lock`, held by the one process preparing it (the others wait, then reuse
what it made), and `.in_use`, held shared by the runs reading its tokens and alone by a preparation replacing
them. A failed first preparation takes back the locks and folders it made (take_back)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from data.errors import DataError

try:
    import fcntl
except ImportError:  # Windows: no flock; a folder in use is then not guarded
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("data.prepare")
PREPARE_LOCK = ".prepare.lock"  # held by the one process preparing a data folder
IN_USE = ".in_use"  # held shared by the runs reading a data folder, alone by a preparation replacing its tokens


def missing(out_dir: Path) -> list[Path]:
    """What preparing here will make, the locks first, then the folders deepest first: a failure takes it back."""
    return [p for p in (out_dir / PREPARE_LOCK, out_dir / IN_USE, out_dir, *out_dir.parents) if not p.exists()]


def acquire(lock: FileLock, out_dir: Path) -> list[Path]:
    """The folder's preparation lock, waiting (and saying so) while another process holds it. A failed first
    preparation we waited for took its folder back (take_back): it is made again (what that made, returned),
    and the wait goes on."""
    wait, made = 0, []
    while True:
        try:
            lock.acquire(timeout=wait)
        except Timeout:
            log.info(f"waiting for another process to finish preparing {out_dir}")
            wait = -1
        except FileNotFoundError:
            made = missing(out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
        else:
            if not out_dir.exists():  # a filelock that took the lock of the file that went: the folder too
                made = missing(out_dir)
                out_dir.mkdir(parents=True)
            return made


def take_back(made: list[Path], out_dir: Path) -> None:
    """A failed first preparation (offline, a missing file) leaves none of the locks and folders it made, while
    the folder holds nothing else (then no run reads it)."""
    if {p.name for p in out_dir.iterdir()} <= {PREPARE_LOCK, IN_USE}:
        for path in made:
            with contextlib.suppress(OSError):  # a folder another process wrote in meanwhile stays, and its parents
                path.rmdir() if path.is_dir() else path.unlink()


@contextlib.contextmanager
def alone(out_dir: Path) -> Iterator[None]:
    """Replacing a folder's tokens: only while no run reads them (data.prepare.in_use), or one line saying why not."""
    if not (out_dir / "meta.json").exists():  # no tokens there yet: none being read
        yield
        return
    with locked(out_dir, exclusive=True) as held:
        if held is None:
            raise DataError(
                f"data.dir={out_dir} holds tokens a running run is reading, and preparing data.* here would replace "
                "them under it; wait for it to end, or name another data.dir"
            )
        yield


@contextlib.contextmanager
def locked(out_dir: Path, exclusive: bool) -> Iterator[bool | None]:
    """The folder's .in_use flock: shared (waiting, and saying so, while a preparation holds it) or exclusive
    (never waiting: None if a run holds it). False where it can't be taken at all, and then nothing is guarded."""
    path = out_dir / IN_USE
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
    except OSError:
        try:  # another user's .in_use in a shared folder: a lock needs no write access
            fd = os.open(path, os.O_RDONLY | nofollow)
        except OSError:
            fd = None
    held: bool | None = fd is not None and fcntl is not None
    if held:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            held = None  # a run reads it (exclusive), or a preparation replaces it (shared): waited for below
        except OSError:  # a filesystem without locks (some NFS setups): unguarded
            held = False
    try:
        if held is None and not exclusive:
            log.info(f"waiting for another process to finish preparing {out_dir}")
            fcntl.flock(fd, fcntl.LOCK_SH)
            held = True
        yield held
    finally:
        if fd is not None:
            os.close(fd)
