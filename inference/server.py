"""OpenAI's completions API over the engine: GET /v1/models, POST /v1/completions (streamed as server-sent
events or whole), GET /health, and the live page at / with its endpoints under /page/.

Every request is checked before it reaches the engine: a bad one gets a 4xx with OpenAI's error object naming
the field ({"error": {"message", "type", "param", "code"}}), never a 500 or a traceback, and the server goes on
serving (a 500 means the model failed on the server's side, whose log has the traceback). Work is bounded: a
body size limit, max_tokens, choices and stop strings per request, a queue (503 with Retry-After past it), a
timeout, and a client that leaves frees its rows at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from analysis.causality import check_causality, verdict
from analysis.diagnostics import induction_scores
from analysis.explorer import live_page
from common.config import SEED_MAX
from common.errors import UserError
from data.tokenizers import Tokenizer
from inference.engine import Completion, Engine
from inference.sample_text import SampleText
from inference.schema import ServeConfig
from model.decoding import Decoding, row_generators

log = logging.getLogger("serve")
PAGE = Path(__file__).with_name("serve_page.html")
FLUSH_INTERVAL_S = 0.01  # the engine hands text on to the HTTP side at most this often (Mailbox)...
FLUSH_ROWS = 4  # ...per this many completions running
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI takes up to 4; each is searched for after every token
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a JSON number, not "0.5"
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


class ApiError(Exception):
    """A request the server refuses: its status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class CompletionRequest(BaseModel):
    """OpenAI's /v1/completions fields this server honours (top_k and min_p are extras, as vLLM takes them).
    Other OpenAI fields are accepted at their defaults and refused otherwise (RequestChecks.unsupported)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str]
    max_tokens: StrictInt = 16
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt | None = None
    min_p: Number | None = None
    stop: str | list[str] | None = None
    n: StrictInt = 1
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is an empty list; give a string or a list of strings")
        return prompt


class PageText(BaseModel):
    """The live page's text: the prompt and what was generated after it (its first prompt_chars characters)."""

    model_config = ConfigDict(extra="forbid")

    text: str
    prompt_chars: StrictInt = 0


class PageChange(PageText):
    """Replace the text's token `position` (of its last block_size) with `replacement`, one token's text."""

    position: StrictInt
    replacement: str


# Fields OpenAI defines that this server doesn't implement: allowed only at their no-op values.
UNSUPPORTED = {"echo": (None, False), "logprobs": (None, 0), "best_of": (None, 1), "suffix": (None, ""),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {})}


