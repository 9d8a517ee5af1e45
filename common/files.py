"""Files: written whole (a temporary renamed over the target: a reader or a crash sees the old file or the new one),
a full disk or a misplaced one said in one line; and the run directory (out_dir), with its files' names and every
write into it: RunDir.open() makes it, locks it to this run, checks once that the files it will hold are regular (a
link is never written through, a FIFO never blocks the run) and starts train.log. metrics.jsonl's reader is here too,
for plot.py, bench.py and the GPU check. Below training and inference: both use the names."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from filelock import FileLock, Timeout

from common.errors import ConfigError, DataError, DiskFull, RunLocked

FULL_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # no space left, a spent quota
NEARLY_FULL = 1 << 20  # free bytes under which a failed write counts as a full disk's


@contextlib.contextmanager
def unless_disk_full(path: Path) -> Iterator[None]:
    """A full disk while writing `path` is one line (numpy and torch.save don't always say ENOSPC: nearly full)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else NEARLY_FULL
        if getattr(err, "errno", None) not in FULL_ERRNOS and free >= NEARLY_FULL:
            raise
        where = f"the disk holding {path.parent} is full ({free / 2**20:,.1f} MiB free)"
        raise DiskFull(f"{path} not written: {where}") from None


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """write(f) fills PATH.tmp, synced, then renamed over `path`: a reader or a crash sees the old file or the new one,
    never a part. Its writer is the only one (a run's lock, a data folder's), so a killed writer's PATH.tmp is simply
    replaced; a link there is removed first, never written through."""
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with unless_disk_full(path):
            tmp.unlink(missing_ok=True)
            with open(tmp, "xb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        replace_file(tmp, path)
    except BaseException:  # a full disk, a second Ctrl-C: the previous file stays as it was
        tmp.unlink(missing_ok=True)
        raise
    try:  # the rename made durable where a directory can be synced (Windows can't open one, some filesystems sync none)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))


def replace_file(source: Path, target: Path) -> None:
    """os.replace, the atomic step on every platform. Windows won't replace a file another process has open (sample.py
    reading it); readers are brief, so there it is tried again, waiting longer each time."""
    for attempt in range(1, 10 if sys.platform == "win32" else 1):
        with contextlib.suppress(PermissionError):
            return os.replace(source, target)
        time.sleep(0.05 * attempt)
    os.replace(source, target)


def why_not_a_file(path: Path) -> str:
    """What stands at a path that is no regular file, in words: nothing, a directory, a link, or something else."""
    if not path.exists():
        return "is a broken symbolic link" if path.is_symlink() else "does not exist"
    if path.is_dir():
        return "is a directory"
    if path.is_symlink():
        return "is a symbolic link"
    return "is not a regular file (a pipe, a device or a socket)"


def check_regular_file(path: Path) -> None:
    """Refuse anything at `path` but a regular file (or a link to one): a FIFO there would block its reader forever."""
    if path.exists() and not path.is_file():
        raise DataError(f"{path} {why_not_a_file(path)}; remove it, or name another directory")


def make_directory(path: Path, named: str) -> None:
    """A directory (with its parents) made unless there; `named`, how its one-line errors name it (out_dir=runs/x)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _not_made(err, path, named) from None


def _not_made(err: OSError, path: Path, named: str) -> Exception:
    """A directory's mkdir error as one line: a file where it goes, no permission, a full disk or no inodes left."""
    if isinstance(err, FileExistsError | NotADirectoryError):
        return ConfigError(f"{named}: {err.filename or path} is a file, not a directory; name another")
    if isinstance(err, PermissionError):
        return ConfigError(f"{named} is not writable ({err.strerror}: {err.filename}); name a folder you can write to")
    if err.errno in FULL_ERRNOS:
        return DiskFull(f"{named} not made: the disk holding it is full (no space or no inodes left)")
    return err


CKPT_NAME = "ckpt.pt"  # the latest state, to resume from
BEST_NAME = "best.pt"  # with train.keep_best: the state of the lowest val loss so far
METRICS_NAME = "metrics.jsonl"  # a JSON line per log line and evaluation
CONFIG_NAME = "config.yaml"  # the run's resolved config, for reading (plot.py groups runs by it)
LOG_NAME = "train.log"  # the run's console output, appended to by each resume
LOCK_NAME = ".lock"  # held by the run writing the directory; the OS releases it however the run ends
HYDRA_NAME = ".hydra"  # a folder: Hydra's record of the command that started the run
WHOLE_NAMES = (CKPT_NAME, BEST_NAME, METRICS_NAME, CONFIG_NAME)  # replaced whole, through NAME.tmp
# All a run writes (wandb/: train.wandb.enabled's), so all a directory may hold for a new run to start in it
RUN_NAMES = {*WHOLE_NAMES, LOG_NAME, LOCK_NAME, HYDRA_NAME, "wandb"}


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    def check_new(self) -> None:
        """A new run starts only in a new or empty directory, or one that a run killed before its first checkpoint
        left (nothing but RUN_NAMES and temporaries): never over a run, nor beside files of the user's own, which
        an empty out_dir (the current directory) would have replaced."""
        if (self.path / CKPT_NAME).exists():
            raise ConfigError(f"out_dir={self.path} already holds a run; pass resume=true to continue it, or another "
                              "out_dir")
        names = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
        theirs = [name for name in names if name not in RUN_NAMES and not name.endswith(".tmp")]
        if theirs:
            raise ConfigError(f"out_dir={self.path} holds files no run wrote ({', '.join(theirs[:3])}); a new run "
                              "needs a new or empty directory: name another out_dir")

    def open(self, held: contextlib.ExitStack) -> None:
        """Made (a file in its place, no permission, a full disk: one line) and locked for as long as `held` is; a
        killed writer's temporaries removed; train.log added to the log's handlers."""
        make_directory(self.path, f"out_dir={self.path}")
        # The lock and train.log are opened where they are: a link there would be written through. The others are
        # replaced whole, a link with them (metrics.jsonl too: removed by a new run, rewritten by a resume's cut).
        in_place = (LOCK_NAME, LOG_NAME)
        for name in (*WHOLE_NAMES, *in_place):
            path = self.path / name
            if path.exists() and not path.is_file() or path.is_symlink() and name in in_place:
                raise DataError(f"{path} {why_not_a_file(path)}; a run never writes through one: remove it")
        hydra = self.path / HYDRA_NAME
        if hydra.exists() and not hydra.is_dir() or hydra.is_symlink():
            kind = "a symbolic link" if hydra.is_symlink() else "not a directory"
            raise DataError(f"{hydra} is {kind}; a run keeps Hydra's record of its command in that folder: remove it")
        try:
            with unless_disk_full(self.path / LOCK_NAME):  # no inodes left
                held.enter_context(FileLock(self.path / LOCK_NAME, timeout=0))
        except Timeout:
            raise RunLocked(f"out_dir={self.path} is being written by another run; wait for it to end or stop it, "
                            "or use another out_dir") from None
        for name in WHOLE_NAMES:  # the lock says their writer is gone (NAME.PID.tmp: an older version's)
            for tmp in (self.path / f"{name}.tmp", *self.path.glob(f"{glob.escape(name)}.*[0-9].tmp")):
                tmp.unlink(missing_ok=True)
        with unless_disk_full(self.path / LOG_NAME):
            handler = held.enter_context(contextlib.closing(RunLog(self.path / LOG_NAME)))
        logging.getLogger().addHandler(handler)
        held.callback(logging.getLogger().removeHandler, handler)

    @contextlib.contextmanager
    def starting(self, held: contextlib.ExitStack) -> Iterator[None]:
        """Around open(held) and the run's first writes: should they fail (a full disk), a directory made here goes
        again with all they wrote, so that a run that never started leaves none behind, as a refused one doesn't."""
        made = not self.path.exists()
        try:
            yield
        except BaseException as err:
            if made and not isinstance(err, RunLocked):  # a locked one is another run's
                shutil.rmtree(self.path, ignore_errors=True)  # still locked: no other run starts in it meanwhile
                held.close()
            raise

    def write(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        """write(f) fills NAME.tmp, synced, then renamed over NAME (write_atomically): a crash or a full disk leaves
        the previous file whole. The lock makes this run the one writer: a killed writer's NAME.tmp is overwritten."""
        write_atomically(self.path / name, write)

    def write_text(self, name: str, text: str) -> None:
        self.write(name, lambda f: f.write(text.encode("utf-8")))

    def append(self, name: str, line: str) -> None:
        path = self.path / name
        with unless_disk_full(path), open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def cut_history(self, last_iter: int) -> list[dict[str, Any]]:
        """On resume, metrics.jsonl without the lines written after the checkpoint's iteration and the damaged ones,
        replaced whole; the records kept."""
        path = self.path / METRICS_NAME
        if not path.is_file():
            return []
        kept = [(line, record) for line in path.read_bytes().splitlines() if (record := _record(line, last_iter))]
        self.write_text(METRICS_NAME, "".join(line.decode() + "\n" for line, _ in kept))  # each line ended
        return [record for _, record in kept]


class RunLog(logging.StreamHandler):
    """train.log. A line the disk can't take is dropped without a traceback: the one line that says why the run
    stopped (a full disk) is then what the console shows."""

    def __init__(self, path: Path) -> None:
        super().__init__(open(path, "a", encoding="utf-8"))
        self.setFormatter(logging.Formatter("%(message)s"))

    def handleError(self, record: logging.LogRecord) -> None:
        """A failed write: dropped (the console has the line)."""

    def close(self) -> None:
        with contextlib.suppress(OSError):  # what a full disk left in the buffer
            self.stream.close()
        super().close()


def read_records(out_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """metrics.jsonl's records, and how many of its lines are damaged (cut short, not UTF-8) and left out."""
    lines = (out_dir / METRICS_NAME).read_bytes().splitlines()
    records = [record for record in map(_record, lines) if record]
    return records, len(lines) - len(records)


def _record(line: bytes, last_iter: float = math.inf) -> dict[str, Any] | None:
    """The line's record if it is whole and at or before last_iter, null (a NaN when written) read as NaN."""
    try:
        record = json.loads(line)  # bytes: decoded as UTF-8 (a bad byte is a ValueError too)
    except (ValueError, RecursionError):  # RecursionError: brackets nested past Python's limit
        return None
    whole = isinstance(record, dict) and isinstance(record.get("iter"), int)
    if not whole or record["iter"] > last_iter:
        return None
    return {k: math.nan if v is None else v for k, v in record.items()}
