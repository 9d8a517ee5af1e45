"""serve.py's work: OpenAI's completions API over the engine (GET /v1/models, POST /v1/completions, streamed or
whole, GET /health), vLLM's tokenizer endpoints and the live page, on uvicorn. Every request is checked first (a 4xx
naming the field, OpenAI's error object) and bounded; the model then serves one request at a time, first come first
served (Service.turn), at most max_queue waiting."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import ipaddress
import json
import logging
import math
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import torch
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from analysis.causality import check_causality, verdict
from analysis.diagnostics import induction_scores
from analysis.explorer import live_page
from common.config import SEED_MAX
from common.errors import ConfigError, UserError
from common.runtime import make_runtime
from data.corpus import default_num_proc
from data.tokenizers import Tokenizer
from inference.engine import Choice, Engine, Job, Update
from inference.sampling import SampleText, ServeConfig, load_model
from model.gpt import Decoding, row_generators

log = logging.getLogger("serve")
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI takes up to 4; each is searched for after every token
MAX_LOGPROBS = 5  # OpenAI's limit on the alternatives reported per token
SHUTDOWN_MARGIN_S = 1.0  # after shutdown_s: for the requests' error events to go out
LOOPBACK = "this machine only"
API_KEY_ENV = "GPT_LAB_API_KEY"  # the api_key when the config leaves it null, so it needn't be on a command line
PAGE = Path(__file__).with_name("serve_page.html")
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a JSON number, not "0.5"
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]
Body = TypeVar("Body", bound=BaseModel)


class ApiError(Exception):
    """A request the server refuses: its status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class CompletionRequest(BaseModel):
    """OpenAI's /v1/completions fields served, plus vLLM's top_k and min_p; others at defaults only (UNSUPPORTED)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # a text, texts, token ids, or lists of token ids
    max_tokens: StrictInt = 16  # 0 with echo: score the prompt alone
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt | None = None
    min_p: Number | None = None
    stop: str | list[str] | None = None
    n: StrictInt = 1
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    logprobs: StrictInt | None = None  # each token's log-probability and this many likeliest others' (0-5)
    echo: StrictBool = False  # the prompt's text (and its tokens' logprobs) before the generated text

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt is an empty list; give a string, a list of strings or of token ids")
        return prompt

    def prompts(self) -> list[str | list[int]]:  # each a text or its token ids
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body (its add_special_tokens is accepted and moot: these tokenizers add none)."""

    prompt: str
    add_special_tokens: StrictBool = False


class DetokenizeRequest(BaseModel):
    tokens: list[StrictInt]


class PageText(BaseModel):
    """The live page's text, whose first prompt_chars characters are the prompt."""

    model_config = ConfigDict(extra="forbid")

    text: str
    prompt_chars: StrictInt = 0


class PageChange(PageText):
    """Replace the text's token `position` (of its last block_size) with `replacement`, one token's text."""

    position: StrictInt
    replacement: str


UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""),  # OpenAI fields not served: allowed only at no-op values
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {})}