class BodyLimit:
    """413 with OpenAI's error object for a body over max_bytes: by its Content-Length before reading, or as
    its chunks add up past it (starlette's own limit answers in plain text)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(413, f"the body is larger than {self.max_bytes} bytes (max_body_bytes)")
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_large  # the app answers 400 for a body it couldn't read: ours replaces that below
            return message

        async def answer(message: Message) -> None:
            if seen <= self.max_bytes:
                await send(message)
            elif message["type"] == "http.response.start":
                await too_large.response()(scope, receive, send)

        await self.app(scope, counted, answer)


@dataclass
class Choice:
    index: int
    completion: Completion
    prompt_tokens: int


class Service:
    """The model behind the API: turns checked requests into engine Completions, and their text into answers."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_id: str, limits: ServeConfig) -> None:
        """limits: serve.py's config, whose max_* keys and timeout_s bound each request."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.limits = limits
        self.created = int(time.time())
        self._mailbox: Mailbox | None = None
        self.induction: Any = None  # the model's induction scores, for the live page (they don't depend on text)

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The one Mailbox of the server's event loop (made by the first request that runs on it)."""
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
            self.engine.after_step = self._mailbox.flush
        return self._mailbox

    def check(self, request: CompletionRequest) -> list[list[int]]:
        """The prompts' tokens, after every range and limit check (ApiError naming the field)."""
        limits = self.limits
        if request.model is not None and request.model != self.model_id:
            raise ApiError(404, f"model {request.model!r} does not exist; this server serves {self.model_id!r}",
                           "model", code="model_not_found")
        for name, allowed in UNSUPPORTED.items():
            value = (request.model_extra or {}).get(name)
            if value not in allowed:
                raise ApiError(400, f"{name}={value!r} is not supported by this server; leave it out", name)
        if not 1 <= request.max_tokens <= limits.max_tokens:
            raise ApiError(400, f"max_tokens={request.max_tokens} must be between 1 and {limits.max_tokens}",
                           "max_tokens")
        if not 0 <= request.temperature <= 2:
            raise ApiError(400, f"temperature={request.temperature} must be between 0 and 2 (0: greedy)",
                           "temperature")
        if not 0 < request.top_p <= 1:
            raise ApiError(400, f"top_p={request.top_p} must be in (0, 1]", "top_p")
        if request.top_k is not None and request.top_k < 1:
            raise ApiError(400, f"top_k={request.top_k} must be at least 1", "top_k")
        if request.min_p is not None and not 0 < request.min_p <= 1:
            raise ApiError(400, f"min_p={request.min_p} must be in (0, 1]", "min_p")
        if request.seed is not None and not 0 <= request.seed <= SEED_MAX:
            raise ApiError(400, f"seed={request.seed} must be between 0 and {SEED_MAX}", "seed")
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if request.n < 1:
            raise ApiError(400, f"n={request.n} must be at least 1", "n")
        if len(prompts) * request.n > limits.max_choices:
            raise ApiError(400, f"n={request.n} for {len(prompts)} prompt(s) asks for {len(prompts) * request.n} "
                           f"choices; at most {limits.max_choices} per request", "n")
        given = _requested_stops(request)
        if any(s == "" for s in given):
            raise ApiError(400, "stop has an empty string, which would stop at once; remove it", "stop")
        if len(given) > MAX_STOPS or max(map(len, given), default=0) > MAX_STOP_CHARS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                           "stop")
        return [self._encode(prompt, request.max_tokens) for prompt in prompts]

    def _encode(self, prompt: str, max_tokens: int) -> list[int]:
        if not prompt:
            raise ApiError(400, "prompt is empty; give at least one character", "prompt")
        try:
            ids = self.tokenizer.encode(prompt)
        except UserError as err:  # a character a char-level model has never seen
            raise ApiError(400, f"prompt: {err}", "prompt") from None
        if self.engine.model.config.rolls:
            if len(ids) > self.limits.max_prompt_tokens:
                raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                               f"{self.limits.max_prompt_tokens} (max_prompt_tokens)", "prompt")
        elif len(ids) + max_tokens > self.block_size:
            param = "prompt" if len(ids) >= self.block_size else "max_tokens"
            raise ApiError(400, f"this model's context is {self.block_size} tokens; the prompt has {len(ids)} and "
                           f"max_tokens asks for {max_tokens} more: shorten the prompt or lower max_tokens", param)
        return ids

    def _stops(self, request: CompletionRequest) -> list[str]:
        """The request's stop strings, and the end of text (a BPE model's <|endoftext|>), as sample.py has them."""
        stops = _requested_stops(request)
        end = self.tokenizer.end_of_text
        return stops + ([end] if end and end not in stops else [])

    def submit(self, request: CompletionRequest, prompts: list[list[int]], on_update) -> list[Choice]:
        """One Completion per prompt x n, queued on the engine (503 if the queue is full)."""
        running, waiting = self.engine.load
        free = self.engine.max_batch + self.limits.max_queue - running - waiting
        if len(prompts) * request.n > free:
            raise ApiError(503, f"the server is busy ({running} running, {waiting} waiting); retry shortly",
                           kind="server_busy", headers={"Retry-After": "1"})
        decoding = Decoding(request.temperature, request.top_k, None if request.top_p == 1 else request.top_p,
                            request.min_p)
        stops = self._stops(request)
        device = self.engine.runtime.device
        generators = row_generators(request.seed, len(prompts) * request.n, device)  # choice i: seed + i
        choices = []
        for p, ids in enumerate(prompts):
            for j in range(request.n):
                index = p * request.n + j
                text = SampleText(self.tokenizer, "", stops)
                completion = Completion(ids, request.max_tokens, decoding, text,
                                        lambda piece, done, i=index: on_update(i, piece, done),
                                        generator=None if generators is None else generators[index])
                choices.append(Choice(index, completion, len(ids)))
        try:
            for choice in choices:
                self.engine.submit(choice.completion)
        except RuntimeError as err:  # shutting down, or the engine failed: none of these will run
            for choice in choices:
                choice.completion.cancelled = True
            raise ApiError(503, f"the server can't take requests now ({err})", kind="server_unavailable") from None
        return choices

    async def call(self, task: Callable[[], Any]) -> Any:
        """`task` on the engine's thread, between steps (503 if the engine can't take it)."""
        try:
            future = self.engine.call(task)
        except RuntimeError as err:
            raise ApiError(503, f"the server can't take requests now ({err})", kind="server_unavailable") from None
        return await asyncio.wrap_future(future)

    @property
    def block_size(self) -> int:
        return self.engine.model.config.block_size

    def page_tokens(self, page: PageText) -> tuple[list[int], int]:
        """The text's last block_size tokens (all the page shows), and how many of them are the prompt's."""
        if not page.text:
            raise ApiError(400, "text is empty; generate something first", "text")
        prompt = page.text[: max(0, page.prompt_chars)]
        try:
            ids = self.tokenizer.encode(page.text)
            n_prompt = len(self.tokenizer.encode(prompt)) if prompt else 0
        except UserError as err:
            raise ApiError(400, f"text: {err}", "text") from None
        cut = max(0, len(ids) - self.block_size)
        return ids[cut:], max(0, n_prompt - cut)

    def page_changes(self, change: PageChange) -> dict[str, Any]:
        """Every position's largest change of the logits, on both attention paths, when token `position` of the
        page's tokens is replaced (analysis/causality.py); the engine's thread runs it, between steps."""
        ids, _ = self.page_tokens(change)
        if not 0 <= change.position < len(ids):
            raise ApiError(400, f"position={change.position} is not a token of the text (0 to {len(ids) - 1})",
                           "position")
        try:
            replacement = self.tokenizer.encode(change.replacement)
        except UserError as err:
            raise ApiError(400, f"replacement: {err}", "replacement") from None
        if len(replacement) != 1:
            raise ApiError(400, f"replacement {change.replacement!r} is {len(replacement)} tokens; give one token's "
                           "text", "replacement")
        if replacement[0] == ids[change.position]:
            raise ApiError(400, f"replacement {change.replacement!r} is the token already there; give another",
                           "replacement")
        return {"ids": ids, "replacement": replacement[0]}

    def answer(self, answer_id: tuple[str, int], choices: list[dict[str, Any]], usage: Any = ...) -> dict:
        """OpenAI's completion object (a stream's chunks too: one id and `created` for all of them); `usage`
        left out unless given (None: a stream's chunk before the usage one)."""
        completion_id, created = answer_id
        body = {"id": completion_id, "object": "text_completion", "created": created, "model": self.model_id,
                "choices": choices}
        if usage is not ...:
            body["usage"] = usage
        return body


