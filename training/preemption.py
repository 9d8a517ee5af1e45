"""SIGTERM and Ctrl-C: finish the optimizer step, write a checkpoint, say how to resume, exit.

A second signal exits at once; the checkpoint on disk stays the last complete one.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType, TracebackType

log = logging.getLogger("train")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """Installed for the duration of a run (main thread only); the previous handlers come back after."""

    def __init__(self, second_quits: bool = True) -> None:
        """second_quits=False under torchrun: a scheduler may signal every process and torchrun forwards its own
        signal too, so a rank can get two at once; torchrun kills what is still running after its timeout."""
        self.signal: signal.Signals | None = None
        self.second_quits = second_quits
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopRequests:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            if self.second_quits:
                raise KeyboardInterrupt  # the second one: quit now
            return
        self.signal = signal.Signals(signum)
        log.warning(f"{self.signal.name}: finishing this step and writing a checkpoint (again to quit at once)")