class Service:
    """The model behind the API: checks requests and turns them into engine Jobs, one in the model at a time."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_id: str, limits: ServeConfig) -> None:
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.limits = limits  # serve.py's config, whose max_* keys and timeout_s bound each request
        self.created = int(time.time())
        self.turn = asyncio.Lock()  # the model's: first come first served (asyncio's locks are fair)
        self.waiting = 0  # requests waiting for the turn
        self.induction: Any = None  # the model's induction scores, for the live page (they don't depend on text)
        self.stop_by = math.inf  # on the event loop's clock: when requests still running end (Stopping)

    def check(self, request: CompletionRequest) -> list[list[int]]:
        """The prompts' tokens, after every range and limit check (ApiError naming the field and the key)."""
        limits = self.limits
        if request.model is not None and request.model != self.model_id:
            raise ApiError(404, f"model {request.model!r} does not exist; this server serves {self.model_id!r}",
                           "model", code="model_not_found")
        for name, allowed in UNSUPPORTED.items():
            value = (request.model_extra or {}).get(name)
            if value not in allowed:
                raise ApiError(400, f"{name}={value!r} is not supported by this server; leave it out", name)
        least = 0 if request.echo else 1  # echo with max_tokens=0: the prompt scored, nothing generated
        if request.max_tokens < least:
            raise ApiError(400, f"max_tokens={request.max_tokens} must be at least 1 (0 with echo=true)", "max_tokens")
        checks = [(request.logprobs is None or 0 <= request.logprobs <= MAX_LOGPROBS, "logprobs",
                   f"logprobs={request.logprobs} must be between 0 and {MAX_LOGPROBS}"),
                  (0 <= request.temperature <= 2, "temperature",
                   f"temperature={request.temperature} must be between 0 and 2 (0: greedy)"),
                  (0 < request.top_p <= 1, "top_p", f"top_p={request.top_p} must be in (0, 1]"),
                  (request.top_k is None or request.top_k >= 1, "top_k", f"top_k={request.top_k} must be at least 1"),
                  (request.min_p is None or 0 < request.min_p <= 1, "min_p",
                   f"min_p={request.min_p} must be in (0, 1]"),
                  (request.seed is None or 0 <= request.seed <= SEED_MAX, "seed",
                   f"seed={request.seed} must be between 0 and {SEED_MAX}"),
                  (request.n >= 1, "n", f"n={request.n} must be at least 1")]
        for ok, param, message in checks:
            if not ok:
                raise ApiError(400, message, param)
        prompts = request.prompts()
        choices = len(prompts) * request.n
        if choices > limits.max_choices:
            raise ApiError(400, f"n={request.n} for {len(prompts)} prompt(s) asks for {choices} choices; this server "
                           f"takes at most {limits.max_choices} a request (max_choices)", "n")
        if request.max_tokens * choices > limits.max_request_tokens:
            raise ApiError(400, f"max_tokens={request.max_tokens} for {choices} choice(s) asks for "
                           f"{request.max_tokens * choices} tokens; this server generates at most "
                           f"{limits.max_request_tokens} a request (max_request_tokens)", "max_tokens")
        given = request.stops()
        if any(s == "" for s in given):
            raise ApiError(400, "stop has an empty string, which would stop at once; remove it", "stop")
        if len(given) > MAX_STOPS or max(map(len, given), default=0) > MAX_STOP_CHARS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                           "stop")
        ids = [self._encode(prompt) for prompt in prompts]
        if sum(map(len, ids)) > limits.max_prompt_tokens:
            raise ApiError(400, f"the prompts have {sum(map(len, ids))} tokens; this server takes at most "
                           f"{limits.max_prompt_tokens} a request (max_prompt_tokens)", "prompt")
        return ids

    def _encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's tokens (a learned-position model sees the last block_size of them, as in sample.py)."""
        if not prompt:
            raise ApiError(400, "prompt is empty; give at least one character", "prompt")
        return self.encode(prompt) if isinstance(prompt, str) else self.known_ids(prompt, "prompt")

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

    def job(self, request: CompletionRequest, prompts: list[list[int]]) -> Job:
        """The request's work: one Choice per prompt x n, each with its own SampleText and, with seed, generator."""
        decoding = Decoding(request.temperature, request.top_k, None if request.top_p == 1 else request.top_p,
                            request.min_p)
        stops, end = request.stops(), self.tokenizer.end_of_text  # and the end of text, as sample.py's
        stops += [end] if end and end not in stops else []
        choices = [Choice(p * request.n + j, ids, SampleText(self.tokenizer, "", stops))
                   for p, ids in enumerate(prompts) for j in range(request.n)]
        generators = row_generators(request.seed, len(choices), self.engine.runtime.device)  # seed + index
        return Job(choices, request.n, request.max_tokens, decoding, generators, request.logprobs,
                   request.echo and request.logprobs is not None)

    def has_room(self) -> None:
        """503 when the model is busy and max_queue requests wait already (a stream asks before its first event)."""
        if self.waiting + self.turn.locked() > self.limits.max_queue:
            raise ApiError(503, f"the server is busy ({self.waiting} requests waiting, max_queue); retry shortly",
                           kind="server_busy", headers={"Retry-After": "1"})

    @contextlib.asynccontextmanager
    async def in_turn(self, deadline: Deadline) -> AsyncIterator[None]:
        """The model's turn, once the requests before this one are done; 503 if the queue is full, 504 if the turn
        comes too late."""
        self.has_room()
        self.waiting += 1  # on the event loop's thread only
        try:
            await asyncio.wait_for(self.turn.acquire(), deadline.left(time.monotonic()))
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11, two before
            deadline.left(time.monotonic())  # raises the ApiError that says why
            raise
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self.turn.release()

    async def run(self, work: Callable[[], Any]) -> Any:
        """work() on the engine's thread in its turn (the live page's model work): queued as a request is."""
        async with self.in_turn(Deadline(time.monotonic() + self.limits.timeout_s, lambda: self.stop_by)):
            return await asyncio.get_running_loop().run_in_executor(self.engine.thread, work)

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