def _requested_stops(request: CompletionRequest) -> list[str]:
    return [request.stop] if isinstance(request.stop, str) else list(request.stop or [])


def usage(choices: list[Choice], n: int) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in choices[::n])  # each prompt once, however many choices it has
    completion = sum(len(c.completion.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(service: Service, api_key: str | None = None, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The ASGI app; the engine's thread is started and closed with it (lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.engine.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await asyncio.to_thread(service.engine.close)

    app = FastAPI(title="gpt-lab", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=service.limits.max_body_bytes)
    async def authorised(credentials: Credentials) -> None:
        if api_key is None:
            return
        given = b"" if credentials is None else credentials.credentials.encode("utf-8", "surrogateescape")
        if credentials is None or not secrets.compare_digest(given, api_key.encode("utf-8")):  # bytes: any text
            raise ApiError(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                           code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return ApiError(400, "the body is not valid JSON", None).response()
        param = where[0] if where else None
        value = "" if param is None or "input" not in first else f" (got {json.dumps(first['input'])[:80]})"
        return ApiError(400, f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}{value}", param).response()

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:
        """A bug: its traceback in the server's log, OpenAI's error object (without it) to the client."""
        log.error(f"{request.method} {request.url.path} failed", exc_info=err)
        message = "the server failed on this request; its log has the details"
        return ApiError(500, message, kind="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.url.path}"}.get(err.status_code, str(err.detail))
        return ApiError(err.status_code, message, None).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        running, waiting = service.engine.load
        engine = service.engine
        body = {"status": "failed" if engine.failed else "ok", "model": service.model_id, "running": running,
                "waiting": waiting, "steps": engine.steps, "finished": dict(engine.finished)}
        return JSONResponse(body, status_code=503 if engine.failed else 200)

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, Any]:
        model = {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "gpt-lab"}
        return {"object": "list", "data": [model]}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.post("/page/tokens", dependencies=[Depends(authorised)])
    async def page_tokens(text: PageText) -> dict[str, Any]:
        ids, n_prompt = service.page_tokens(text)
        return {"tokens": [service.tokenizer.decode([i]) for i in ids], "prompt_tokens": n_prompt}

    @app.post("/page/attention", dependencies=[Depends(authorised)], response_class=HTMLResponse)
    async def page_attention(text: PageText) -> HTMLResponse:
        """The attention explorer's page (analysis/explorer.py) for the text on screen."""
        ids, n_prompt = service.page_tokens(text)
        tokens = [service.tokenizer.decode([i]) for i in ids]
        engine = service.engine
        if service.induction is None:
            service.induction = await service.call(lambda: induction_scores(engine.model))
        title = f"{service.model_id} (live)"
        task = functools.partial(live_page, engine.model, ids, tokens, max(1, n_prompt), title, service.induction)
        return HTMLResponse(await service.call(task))

    @app.post("/page/causality", dependencies=[Depends(authorised)])
    async def page_causality(change: PageChange) -> dict[str, Any]:
        """Replace one token: how much every position's prediction changes, on both attention paths."""
        args = service.page_changes(change)
        engine = service.engine
        task = functools.partial(check_causality, engine.model, args["ids"], change.position, args["replacement"])
        report = await service.call(task)
        return {
            "tokens": [service.tokenizer.decode([i]) for i in args["ids"]],
            "position": change.position,
            "replacement": service.tokenizer.decode([args["replacement"]]),
            "changes": {impl: change.tolist() for impl, change in report.changes.items()},
            "receptive_field": report.receptive_field,
            "last_reachable": report.last_reachable,
            "mask_held": report.mask_held,
            "verdict": verdict(report),
        }

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(request: CompletionRequest, http: Request):
        prompts = service.check(request)
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()
        mailbox = service.mailbox(loop)
        choices = service.submit(request, prompts, lambda *update: mailbox.put(updates, update))
        answer_id = (f"cmpl-{secrets.token_hex(12)}", int(time.time()))
        deadline = loop.time() + service.limits.timeout_s
        if request.stream:
            include_usage = bool((request.stream_options or {}).get("include_usage"))
            return EventSourceResponse(_stream(service, choices, updates, answer_id, deadline, request.n,
                                               include_usage))
        texts = ["" for _ in choices]
        try:
            async for batch in _updates(choices, updates, deadline, http):
                for index, piece, _ in batch:
                    texts[index] += piece
        finally:
            for choice in choices:
                choice.completion.cancelled = True  # no-op for finished ones
        body = [{"text": text, "index": c.index, "logprobs": None, "finish_reason": c.completion.finish_reason}
                for text, c in zip(texts, choices, strict=True)]
        return service.answer(answer_id, body, usage(choices, request.n))

    return app


Update = tuple[int, str, bool]  # a choice's index, a piece of its text, whether it is done


class Mailbox:
    """Hands the engine thread's updates to the event loop at most once per FLUSH_INTERVAL_S, longer under load
    (FLUSH_INTERVAL_S per FLUSH_ROWS completions running), and whenever the engine runs out of work; not once
    per token. Waking the loop costs the engine a GIL hand-off, and every chunk costs the HTTP side: woken per
    token, one client's tokens came 1.4x slower on 2 CPU cores (bench.py serve). A step slower than the interval
    (a large model) flushes every step; a client reading slower than the engine gets a chunk per flush."""

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


async def _updates(choices: list[Choice], updates: asyncio.Queue[Update], deadline: float,
                   http: Request | None = None) -> AsyncIterator[list[Update]]:
    """The choices' pieces of text as the engine makes them, all that have arrived at once, until every choice is
    done; ApiError 504 past the deadline. With `http` (a whole answer), a client that left cancels them (a stream
    notices by itself)."""
    pending = len(choices)
    loop = asyncio.get_running_loop()
    checked = loop.time()
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            raise ApiError(504, "the request took longer than the server's timeout_s; ask for fewer tokens",
                           kind="timeout")
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
        pending -= sum(done for _, _, done in batch)
        if any(done and choices[index].completion.finish_reason == "error" for index, _, done in batch):
            raise ApiError(500, "the engine failed; see the server's log", kind="server_error")
        if batch:
            yield batch


async def _stream(service: Service, choices: list[Choice], updates: asyncio.Queue[Update], answer_id: tuple[str, int],
                  deadline: float, n: int, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunk objects as server-sent events, then `data: [DONE]`; the pieces add up to the whole text.
    A choice's pieces that arrived together (a client reading slower than the engine writes) go as one chunk.
    With include_usage, each chunk has "usage": null and a last one, with no choices, the usage."""
    no_usage = None if include_usage else ...
    try:
        try:
            async for batch in _updates(choices, updates, deadline):
                merged: dict[int, list] = {}
                for index, piece, done in batch:
                    text_done = merged.setdefault(index, ["", False])
                    text_done[0] += piece
                    text_done[1] = text_done[1] or done
                for index, (text, done) in merged.items():
                    reason = choices[index].completion.finish_reason if done else None
                    choice = {"text": text, "index": index, "logprobs": None, "finish_reason": reason}
                    yield format_sse_event(data_str=json.dumps(service.answer(answer_id, [choice], no_usage)))
        except ApiError as err:
            error = {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
            yield format_sse_event(data_str=json.dumps({"error": error}))
        if include_usage:
            yield format_sse_event(data_str=json.dumps(service.answer(answer_id, [], usage(choices, n))))
        yield format_sse_event(data_str="[DONE]")
    finally:  # a client that left: its rows leave at the next step
        for choice in choices:
            choice.completion.cancelled = True

