"""What a flood of connections can't take from serve.py: at most max_connections open at once (past it the oldest
that hasn't sent a whole request is closed, else the new one), a connection that hasn't sent a whole request
within header_timeout_s of opening or of its last answer is closed (slow or partial headers), and each kind of
refusal is logged once a minute at most, in one line (no traceback per connection)."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("serve")
LOG_EVERY_S = 60.0
FDS_SPARE = 64  # descriptors kept for the model's files, the log and the engine


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
        """The event loop's own errors (accept() out of descriptors, say): one line per kind, no traceback."""
        self.note(f"event loop: {context.get('message', 'error')}")


def guarded_protocol(max_connections: int, header_timeout_s: float, refusals: Refusals) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the cap and the header timeout."""

    class Guarded(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._opened, self._seen = time.monotonic(), self.cycle
            if len(self.connections) > max_connections:  # the oldest that asks nothing goes, else this one
                idle = [c for c in self.connections if c is not self and getattr(c, "_idle", lambda: False)()]
                oldest = min(idle, key=lambda c: c._opened) if idle else self
                refusals.note(f"connection closed: {max_connections} open already (max_connections)")
                oldest.transport.abort()
                if oldest is self:
                    return
            self._timer = self.loop.call_later(header_timeout_s, self._check_progress)

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _check_progress(self) -> None:
            """Closed if no request came since the last check and none is being answered."""
            if self._idle() and self.cycle is self._seen:
                refusals.note(f"connection closed: no whole request within {header_timeout_s:g} s (header_timeout_s)")
                self.transport.abort()
                return
            self._seen = self.cycle
            self._timer = self.loop.call_later(header_timeout_s, self._check_progress)

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return Guarded
