"""Engine thread to HTTP client: text batched (Mailbox), read till done (updates_of), sent as SSE (stream_events)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.sse import format_sse_event

from inference.api import ApiError
from inference.engine import Completion

FLUSH_INTERVAL_S = 0.01  # the engine hands text on to the HTTP side at most this often (Mailbox)...
FLUSH_ROWS = 4  # ...per this many completions running


@dataclass
class Choice:
    """One choice of a request, and what of it has been reported (a stream reports it a chunk at a time)."""

    index: int
    completion: Completion
    prompt_tokens: int
    echo: str = ""  # echo=true: the prompt's text, sent before the generated text
    token_text: Callable[[int], str] | None = None  # logprobs asked for: a token's text
    reported: int = 0  # generated tokens whose logprobs were sent
    prompt_reported: bool = False
    offset: int = 0  # characters of the text the reported tokens span (text_offset)

    def tokens(self) -> int:
        """The tokens generated so far (on the engine's thread, when a piece of text is handed on)."""
        return len(self.completion.tokens)

    def logprobs(self, upto: int) -> dict[str, list] | None:
        """OpenAI's logprobs object for the generated tokens not yet reported, up to the first `upto` (and the
        prompt's first, with echo; its first token has no log-probability: nothing predicts it)."""
        if self.token_text is None:
            return None
        completion, pairs = self.completion, []
        if completion.prompt_scores is not None and not self.prompt_reported:
            pairs += zip(completion.prompt, [None, *completion.prompt_scores], strict=True)
            self.prompt_reported = True
        start, self.reported = self.reported, max(self.reported, upto)
        pairs += zip(completion.tokens[start : self.reported], completion.scores[start : self.reported], strict=True)
        body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, scored in pairs:
            text = self.token_text(token)
            body["tokens"].append(text)
            body["token_logprobs"].append(None if scored is None else scored.logprob)
            top: dict[str, float] | None = None if scored is None else {}
            for t, p in [] if scored is None else scored.top:  # likeliest first: tokens of one text keep the first
                top.setdefault(self.token_text(t), p)
            body["top_logprobs"].append(top)
            body["text_offset"].append(self.offset)
            self.offset += len(text)
        return body


def usage(choices: list[Choice], n: int) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in choices[::n])  # each prompt once, however many choices it has
    completion = sum(len(c.completion.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


Update = tuple[int, str, bool, int]  # choice index, piece of text, done, its token count when it came (Choice.tokens)


class Mailbox:
    """Hands the engine thread's updates to the event loop at most every FLUSH_INTERVAL_S (per FLUSH_ROWS running),
    and when the engine goes idle: each wake-up costs the engine a GIL hand-off, each chunk costs the HTTP side."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[tuple[asyncio.Queue[Update], Update]] = []
        self.lock = threading.Lock()
        self.scheduled = False
        self.last = 0.0

    def put(self, queue: asyncio.Queue[Update], update: Update) -> None:  # the engine's thread
        with self.lock:
            self.items.append((queue, update))

    def flush(self, running: int) -> None:  # the engine's thread, after each step
        now = time.perf_counter()
        interval = FLUSH_INTERVAL_S * max(1.0, running / FLUSH_ROWS)
        with self.lock:
            if not self.items or self.scheduled or (running and now - self.last < interval):
                return
            self.scheduled, self.last = True, now
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # the loop's thread
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, update in items:
            queue.put_nowait(update)


@dataclass
class Deadline:
    """When a request must end, on the event loop's clock: its timeout_s, or the server's shutdown (stop_by)."""

    timeout_at: float
    stop_by: Callable[[], float]  # inf until the server is told to stop

    def left(self, now: float) -> float:
        """Seconds left; ApiError once there are none."""
        if now >= self.stop_by():
            raise ApiError(503, "the server is shutting down (shutdown_s passed); retry the request later",
                           kind="server_unavailable")
        if now >= self.timeout_at:
            raise ApiError(504, "the request took longer than the server's timeout_s; ask for fewer tokens",
                           kind="timeout")
        return min(self.timeout_at, self.stop_by()) - now


async def updates_of(choices: list[Choice], updates: asyncio.Queue[Update], deadline: Deadline,
                   http: Request | None = None) -> AsyncIterator[list[Update]]:
    """Batches of the choices' updates until all are done; ApiError past the deadline; ends if `http`'s client left."""
    pending = len(choices)
    loop = asyncio.get_running_loop()
    checked = loop.time()
    while pending:
        left = deadline.left(loop.time())
        batch = []
        if updates.empty():
            try:
                async with asyncio.timeout(min(left, 0.5)):
                    batch.append(await updates.get())
            except TimeoutError:
                pass
        while not updates.empty():
            batch.append(updates.get_nowait())
        if http is not None and loop.time() - checked > 0.5:
            checked = loop.time()
            if await http.is_disconnected():
                return
        pending -= sum(done for _, _, done, _ in batch)
        if any(done and choices[index].completion.finish_reason == "error" for index, _, done, _ in batch):
            raise ApiError(500, "the engine failed; see the server's log", kind="server_error")
        if batch:
            yield batch


async def stream_events(answer: Callable[..., dict], choices: list[Choice], updates: asyncio.Queue[Update],
                        deadline: Deadline, n: int, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunk objects as server-sent events, a choice's pieces that arrived together as one, then
    `data: [DONE]`. With include_usage, each chunk has "usage": null and a last one, with no choices, the usage."""
    no_usage = None if include_usage else ...
    try:
        try:
            async for batch in updates_of(choices, updates, deadline):
                merged: dict[int, tuple[str, bool, int]] = {}
                for index, piece, done, tokens in batch:
                    text, was_done, most = merged.get(index, (choices[index].echo, False, 0))
                    choices[index].echo = ""  # once, before the first piece
                    merged[index] = (text + piece, was_done or done, max(most, tokens))
                for index, (text, done, tokens) in merged.items():
                    reason = choices[index].completion.finish_reason if done else None
                    choice = {"text": text, "index": index, "logprobs": choices[index].logprobs(tokens),
                              "finish_reason": reason}
                    yield format_sse_event(data_str=json.dumps(answer([choice], no_usage)))
        except ApiError as err:
            error = {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
            yield format_sse_event(data_str=json.dumps({"error": error}))
        if include_usage:
            yield format_sse_event(data_str=json.dumps(answer([], usage(choices, n))))
        yield format_sse_event(data_str="[DONE]")
    finally:  # a client that left: its rows leave at the next step
        for choice in choices:
            choice.completion.cancelled = True