@dataclasses.dataclass
class Deadline:
    """When a request must end, on time.monotonic's clock: its timeout_s, or the server's shutdown (stop_by)."""

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


@dataclasses.dataclass
class Reported:
    """What of a choice has been sent (a stream sends it a chunk at a time): the echo, then its tokens' logprobs."""

    choice: Choice
    echo: str  # echo=true: the prompt's text, sent before the generated text
    token_text: Callable[[int], str] | None  # logprobs asked for: a token's text
    tokens: int = 0  # generated tokens whose logprobs were sent
    prompt_sent: bool = False
    offset: int = 0  # characters of the text the sent tokens span (text_offset)

    def logprobs(self, upto: int) -> dict[str, list] | None:
        """OpenAI's logprobs object for the generated tokens not yet sent, up to the first `upto` (and the prompt's,
        with echo; its first token has no log-probability: nothing predicts it)."""
        if self.token_text is None:
            return None
        choice, pairs = self.choice, []
        if choice.prompt_scores is not None and not self.prompt_sent:
            pairs += zip(choice.prompt, [None, *choice.prompt_scores], strict=True)
            self.prompt_sent = True
        start, self.tokens = self.tokens, max(self.tokens, upto)
        pairs += zip(choice.tokens[start : self.tokens], choice.scores[start : self.tokens], strict=True)
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


def usage(job: Job) -> dict[str, int]:
    prompt = sum(len(c.prompt) for c in job.choices[:: job.n])  # each prompt once, however many choices it has
    completion = sum(len(c.tokens) for c in job.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def updates_of(service: Service, job: Job, deadline: Deadline,
                     http: Request | None = None) -> AsyncIterator[list[Update]]:
    """The job run in its turn, its updates in batches as they come; ApiError past the deadline or if it failed;
    it ends early if `http`'s client has left. Whatever ends it, the job is cancelled (a no-op once done)."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[list[Update]] = asyncio.Queue()
    job.on_update = lambda batch: loop.call_soon_threadsafe(updates.put_nowait, batch)
    try:
        async with service.in_turn(deadline):
            running = loop.run_in_executor(service.engine.thread, service.engine.run, job)
            pending, checked = len(job.choices), time.monotonic()
            while pending:
                try:
                    batch = await asyncio.wait_for(updates.get(), min(deadline.left(time.monotonic()), 0.5))
                except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11, two before
                    batch = []
                if http is not None and time.monotonic() - checked > 0.5:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return
                pending -= sum(done for _, _, done, _ in batch)
                if any(done and job.choices[i].finish_reason == "error" for i, _, done, _ in batch):
                    raise ApiError(500, "the model failed on this request; see the server's log", kind="server_error")
                if batch:
                    yield batch
            await running
    finally:
        job.cancelled = True


async def stream_events(service: Service, answer: Callable[..., dict], job: Job, reported: list[Reported],
                        deadline: Deadline, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunk objects as server-sent events, a choice's pieces that arrived together as one, then
    `data: [DONE]`. With include_usage, each chunk has "usage": null and a last one, with no choices, the usage."""
    no_usage = None if include_usage else ...
    try:
        async for batch in updates_of(service, job, deadline):
            merged: dict[int, tuple[str, bool, int]] = {}
            for index, piece, done, tokens in batch:
                text, was_done, most = merged.get(index, (reported[index].echo, False, 0))
                reported[index].echo = ""  # once, before the first piece
                merged[index] = (text + piece, was_done or done, max(most, tokens))
            for index, (text, done, tokens) in merged.items():
                choice = {"text": text, "index": index, "logprobs": reported[index].logprobs(tokens),
                          "finish_reason": job.choices[index].finish_reason if done else None}
                yield format_sse_event(data_str=json.dumps(answer([choice], no_usage)))
    except ApiError as err:
        yield format_sse_event(data_str=json.dumps(err.body()))
    if include_usage:
        yield format_sse_event(data_str=json.dumps(answer([], usage(job))))
    yield format_sse_event(data_str="[DONE]")


async def read_body(http: Request, schema: type[Body], max_bytes: int) -> Body:
    """The request's body, at most max_bytes (413: by its Content-Length, or as a chunked one adds up), parsed as
    `schema` (400 naming the field)."""
    too_large = ApiError(413, f"the body is larger than {max_bytes} bytes (max_body_bytes)")
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    try:
        async for chunk in http.stream():
            body += chunk
            if len(body) > max_bytes:
                raise too_large
    except ClientDisconnect:
        raise ApiError(400, "the client left before sending the whole body") from None
    try:
        return schema.model_validate_json(bytes(body))
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, "the body is not valid JSON") from None
        where = [str(part) for part in first["loc"]]
        value = f" (got {json.dumps(first['input'])[:80]})" if where else ""
        param = where[0] if where else None
        raise ApiError(400, f"{'.'.join(where) or 'body'}: {first['msg']}{value}", param) from None


