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
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from common.files import discard_temporaries, write_text_atomically
from training.errors import RunLocked

LOG_NAME = "train.log"  # the run's console output, appended to by each resume
LOCK_NAME = ".lock"  # in the run directory; the lock goes with its holder (the file stays, except on Windows)
HOLDER_NAME = ".lock.pid"  # the holder's PID, for the message a second writer gets
_HELD: dict[Path, tuple[int, int]] = {}  # this process's locked run directories -> their lock file's identity
Identity = tuple[int, int]  # a file's (device, inode): the file itself, whatever path names it


@dataclass
class Made:
    """What opening a run directory created, each folder and file known by identity rather than by the path that
    named it, so a start that fails takes back exactly that: never what was there before, whatever `..` or link
    the path went through."""

    folders: list[tuple[Path, Identity]] = field(default_factory=list)
    files: list[tuple[Path, Identity]] = field(default_factory=list)
    opened: bool = False  # the run went past its checks: nothing is taken back any more

    def make_folders(self, out_dir: Path) -> None:
        """out_dir.mkdir(parents=True), a folder at a time, noting the ones this process made."""
        for folder in (*reversed(out_dir.parents), out_dir):
            try:
                folder.mkdir()
            except OSError:
                if folder.is_dir():
                    continue
                raise
            self.folders.append((folder, _identity(folder)))

    @contextlib.contextmanager
    def creating(self, path: Path) -> Iterator[None]:
        """Around what creates `path`: noted as made if it wasn't there before."""
        there = os.path.lexists(path)
        yield
        if not there and path.exists():
            self.files.append((path, _identity(path)))


@contextlib.contextmanager
def run_lock(out_dir: Path, made: Made | None = None) -> Iterator[None]:
    """Hold out_dir's lock, or raise RunLocked naming the process that holds it. What it creates goes in `made`."""
    made = Made() if made is None else made
    made.make_folders(out_dir)
    lock = FileLock(out_dir / LOCK_NAME, timeout=0)
    try:
        with made.creating(out_dir / LOCK_NAME):
            lock.acquire()
    except Timeout:
        raise RunLocked(
            f"out_dir={out_dir} is being written by another run (PID {_holder(out_dir)}); "
            "wait for it to end or stop it, or use another out_dir"
        ) from None
    key, previous = out_dir.resolve(), None
    try:
        _HELD[key] = _identity(out_dir / LOCK_NAME)
        discard_temporaries(out_dir / HOLDER_NAME)  # a holder killed while it wrote its PID
        previous = _contents(out_dir / HOLDER_NAME)  # a dead holder's PID: a failed start puts it back
        # Whole or not at all: a writer refused meanwhile reads the previous PID (a dead holder's) or this one.
        write_text_atomically(out_dir / HOLDER_NAME, str(os.getpid()))
        yield
    finally:
        try:
            ours = still_ours(out_dir)  # a stolen lock's .lock.pid is the new holder's: left to it
            _HELD.pop(key, None)
            if ours and previous is not None and not made.opened:  # a failed start: as it found it
                write_text_atomically(out_dir / HOLDER_NAME, previous)
            elif ours:  # the dead holder's file goes with ours
                (out_dir / HOLDER_NAME).unlink(missing_ok=True)
        finally:
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
def log_to_run_dir(out_dir: Path, made: Made) -> Iterator[None]:
    """Everything the run logs also goes to out_dir/train.log, while the run holds the directory."""
    with made.creating(out_dir / LOG_NAME):
        handler = logging.FileHandler(out_dir / LOG_NAME, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def take_back(made: Made, out_dir: Path) -> None:
    """A start that failed before training (a typo, a missing file) takes back what opening the run directory made:
    the files and then the folders, each only if it is still the one made and a folder only if empty. Nothing
    while another process holds the directory's lock (it started on it meanwhile: its files are not ours)."""
    with _unless_locked(out_dir) as free:
        for path, identity in reversed(made.files) if free else ():
            if path.name != LOCK_NAME and _still(path, identity):
                path.unlink()
    if not free:
        return
    for path, identity in made.files:  # once released: a held lock's file can't go everywhere (Windows)
        if path.name == LOCK_NAME and _still(path, identity):
            path.unlink()
    for folder, identity in reversed(made.folders):
        if not _still(folder, identity):
            return
        try:
            folder.rmdir()
        except OSError:  # not empty: something else lives there
            return


def _still(path: Path, identity: Identity) -> bool:
    """`path` is still the very file (not a link to it, nor another by its name)."""
    try:
        stat = path.lstat()
    except OSError:
        return False
    return (stat.st_dev, stat.st_ino) == identity


def _contents(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


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
