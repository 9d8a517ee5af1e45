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
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from common.files import discard_temporaries, write_text_atomically
from training.errors import RunLocked

LOG_NAME = "train.log"  # the run's console output, appended to by each resume
LOCK_NAME = ".lock"  # in the run directory; the lock goes with its holder (the file stays, except on Windows)
HOLDER_NAME = ".lock.pid"  # the holder's PID, for the message a second writer gets
_HELD: dict[Path, tuple[int, int]] = {}  # this process's locked run directories -> their lock file's identity
RUN_DIR_MAKINGS = {LOG_NAME, LOCK_NAME, HOLDER_NAME}  # what opening a run directory puts in it
Before = tuple[Path | None, set[str]]  # the outermost folder of out_dir yet to be made; the makings already there


def before_opening(out_dir: Path) -> Before:
    """What opening out_dir will create, so that a start that fails can take back exactly that."""
    missing = None
    for folder in (out_dir, *out_dir.parents):
        if folder.exists():
            break
        missing = folder
    return missing, {name for name in RUN_DIR_MAKINGS if os.path.lexists(out_dir / name)}  # a link counts too


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


@contextlib.contextmanager
def log_to_run_dir(out_dir: Path) -> Iterator[None]:
    """Everything the run logs also goes to out_dir/train.log, while the run holds the directory."""
    handler = logging.FileHandler(out_dir / LOG_NAME, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def remove_unopened_run_dir(out_dir: Path, before: Before) -> None:
    """A start that failed before training (a typo, a missing file) takes back what opening the run directory made
    (train.log, .lock) and the folders above it that this command created. A folder that was there before, or
    holds anything else, stays; so does everything while another process holds the lock."""
    missing, present = before
    out = out_dir.absolute()
    if missing is not None:  # made for this command: out_dir, and the folders from `top` down to it
        top = missing.absolute()
        if not (top == out or top in out.parents) or not out.is_dir():
            return
        if not {path.name for path in out.iterdir()} <= RUN_DIR_MAKINGS:
            return
    ours = RUN_DIR_MAKINGS - present
    with _unless_locked(out) as free:
        for name in ours - {LOCK_NAME} if free else ():
            (out / name).unlink(missing_ok=True)
    if not free:
        return
    if LOCK_NAME in ours:  # once released: a held lock's file can't go everywhere (Windows)
        (out / LOCK_NAME).unlink(missing_ok=True)
    if missing is None:  # out_dir was there: only what this command added to it went
        return
    folder = out
    while True:
        try:
            folder.rmdir()
        except OSError:  # not empty: something else lives there
            return
        if folder == top:
            return
        folder = folder.parent


@contextlib.contextmanager
def _unless_locked(out_dir: Path) -> Iterator[bool]:
    """Holds out_dir's run lock while the cleanup runs, so no other process starts on the directory meanwhile;
    False when another process holds it (started on the same directory): then its files are not ours."""
    if (out_dir / LOCK_NAME).is_symlink():  # refused, never opened: locking would truncate where it points
        yield False
        return
    if not (out_dir / LOCK_NAME).exists():
        yield True
        return
    lock = FileLock(out_dir / LOCK_NAME, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
