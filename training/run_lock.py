"""One writer per run directory: an OS file lock, held for the run's life.

The kernel releases it when the holder exits, however it dies, so a killed run never leaves a stale lock.
filelock is the portable layer (fcntl on POSIX, msvcrt on Windows). Readers (sample.py, export) take no lock:
every file a run replaces is written beside its target and renamed over it.
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
    try:
        discard_temporaries(out_dir / HOLDER_NAME)  # a holder killed while it wrote its PID
        # Whole or not at all: a writer refused meanwhile reads the previous PID (a dead holder's) or this one.
        write_text_atomically(out_dir / HOLDER_NAME, str(os.getpid()))
        yield
    finally:
        (out_dir / HOLDER_NAME).unlink(missing_ok=True)
        lock.release()


def _holder(out_dir: Path) -> str:
    try:
        return (out_dir / HOLDER_NAME).read_text().strip() or "unknown"
    except OSError:
        return "unknown"
