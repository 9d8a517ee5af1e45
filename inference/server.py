"""OpenAI's completions API over the engine: GET /v1/models, POST /v1/completions (streamed or whole), GET /health,
vLLM's tokenizer endpoints and the live page. Every request is checked first (a 4xx naming the field) and bounded."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.config import SEED_MAX
from common.errors import UserError
from data.tokenizers import Tokenizer
from inference.api import (
    UNSUPPORTED,
    ApiError,
    BodyLimit,
    CompletionRequest,
    DetokenizeRequest,
    HostCheck,
    TokenizeRequest,
)
from inference.engine import Completion, Engine
from inference.page_routes import add_page
from inference.sampling import SampleText
from inference.schema import ServeConfig
from inference.streaming import Choice, Deadline, Mailbox, Update, stream_events, updates_of, usage
from model.gpt import Decoding, row_generators

log = logging.getLogger("serve")
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI takes up to 4; each is searched for after every token
MAX_LOGPROBS = 5  # OpenAI's limit on the alternatives reported per token
PAGE_TASKS = 16  # the live page's tasks waiting at once, one in the engine at a time (run_once); past it: 503
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


class Service:
    """The model behind the API: turns checked requests into engine Completions, and their text into answers."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_id: str, limits: ServeConfig) -> None:
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.limits = limits  # serve.py's config, whose max_* keys and timeout_s bound each request
        self.created = int(time.time())
        self._mailbox: Mailbox | None = None
        self.induction: Any = None  # the model's induction scores, for the live page (they don't depend on text)
        self.page_tasks = 0  # the live page's tasks waiting or running (call)
        self.page_turn = asyncio.Lock()  # one in the engine at a time: one render's attention maps in memory
        self.stop_by = math.inf  # on the event loop's clock: when requests still running end (serve_run.Stopping)

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
        least = 0 if request.echo else 1  # echo with max_tokens=0: the prompt scored, nothing generated
        if not least <= request.max_tokens <= limits.max_tokens:
            raise ApiError(400, f"max_tokens={request.max_tokens} must be between {least} and {limits.max_tokens}"
                           + (" (0 with echo=true)" if least else ""), "max_tokens")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs={request.logprobs} must be between 0 and {MAX_LOGPROBS}", "logprobs")
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
        prompts = request.prompts()
        if request.n < 1:
            raise ApiError(400, f"n={request.n} must be at least 1", "n")
        asks = f"n={request.n} for {len(prompts)} prompt(s) asks for {len(prompts) * request.n} choices"
        if len(prompts) * request.n > self.engine.max_batch + limits.max_queue:  # would never fit: not a 503
            raise ApiError(400, f"{asks}; this server holds {self.engine.max_batch + limits.max_queue} at most "
                           "(max_batch + max_queue)", "n")
        if len(prompts) * request.n > limits.max_choices:
            raise ApiError(400, f"{asks}; at most {limits.max_choices} per request", "n")
        given = _requested_stops(request)
        if any(s == "" for s in given):
            raise ApiError(400, "stop has an empty string, which would stop at once; remove it", "stop")
        if len(given) > MAX_STOPS or max(map(len, given), default=0) > MAX_STOP_CHARS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                           "stop")
        return [self._encode(prompt) for prompt in prompts]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's tokens (a learned-position model sees the last block_size of them, as in sample.py)."""
        if not prompt:
            raise ApiError(400, "prompt is empty; give at least one character", "prompt")
        ids = self.encode(prompt) if isinstance(prompt, str) else self.known_ids(prompt, "prompt")
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                           f"{self.limits.max_prompt_tokens} (max_prompt_tokens)", "prompt")
        return ids

    def encode(self, text: str, end_of_text: bool = False) -> list[int]:
        """Its tokens, as sample.py's prompts; end_of_text: its end-of-text marks as that token (vLLM's /tokenize)."""
        end = self.tokenizer.end_of_text
        try:
            if not (end_of_text and end):
                return self.tokenizer.encode(text)
            parts = [self.tokenizer.encode(part) for part in text.split(end)]
            end_id = self.tokenizer.end_of_text_id
            return [i for n, part in enumerate(parts) for i in ([end_id] if n else []) + part]
        except UserError as err:  # a character a char-level model has never seen
            raise ApiError(400, f"prompt: {err}", "prompt") from None

    def known_ids(self, ids: list[int], param: str = "tokens") -> list[int]:
        vocab_size = self.tokenizer.vocab_size  # the model's may be padded past it, with ids that decode to nothing
        unknown = [i for i in ids if not 0 <= i < vocab_size or self._token_text(i) is None]
        if unknown:
            raise ApiError(400, f"{param}: token id {unknown[0]} is not in this model's vocabulary (0 to "
                           f"{vocab_size - 1}, less the ids its encoding leaves unused)", param)
        return list(ids)

    def submit(self, request: CompletionRequest, prompts: list[list[int]], on_update) -> list[Choice]:
        """One Completion per prompt x n, queued on the engine (503 if the queue is full)."""
        running, waiting = self.engine.load
        free = self.engine.max_batch + self.limits.max_queue - running - waiting
        if len(prompts) * request.n > free:
            raise ApiError(503, f"the server is busy ({running} running, {waiting} waiting); retry shortly",
                           kind="server_busy", headers={"Retry-After": "1"})
        decoding = Decoding(request.temperature, request.top_k, None if request.top_p == 1 else request.top_p,
                            request.min_p)
        stops, end = _requested_stops(request), self.tokenizer.end_of_text  # and the end of text, as sample.py's
        stops += [end] if end and end not in stops else []
        generators = row_generators(request.seed, len(prompts) * request.n, self.engine.runtime.device)  # seed + i
        scored = request.logprobs is not None
        choices = []
        for p, ids in enumerate(prompts):
            echo = self.tokenizer.decode(ids) if request.echo else ""
            for j in range(request.n):
                index = p * request.n + j
                text = SampleText(self.tokenizer, "", stops)
                completion = Completion(ids, request.max_tokens, decoding, text,
                                        lambda piece, done, i=index: on_update(i, piece, done, choices[i].tokens()),
                                        generator=None if generators is None else generators[index],
                                        logprobs=request.logprobs, score_prompt=request.echo and scored)
                choices.append(Choice(index, completion, len(ids), echo, self.token_text if scored else None))
        try:
            for choice in choices:
                self.engine.submit(choice.completion)
        except RuntimeError as err:  # shutting down, or the engine failed: none of these will run
            for choice in choices:
                choice.completion.cancelled = True
            raise ApiError(503, f"the server can't take requests now ({err})", kind="server_unavailable") from None
        return choices

    async def call(self, task: Callable[[], Any]) -> Any:
        """`task` on the engine's thread, in its turn between steps; 503 past PAGE_TASKS waiting."""
        if self.page_tasks >= PAGE_TASKS:
            raise ApiError(503, f"the live page's work is busy ({self.page_tasks} tasks); retry shortly",
                           kind="server_busy", headers={"Retry-After": "1"})
        self.page_tasks += 1  # counted on the event loop's thread only
        try:
            async with self.page_turn:
                try:
                    future = self.engine.call(task)
                except RuntimeError as err:
                    raise ApiError(503, f"the server can't take requests now ({err})",
                                   kind="server_unavailable") from None
                return await asyncio.wrap_future(future)
        finally:
            self.page_tasks -= 1

    @property
    def block_size(self) -> int:
        return self.engine.model.config.block_size

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one Service per process)
    def _token_text(self, token: int) -> str | None:
        """A token's text; None for an id no text has (the model's padded vocabulary, an encoding's unused ids)."""
        if not 0 <= token < self.tokenizer.vocab_size:
            return None
        try:
            return self.tokenizer.decode([token])
        except KeyError:  # tiktoken's encodings with gaps (cl100k_base)
            return None

    def token_text(self, token: int) -> str:
        return self._token_text(token) or ""

    def answer(self, answer_id: tuple[str, int], choices: list[dict[str, Any]], usage: Any = ...) -> dict:
        """OpenAI's completion object, or a stream's chunk; `usage` left out unless given."""
        completion_id, created = answer_id
        body = {"id": completion_id, "object": "text_completion", "created": created, "model": self.model_id,
                "choices": choices}
        if usage is not ...:
            body["usage"] = usage
        return body


