"""One writer per run directory: an OS file lock, held for the run's life.

The kernel releases it when the holder exits, however it dies, so a killed run never leaves a stale lock.
filelock is the portable layer (fcntl on POSIX, msvcrt on Windows). Readers (sample.py, export) take no lock:
every file a run replaces is written beside its target and renamed over it.

On POSIX a lock belongs to the file, not its name: deleting `.lock` by hand lets a second writer create a new
one and lock that. So the holder checks before each write (still_held) that `.lock` is still the file it
locked, and stops with one line if not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from common.files import discard_temporaries, write_text_atomically
from training.errors import RunLocked

LOCK_NAME = ".lock"  # in the run directory; the lock goes with its holder (the file stays, except on Windows)
HOLDER_NAME = ".lock.pid"  # the holder's PID, for the message a second writer gets
_HELD: dict[Path, tuple[int, int]] = {}  # this process's locked run directories -> their lock file's identity


@contextlib.contextmanager
def run_lock(out_dir: Path) -> Iterator[None]:
    """Hold out_dir's lock, or raise RunLocked naming the process that holds it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out_dir / LOCK_NAME, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise RunLocked(
            f"out_dir={out_dir} is being written by another run (PID {_holder(out_dir)}); "
            "wait for it to end or stop it, or use another out_dir"
        ) from None
    key = out_dir.resolve()
    try:
        _HELD[key] = _identity(out_dir / LOCK_NAME)
        discard_temporaries(out_dir / HOLDER_NAME)  # a holder killed while it wrote its PID
        # Whole or not at all: a writer refused meanwhile reads the previous PID (a dead holder's) or this one.
        write_text_atomically(out_dir / HOLDER_NAME, str(os.getpid()))
        yield
    finally:
        ours = still_ours(out_dir)  # a stolen lock's .lock.pid is the new holder's: left to it
        _HELD.pop(key, None)
        if ours:
            (out_dir / HOLDER_NAME).unlink(missing_ok=True)
        lock.release()


def still_held(out_dir: Path) -> None:
    """Before writing into out_dir: RunLocked if this process locked it and its `.lock` has since been removed or
    replaced (another writer may be in). Nothing to check where this process holds no lock on it."""
    if not still_ours(out_dir):
        raise RunLocked(
            f"{out_dir / LOCK_NAME} was removed or replaced while this run held it, so another run may be writing "
            f"out_dir={out_dir} too; stopping before writing. Never delete {LOCK_NAME} by hand: it goes by itself"
        )


def still_ours(out_dir: Path) -> bool:
    identity = _HELD.get(out_dir.resolve())
    if identity is None:
        return True
    try:
        return _identity(out_dir / LOCK_NAME) == identity
    except OSError:  # gone, or unreadable: not the file this process locked
        return False


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino


def _holder(out_dir: Path) -> str:
    try:
        return (out_dir / HOLDER_NAME).read_text().strip() or "unknown"
    except OSError:
        return "unknown"
