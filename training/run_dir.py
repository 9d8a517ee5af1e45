"""The run directory (out_dir): its files' names and every write into it, each protection built once, here. open()
makes it, locks it to this run, checks once that the files the run appends to are absent or regular (a link is never
written through, a FIFO never blocks the run) and starts train.log; write() replaces a file whole; append() adds a
line. metrics.jsonl's reader is here too, for plot.py, bench.py and the GPU check."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from filelock import FileLock, Timeout

from common.errors import DataError, RunLocked
from common.runtime import make_directory, unless_disk_full, why_not_a_file, write_atomically

CKPT_NAME = "ckpt.pt"  # the latest state, to resume from
BEST_NAME = "best.pt"  # with train.keep_best: the state of the lowest val loss so far
METRICS_NAME = "metrics.jsonl"  # a JSON line per log line and evaluation
CONFIG_NAME = "config.yaml"  # the run's resolved config, for reading (plot.py groups runs by it)
LOG_NAME = "train.log"  # the run's console output, appended to by each resume
LOCK_NAME = ".lock"  # held by the run writing the directory; the OS releases it however the run ends


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, held: contextlib.ExitStack) -> None:
        """Made (a file in its place, no permission, a full disk: one line) and locked for as long as `held` is;
        train.log added to the log's handlers."""
        make_directory(self.path, f"out_dir={self.path}")
        # The lock and train.log are opened where they are: a link there would be written through. The others are
        # replaced whole, a link with them (metrics.jsonl too: removed by a new run, rewritten by a resume's cut).
        in_place = (LOCK_NAME, LOG_NAME)
        for name in (CKPT_NAME, BEST_NAME, METRICS_NAME, CONFIG_NAME, *in_place):
            path = self.path / name
            if path.exists() and not path.is_file() or path.is_symlink() and name in in_place:
                raise DataError(f"{path} {why_not_a_file(path)}; a run never writes through one: remove it")
        try:
            held.enter_context(FileLock(self.path / LOCK_NAME, timeout=0))
        except Timeout:
            raise RunLocked(f"out_dir={self.path} is being written by another run; wait for it to end or stop it, "
                            "or use another out_dir") from None
        handler = held.enter_context(contextlib.closing(RunLog(self.path / LOG_NAME)))
        logging.getLogger().addHandler(handler)
        held.callback(logging.getLogger().removeHandler, handler)

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