def create_app(service: Service, api_key: str | None = None, on_ready: Callable[[], None] | None = None,
               hosts: list[str] | None = None) -> FastAPI:
    """The ASGI app. hosts: the Host header's names it answers (400 for others: Starlette's TrustedHostMiddleware),
    or any."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(service.engine.thread.shutdown, cancel_futures=True)

    app = FastAPI(title="gpt-lab", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    if hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)

    def key_given(credentials: HTTPAuthorizationCredentials | None) -> bool:
        """The header's bytes (HTTP hands them over as latin-1) against the key's UTF-8, in constant time."""
        given = b"" if credentials is None else credentials.credentials.encode("latin-1", "replace")
        return credentials is not None and secrets.compare_digest(given, api_key.encode("utf-8"))

    async def authorised(credentials: Credentials) -> None:
        if api_key is not None and not key_given(credentials):
            raise ApiError(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                           code="invalid_api_key")

    async def body(http: Request, schema: type[Body]) -> Body:
        return await read_body(http, schema, service.limits.max_body_bytes)

    _answer_errors(app)
    _add_page(app, service, authorised, body)
    _add_tokenizer(app, service, authorised, body)

    @app.get("/health")
    async def health(credentials: Credentials) -> dict[str, Any]:
        """Alive, for anyone (a load balancer's checks); the load too, with the key if one is set."""
        if api_key is not None and not key_given(credentials):
            return {"status": "ok"}
        return {"status": "ok", "model": service.model_id, "running": int(service.turn.locked()),
                "waiting": service.waiting, "finished": dict(service.engine.finished)}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, Any]:
        model = {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "gpt-lab"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(http: Request):
        request = await body(http, CompletionRequest)
        prompts = await asyncio.to_thread(service.check, request)  # tokenizing a long prompt: off the event loop
        job = service.job(request, prompts)
        token_text = service.token_text if request.logprobs is not None else None
        reported = [Reported(c, echo_text(service, request, c), token_text) for c in job.choices]
        answer_id = (f"cmpl-{secrets.token_hex(12)}", int(time.time()))
        deadline = Deadline(time.monotonic() + service.limits.timeout_s, lambda: service.stop_by)
        if request.stream:
            service.has_room()
            include_usage = bool((request.stream_options or {}).get("include_usage"))
            answer = functools.partial(service.answer, answer_id)
            return EventSourceResponse(stream_events(service, answer, job, reported, deadline, include_usage))
        async for _ in updates_of(service, job, deadline, http):
            pass
        choices = [{"text": r.echo + c.text.text, "index": c.index, "logprobs": r.logprobs(len(c.tokens)),
                 "finish_reason": c.finish_reason} for r, c in zip(reported, job.choices, strict=True)]
        return service.answer(answer_id, choices, usage(job))

    return app


def echo_text(service: Service, request: CompletionRequest, choice: Choice) -> str:
    """With echo, the prompt's text, which comes before the generated text."""
    return service.tokenizer.decode(choice.prompt) if request.echo else ""


def _add_tokenizer(app: FastAPI, service: Service, authorised: Callable[..., Any], body: Callable) -> None:
    """vLLM's tokenizer endpoints, which lm-evaluation-harness's local-completions uses by itself."""

    @app.get("/tokenizer_info", dependencies=[Depends(authorised)])
    async def tokenizer_info() -> dict[str, Any]:
        return {"eos_token": service.tokenizer.end_of_text, "bos_token": None, "pad_token": None,
                "model_max_length": service.block_size}

    @app.post("/tokenize", dependencies=[Depends(authorised)])
    async def tokenize(http: Request) -> dict[str, Any]:
        request = await body(http, TokenizeRequest)
        ids = await asyncio.to_thread(service.encode, request.prompt, True)
        return {"tokens": ids, "count": len(ids), "max_model_len": service.block_size}

    @app.post("/detokenize", dependencies=[Depends(authorised)])
    async def detokenize(http: Request) -> dict[str, str]:
        request = await body(http, DetokenizeRequest)
        ids = await asyncio.to_thread(service.known_ids, request.tokens)
        return {"prompt": await asyncio.to_thread(service.tokenizer.decode, ids)}


def _answer_errors(app: FastAPI) -> None:
    """Every error as OpenAI's error object: a refused request, an unknown endpoint, a bug."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:  # its traceback to the server's log only
        log.error(f"{request.method} {request.url.path} failed", exc_info=err)
        message = "the server failed on this request; its log has the details"
        return ApiError(500, message, kind="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.url.path}"}.get(err.status_code, str(err.detail))
        return ApiError(err.status_code, message, None).response()


def _add_page(app: FastAPI, service: Service, authorised: Callable[..., Any], body: Callable) -> None:
    """The live page at / and its endpoints under /page/: tokens, the attention explorer and the causal-mask demo,
    their model work in the model's turn, as a request's (the attention maps switch the layers to capturing)."""

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.post("/page/tokens", dependencies=[Depends(authorised)])
    async def page_tokens(http: Request) -> dict[str, Any]:
        text = await body(http, PageText)
        ids, n_prompt, note = await asyncio.to_thread(tokens_on_page, service, text)
        return {"tokens": [service.tokenizer.decode([i]) for i in ids], "prompt_tokens": n_prompt, "note": note}

    @app.post("/page/attention", dependencies=[Depends(authorised)], response_class=HTMLResponse)
    async def page_attention(http: Request) -> HTMLResponse:
        """The attention explorer's page (analysis/explorer.py) for the text on screen."""
        text = await body(http, PageText)
        ids, n_prompt, note = await asyncio.to_thread(tokens_on_page, service, text)
        tokens = [service.tokenizer.decode([i]) for i in ids]
        model = service.engine.model
        if service.induction is None:
            service.induction = await service.run(lambda: induction_scores(model))
        title = f"{service.model_id} (live)"
        render = functools.partial(live_page, model, ids, tokens, max(1, n_prompt), title, service.induction, note)
        return HTMLResponse(await service.run(render))

    @app.post("/page/causality", dependencies=[Depends(authorised)])
    async def page_causality(http: Request) -> dict[str, Any]:
        """Replace one token: how much every position's prediction changes, on both attention paths."""
        change = await body(http, PageChange)
        ids, replacement = await asyncio.to_thread(checked_change, service, change)
        report = await service.run(functools.partial(check_causality, service.engine.model, ids, change.position,
                                                     replacement))
        return {"tokens": [service.tokenizer.decode([i]) for i in ids], "position": change.position,
                "replacement": service.tokenizer.decode([replacement]),
                "changes": {impl: change.tolist() for impl, change in report.changes.items()},
                "receptive_field": report.receptive_field, "last_reachable": report.last_reachable,
                "mask_held": report.mask_held, "verdict": verdict(report)}


def tokens_on_page(service: Service, page: PageText) -> tuple[list[int], int, str | None]:
    """The text's last block_size tokens (all the page shows), how many are the prompt's, and a note if it was cut."""
    if not page.text:
        raise ApiError(400, "text is empty; generate something first", "text")
    prompt = page.text[: max(0, page.prompt_chars)]
    try:
        ids = service.tokenizer.encode(page.text)
        n_prompt = len(service.tokenizer.encode(prompt)) if prompt else 0
    except UserError as err:
        raise ApiError(400, f"text: {err}", "text") from None
    cut = max(0, len(ids) - service.block_size)
    note = (f"showing the last {service.block_size} of the text's {len(ids)} tokens: the model's context "
            f"(block_size={service.block_size})") if cut else None
    return ids[cut:], max(0, n_prompt - cut), note


def checked_change(service: Service, change: PageChange) -> tuple[list[int], int]:
    """The page's tokens and the one token that replaces token `position`, checked."""
    ids, _, _ = tokens_on_page(service, change)
    if not 0 <= change.position < len(ids):
        raise ApiError(400, f"position={change.position} is not a token of the text (0 to {len(ids) - 1})",
                       "position")
    try:
        replacement = service.tokenizer.encode(change.replacement)
    except UserError as err:
        raise ApiError(400, f"replacement: {err}", "replacement") from None
    if len(replacement) != 1:
        raise ApiError(400, f"replacement {change.replacement!r} is {len(replacement)} tokens; give one token's "
                       "text", "replacement")
    if replacement[0] == ids[change.position]:
        raise ApiError(400, f"replacement {change.replacement!r} is the token already there; give another",
                       "replacement")
    return ids, replacement[0]


def build_service(cfg: ServeConfig) -> Service:
    runtime = make_runtime(cfg.device, cfg.dtype)
    if runtime.device.type == "cpu":  # by default a core less, left to the event loop and the clients
        torch.set_num_threads(cfg.threads or default_num_proc())
    loaded = load_model(cfg.out_dir, cfg.init_from, cfg.ckpt, cfg.attn_impl)
    engine = Engine(loaded.model.to(runtime.device).eval(), runtime)
    model_id = cfg.model_id or (cfg.init_from if cfg.out_dir is None else Path(cfg.out_dir).resolve().name)
    return Service(engine, loaded.tokenizer, model_id, cfg)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY (no Nagle delay for each chunk) only on sockets naming it
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"host={host} is not an address of this machine ({err.strerror}); use 127.0.0.1 "
                              "(this machine only) or one of its network addresses") from None
        raise ConfigError(f"can't listen on host={host} port={port} ({err.strerror}); pick another port") from None
    sock.listen(2048)
    return sock


