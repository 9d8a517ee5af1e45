"""Connection limits for serve.py: at most max_connections open (past it the one idle longest closes, else the new
one); no whole request within header_timeout_s of opening or the last answer: closed; refusals logged once a minute."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("serve")
LOG_EVERY_S = 60.0
FDS_SPARE = 64  # descriptors kept for the model's files, the log and the engine
OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def usable_connections(wanted: int) -> int:
    """max_connections within what the process may open: its soft limit raised to the hard one, less spare."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(1, min(wanted, soft - FDS_SPARE))


class Refusals:
    """One log line per kind of refusal per LOG_EVERY_S, saying how many there were since."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def note(self, kind: str) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        now = time.monotonic()
        if now - self.last.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            log.warning(f"{kind} ({self.count[kind]} since the last such line)")
            self.last[kind], self.count[kind] = now, 0

    def loop_errors(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """accept() out of descriptors: one line per minute, no traceback; anything else as asyncio reports it."""
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno in OUT_OF_RESOURCES:
            self.note(f"event loop: {context.get('message', 'error')} ({error.strerror})")
        else:
            loop.default_exception_handler(context)

    def filter(self, record: logging.LogRecord) -> bool:
        """uvicorn's warnings per connection (an invalid request, an upgrade), counted and said once a minute."""
        if record.levelno != logging.WARNING:
            return True
        self.note(f"refused: {record.getMessage()}")
        return False


def guarded_protocol(max_connections: int, header_timeout_s: float, refusals: Refusals) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the cap and the request timeout."""

    class Guarded(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._asked, self._timer = time.monotonic(), None
            open_ = [c for c in self.connections if not c.transport.is_closing()]  # aborted ones leave later
            if len(open_) > max_connections:  # the one waiting longest on its client goes, else this one
                idle = [c for c in open_ if c is not self and c._idle()]
                oldest = min(idle, key=lambda c: c._asked) if idle else self
                refusals.note(f"connection closed: {max_connections} open already (max_connections)")
                oldest._close()
                if oldest is self:
                    return
            self._arm()

        def _idle(self) -> bool:
            """Waiting on its client: for a request, or for the rest of one's body."""
            return self.cycle is None or self.cycle.response_complete or self.cycle.more_body

        def _arm(self) -> None:
            """A whole request, body included, is due within header_timeout_s from now."""
            self._asked = time.monotonic()
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(header_timeout_s, self._check_progress)

        def _close(self) -> None:
            """At once if it never had a request; after what is buffered for it if it had (an answer's end)."""
            self.transport.abort() if self.cycle is None else self.transport.close()

        def _check_progress(self) -> None:
            """Closed if still waiting on its client; one being answered is due again after its answer."""
            self._timer = None
            if self._idle() and not self.transport.is_closing():
                refusals.note(f"connection closed: no whole request within {header_timeout_s:g} s (header_timeout_s)")
                self._close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

    return Guarded