def _requested_stops(request: CompletionRequest) -> list[str]:
    return [request.stop] if isinstance(request.stop, str) else list(request.stop or [])


def create_app(service: Service, api_key: str | None = None, on_ready: Callable[[], None] | None = None,
               hosts: set[str] | None = None) -> FastAPI:
    """The ASGI app, which starts and closes the engine's thread. hosts: the Host header's names it answers, or any."""

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
    if hosts is not None:
        app.add_middleware(HostCheck, names=hosts)

    def key_given(credentials: HTTPAuthorizationCredentials | None) -> bool:
        """The header's bytes (HTTP hands them over as latin-1) against the key's UTF-8, in constant time."""
        given = b"" if credentials is None else credentials.credentials.encode("latin-1", "replace")
        return credentials is not None and secrets.compare_digest(given, api_key.encode("utf-8"))

    async def authorised(credentials: Credentials) -> None:
        if api_key is not None and not key_given(credentials):
            raise ApiError(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                           code="invalid_api_key")

    _answer_errors(app)
    add_page(app, service, authorised)
    _add_health(app, service, None if api_key is None else key_given)
    _add_tokenizer(app, service, authorised)

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, Any]:
        model = {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "gpt-lab"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(request: CompletionRequest, http: Request):
        prompts = await asyncio.to_thread(service.check, request)  # tokenizing a long prompt: off the event loop
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()
        mailbox = service.mailbox(loop)
        choices = service.submit(request, prompts, lambda *update: mailbox.put(updates, update))
        answer_id = (f"cmpl-{secrets.token_hex(12)}", int(time.time()))
        deadline = Deadline(loop.time() + service.limits.timeout_s, lambda: service.stop_by)
        if request.stream:
            include_usage = bool((request.stream_options or {}).get("include_usage"))
            answer = functools.partial(service.answer, answer_id)
            return EventSourceResponse(stream_events(answer, choices, updates, deadline, request.n, include_usage))
        texts = [choice.echo for choice in choices]
        try:
            async for batch in updates_of(choices, updates, deadline, http):
                for index, piece, _, _ in batch:
                    texts[index] += piece
        finally:
            for choice in choices:
                choice.completion.cancelled = True  # no-op for finished ones
        body = [{"text": text, "index": c.index, "logprobs": c.logprobs(c.tokens()),
                 "finish_reason": c.completion.finish_reason} for text, c in zip(texts, choices, strict=True)]
        return service.answer(answer_id, body, usage(choices, request.n))

    return app


def _add_health(app: FastAPI, service: Service, key_given: Callable[..., bool] | None) -> None:
    """GET /health: alive or not, for anyone (a load balancer's checks); the load too, with the key if one is set."""

    @app.get("/health")
    async def health(credentials: Credentials) -> JSONResponse:
        running, waiting = service.engine.load
        engine = service.engine
        body = {"status": "failed" if engine.failed else "ok"}
        if key_given is None or key_given(credentials):
            body |= {"model": service.model_id, "running": running, "waiting": waiting, "steps": engine.steps,
                     "finished": dict(engine.finished)}
        return JSONResponse(body, status_code=503 if engine.failed else 200)


def _add_tokenizer(app: FastAPI, service: Service, authorised: Callable[..., Any]) -> None:
    """vLLM's tokenizer endpoints, which lm-evaluation-harness's local-completions uses by itself."""

    @app.get("/tokenizer_info", dependencies=[Depends(authorised)])
    async def tokenizer_info() -> dict[str, Any]:
        return {"eos_token": service.tokenizer.end_of_text, "bos_token": None, "pad_token": None,
                "model_max_length": service.block_size}

    @app.post("/tokenize", dependencies=[Depends(authorised)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ids = await asyncio.to_thread(service.encode, body.prompt, True)
        return {"tokens": ids, "count": len(ids), "max_model_len": service.block_size}

    @app.post("/detokenize", dependencies=[Depends(authorised)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ids = await asyncio.to_thread(service.known_ids, body.tokens)
        return {"prompt": await asyncio.to_thread(service.tokenizer.decode, ids)}


def _answer_errors(app: FastAPI) -> None:
    """Every error as OpenAI's error object: a refused request, a body pydantic refused, an unknown endpoint, a bug."""

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
    async def bug(request: Request, err: Exception) -> JSONResponse:  # its traceback to the server's log only
        log.error(f"{request.method} {request.url.path} failed", exc_info=err)
        message = "the server failed on this request; its log has the details"
        return ApiError(500, message, kind="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.url.path}"}.get(err.status_code, str(err.detail))
        return ApiError(err.status_code, message, None).response()