def check_exposure(sock: socket.socket, cfg: ServeConfig, api_key: str | None) -> str:
    """Where the server listens, in words; beyond loopback without an API key only with allow_no_api_key."""
    address = ipaddress.ip_address(sock.getsockname()[0])
    if address.is_loopback:
        return LOOPBACK
    where = "every interface" if address.is_unspecified else f"the network address {address}"
    if api_key is None and not cfg.allow_no_api_key:
        raise ConfigError(f"host={cfg.host} listens on {where} with no API key, so anyone who reaches the port "
                          f"can use the model; set api_key=KEY (or ${API_KEY_ENV}), or allow_no_api_key=true")
    return where


def serve(cfg: ServeConfig) -> None:
    """Until Ctrl-C or SIGTERM, then the requests in flight get shutdown_s to end (Stopping)."""
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    service = build_service(cfg)
    sock = bind(cfg.host, cfg.port)
    try:
        where = check_exposure(sock, cfg, api_key)
    except ConfigError:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    device = service.engine.runtime.device
    device = f"cpu ({torch.get_num_threads()} threads)" if device.type == "cpu" else device
    auth = "an API key" if api_key else "no API key"

    def ready() -> None:
        print(f"serving {service.model_id} on {device} at {url} (OpenAI API at {url}/v1, page at {url}/; "
              f"{where}, {auth}; Ctrl-C stops)", file=sys.stderr, flush=True)

    torch.set_grad_enabled(False)
    # a loopback server's Host names (an IPv6 address in brackets, as Host headers carry it): no DNS rebinding
    names = ["localhost", "127.0.0.1", "[::1]", f"[{cfg.host}]" if ":" in cfg.host else cfg.host]
    app = create_app(service, api_key, on_ready=ready, hosts=names if where == LOOPBACK else None)
    # uvicorn cancels what still runs SHUTDOWN_MARGIN_S after the requests' own end, which says so to each client
    config = uvicorn.Config(app, log_level=logging.WARNING, lifespan="on", ws="none",
                            limit_concurrency=cfg.max_connections,
                            timeout_graceful_shutdown=math.ceil(cfg.shutdown_s + SHUTDOWN_MARGIN_S))
    Stopping(config, service).run(sockets=[sock])


class Stopping(uvicorn.Server):
    """uvicorn's server that on Ctrl-C or SIGTERM gives requests in flight shutdown_s, then ends each with an error."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: Any) -> None:  # the event loop's thread (a signal handler)
        if self.service.stop_by == math.inf:
            self.service.stop_by = time.monotonic() + self.service.limits.shutdown_s
        super().handle_exit(sig, frame)
