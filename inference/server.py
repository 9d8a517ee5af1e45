"""serve.py's work: OpenAI's completions API, vLLM's tokenizer endpoints and the live page, on uvicorn. Each request
is checked and bounded first; the requests under way (max_queue besides the first) then take turns on the model, a
slice of SLICE_S each, first come first served, so that a short request never waits for a long one to end."""

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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import torch
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from analysis.causality import check_causality, verdict
from analysis.diagnostics import induction_scores
from analysis.explorer import live_page
from common.config import SEED_MAX
from common.errors import ConfigError, UserError
from common.runtime import make_runtime
from data.corpus import default_num_proc
from data.tokenizers import Tokenizer
from inference.engine import Choice, Engine, Job, Update
from inference.sampling import SampleText, load_model
from model.gpt import Decoding, row_generators

if TYPE_CHECKING:  # serve.py's schema, for annotations
    from serve import ServeConfig

MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's limits
SLICE_S = 0.02  # a request's turn on the model: this long, or one forward pass if longer; then the next request's
SEND_GRACE_S = 1.0  # past timeout_s, a stream's last events get this long to be sent; then its connection is closed
API_KEY_ENV = "GPT_LAB_API_KEY"  # the api_key when the config leaves it null, so it needn't be on a command line
PAGE = Path(__file__).with_name("serve_page.html")
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a JSON number, not "0.5"
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]
Body = TypeVar("Body", bound=BaseModel)
log = logging.getLogger("serve")
# OpenAI's fields that are not served, allowed only at their no-op values
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {})}


class ApiError(Exception):
    """A request the server refuses: its status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


class CompletionRequest(BaseModel):
    """OpenAI's /v1/completions fields, plus vLLM's top_k and min_p; other fields only at no-op values."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # a text, texts, token ids, or lists of ids
    max_tokens: StrictInt = 16  # 0 with echo: score the prompt alone
    temperature: Number = Field(1.0, ge=0, le=2)  # 0: greedy
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=1)
    min_p: Number | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    n: StrictInt = Field(1, ge=1)
    seed: StrictInt | None = Field(None, ge=0, le=SEED_MAX)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=5)  # each token's log-probability and this many likeliest others'
    echo: StrictBool = False  # the prompt's text (and its tokens' logprobs) before the generated text


class TokenizeRequest(BaseModel):  # vLLM's add_special_tokens is ignored: these tokenizers add none
    prompt: str


class DetokenizeRequest(BaseModel):
    tokens: list[StrictInt]


class PageText(BaseModel):  # the live page's text
    text: str
    prompt_chars: StrictInt = 0  # its first prompt_chars characters are the prompt


class PageChange(PageText):  # replace the text's token `position` (of its last block_size) with `replacement`
    position: StrictInt
    replacement: str


class Service:
    """The model behind the API: it checks requests, turns them into engine Jobs and gives each its turn."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_id: str, limits: ServeConfig) -> None:
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.limits = limits  # serve.py's config, whose max_* keys and timeout_s bound each request
        self.created = int(time.time())
        self.turn = asyncio.Lock()  # the model's, a slice at a time: first come first served (asyncio's locks are fair)
        self.requests = 0  # requests under way, which take turns on the model
        self.induction: Any = None  # the model's induction scores for the live page, which no text changes
        self.stop_by = math.inf  # on time.monotonic's clock: when requests still running end (Server.handle_exit)

    def job(self, request: CompletionRequest) -> Job:
        """The request's work, once every range and bound holds (else an ApiError naming the field and the key): one
        Choice per prompt x n, each with its own SampleText and, with a seed, generator (seed + its index)."""
        limits, r = self.limits, request
        if r.model is not None and r.model != self.model_id:
            raise ApiError(404, f"model {r.model!r} does not exist; this server serves {self.model_id!r}", "model",
                           code="model_not_found")
        for name, allowed in UNSUPPORTED.items():
            if (value := (r.model_extra or {}).get(name)) not in allowed:
                raise ApiError(400, f"{name}={value!r} is not supported by this server; leave it out", name)
        prompts = [r.prompt] if isinstance(r.prompt, str) or all(isinstance(p, int) for p in r.prompt) else r.prompt
        choices, stops = len(prompts) * r.n, [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
        checks = [
            (r.max_tokens >= (0 if r.echo else 1), "max_tokens",
             f"max_tokens={r.max_tokens} must be at least 1 (0 with echo=true)"),
            (choices <= limits.max_choices, "n", f"n={r.n} for {len(prompts)} prompt(s) asks for {choices} choices; "
             f"this server takes at most {limits.max_choices} a request (max_choices)"),
            (r.max_tokens * choices <= limits.max_request_tokens, "max_tokens",
             f"max_tokens={r.max_tokens} for {choices} choice(s) asks for {r.max_tokens * choices} tokens; this "
             f"server generates at most {limits.max_request_tokens} a request (max_request_tokens)"),
            ("" not in stops, "stop", "stop has an empty string, which would stop at once; remove it"),
            (len(stops) <= MAX_STOPS and max(map(len, stops), default=0) <= MAX_STOP_CHARS, "stop",
             f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters"),
            (all(prompts), "prompt", "prompt is empty; give at least one character or token id"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise ApiError(400, message, param)
        # a learned-position model sees the last block_size of a prompt's tokens, as in sample.py
        ids = [self.encode(p) if isinstance(p, str) else self.known_ids(p, "prompt") for p in prompts]
        if sum(map(len, ids)) > limits.max_prompt_tokens:
            raise ApiError(400, f"the prompts have {sum(map(len, ids))} tokens; this server takes at most "
                           f"{limits.max_prompt_tokens} a request (max_prompt_tokens)", "prompt")
        decoding = Decoding(r.temperature, r.top_k, r.top_p, r.min_p)
        end = self.tokenizer.end_of_text  # a stop too, as in sample.py
        texts = stops + ([end] if end and end not in stops else [])
        choices = [Choice(p * r.n + j, prompt, SampleText(self.tokenizer, "", texts))
                   for p, prompt in enumerate(ids) for j in range(r.n)]
        generators = row_generators(r.seed, len(choices), self.engine.runtime.device)
        return Job(choices, r.n, r.max_tokens, decoding, generators, r.logprobs, r.echo and r.logprobs is not None)

    def encode(self, text: str, end_of_text: bool = False, param: str = "prompt") -> list[int]:
        """Its tokens, as sample.py's prompts (a 400 naming `param` for a character a char-level model has never
        seen); end_of_text: its end-of-text marks as that token (vLLM's /tokenize)."""
        end = self.tokenizer.end_of_text if end_of_text else None
        try:
            parts = [self.tokenizer.encode(part) for part in (text.split(end) if end else [text])]
        except UserError as err:
            raise ApiError(400, f"{param}: {err}", param) from None
        return [i for n, part in enumerate(parts) for i in ([self.tokenizer.end_of_text_id] if n else []) + part]

    def known_ids(self, ids: list[int], param: str = "tokens") -> list[int]:
        unknown = [i for i in ids if self.token_text(i) is None]
        if unknown:
            raise ApiError(400, f"{param}: token id {unknown[0]} is not in this model's vocabulary (0 to "
                           f"{self.tokenizer.vocab_size - 1}, less the ids its encoding leaves unused)", param)
        return list(ids)

    def token_text(self, token: int) -> str | None:
        """A token's text; None for an id with none (the model's padded vocabulary, an encoding's unused ids)."""
        try:
            return self.tokenizer.decode([token]) if 0 <= token < self.tokenizer.vocab_size else None
        except KeyError:  # tiktoken's encodings with gaps (cl100k_base)
            return None

    def has_room(self) -> None:
        """503 when 1 + max_queue requests are under way already (a stream asks before its first event)."""
        if self.requests > self.limits.max_queue:
            raise ApiError(503, f"the server is busy ({self.requests} requests under way, max_queue); retry shortly",
                           kind="server_busy", headers={"Retry-After": "1"})

    def left(self, timeout_at: float) -> float:
        """Seconds a request has left until its timeout_s or the server's shutdown; an ApiError once none are."""
        now = time.monotonic()
        if now >= self.stop_by:
            raise ApiError(503, "the server is shutting down (shutdown_s passed); retry the request later",
                           kind="server_unavailable")
        if now >= timeout_at:
            raise ApiError(504, "the request took longer than the server's timeout_s; ask for fewer tokens",
                           kind="timeout")
        return min(timeout_at, self.stop_by) - now

    @contextlib.contextmanager
    def under_way(self) -> Iterator[None]:
        """A request's place among those under way: 503 once 1 + max_queue have theirs."""
        self.has_room()
        self.requests += 1
        try:
            yield
        finally:
            self.requests -= 1

    @contextlib.asynccontextmanager
    async def in_turn(self, timeout_at: float) -> AsyncIterator[None]:
        """The model for a slice, once the requests that asked before this one have had theirs; 504 if too late."""
        left = self.left(timeout_at)  # before acquire() makes a coroutine that a late request would leave unawaited
        try:
            await asyncio.wait_for(self.turn.acquire(), left)
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11, two before
            self.left(timeout_at)  # raises the ApiError that says why
            raise
        try:
            yield
        finally:
            self.turn.release()

    async def body(self, http: Request, schema: type[Body]) -> Body:
        """The body, at most max_body_bytes by its Content-Length (which h11 holds it to), parsed as `schema`."""
        length, max_bytes = http.headers.get("content-length", ""), self.limits.max_body_bytes
        if not length.isdigit():  # every client sends it with a JSON body; a chunked one could grow without a bound
            raise ApiError(411, "send the body with a Content-Length header")
        if int(length) > max_bytes:
            raise ApiError(413, f"the body is larger than {max_bytes} bytes (max_body_bytes)")
        try:
            return schema.model_validate_json(await http.body())
        except ClientDisconnect:
            raise ApiError(400, "the client left before sending the whole body") from None
        except ValidationError as err:
            first = err.errors()[0]
            if first["type"] == "json_invalid":
                raise ApiError(400, "the body is not valid JSON") from None
            where = [str(part) for part in first["loc"]]
            value = f" (got {json.dumps(first['input'])[:80]})" if where else ""
            param = where[0] if where else None
            raise ApiError(400, f"{'.'.join(where) or 'body'}: {first['msg']}{value}", param) from None

    async def run(self, work: Callable[[], Any]) -> Any:
        """work() on the engine's thread in one turn (the live page's model work), as a request's slice."""
        with self.under_way():
            async with self.in_turn(time.monotonic() + self.limits.timeout_s):
                return await asyncio.get_running_loop().run_in_executor(self.engine.thread, work)


@dataclasses.dataclass
class Reported:
    """What of a choice has been sent (a stream sends it a chunk at a time): the echo, then its tokens' logprobs."""

    choice: Choice
    echo: str  # echo=true: the prompt's text, sent before the generated text
    token_text: Callable[[int], str | None] | None  # when logprobs are asked for: a token's text
    tokens: int = 0  # generated tokens whose logprobs were sent
    offset: int = 0  # characters of the text the sent tokens span (text_offset): 0 until the first are sent

    def chunk(self, text: str, tokens: int, finish_reason: str | None) -> dict[str, Any]:
        """The choice's next piece of text (the echo before the first) as OpenAI's choice object."""
        choice = {"text": self.echo + text, "index": self.choice.index, "logprobs": self.logprobs(tokens),
                  "finish_reason": finish_reason}
        self.echo = ""
        return choice

    def logprobs(self, upto: int) -> dict[str, list] | None:
        """OpenAI's logprobs object for the tokens not sent yet, up to generated token `upto` (the prompt's first)."""
        if self.token_text is None:
            return None
        choice, pairs = self.choice, []
        if choice.prompt_scores is not None and self.offset == 0:
            pairs += zip(choice.prompt, [None, *choice.prompt_scores], strict=True)
        start, self.tokens = self.tokens, max(self.tokens, upto)
        pairs += zip(choice.tokens[start : self.tokens], choice.scores[start : self.tokens], strict=True)
        body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, scored in pairs:
            text = self.token_text(token) or ""
            top = None if scored is None else {}
            for t, p in [] if scored is None else scored.top:  # likeliest first: tokens of one text keep the first
                top.setdefault(self.token_text(t) or "", p)
            for key, value in zip(body, (text, scored and scored.logprob, top, self.offset), strict=True):
                body[key].append(value)
            self.offset += len(text)
        return body


def usage(job: Job) -> dict[str, int]:
    prompt = sum(len(c.prompt) for c in job.choices[:: job.n])  # each prompt once, however many choices it has
    completion = sum(len(c.tokens) for c in job.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def updates_of(service: Service, job: Job, timeout_at: float,
                     http: Request | None = None) -> AsyncIterator[list[Update]]:
    """The job run a slice at a time in turn with the other requests under way, its updates after each slice;
    ApiError past its time or if the model failed; it ends early once `http`'s client has left. The model is free
    while a slice's updates are sent. However it ends (a stream's client that leaves or stops reading, too), its steps
    are closed on the engine's thread after any slice still running: the choices not done end as cancelled."""
    loop, engine = asyncio.get_running_loop(), service.engine
    steps, done = engine.steps(job), False
    try:
        with service.under_way():
            while not done:
                async with service.in_turn(timeout_at):
                    batch, done = await loop.run_in_executor(engine.thread, engine.advance, steps, SLICE_S)
                if any(ended and job.choices[i].finish_reason == "error" for i, _, ended, _ in batch):
                    raise ApiError(500, "the model failed on this request; see the server's log", kind="server_error")
                if batch:
                    yield batch
                if http is not None and await http.is_disconnected():
                    return
    finally:
        with contextlib.suppress(RuntimeError):  # the engine's thread is shut down: nothing runs the steps any more
            engine.thread.submit(steps.close)


class Events(EventSourceResponse):
    """Server-sent events, each of which the client must take by `send_by` (on time.monotonic's clock): a client that
    stops reading holds its request no longer. However the response ends, its events are closed, which ends the job."""

    def __init__(self, events: AsyncGenerator[bytes, None], send_by: float) -> None:
        super().__init__(events)
        self.events, self.send_by = events, send_by

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_in_time(message: dict[str, Any]) -> None:
            await asyncio.wait_for(send(message), max(0.0, self.send_by - time.monotonic()))

        try:
            await super().__call__(scope, receive, send_in_time)
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11, two before
            log.error("a stream's client stopped reading: its request ended at timeout_s, its connection is closed")
        finally:
            await self.events.aclose()


async def stream_events(service: Service, head: dict[str, Any], job: Job, reported: list[Reported],
                        timeout_at: float, include_usage: bool) -> AsyncGenerator[bytes, None]:
    """OpenAI's chunks as server-sent events, one per choice per model step (an engine batch names a choice once),
    then `data: [DONE]`. With include_usage each chunk has "usage": null, and a last one without choices the usage."""
    extra = {"usage": None} if include_usage else {}
    try:
        async with contextlib.aclosing(updates_of(service, job, timeout_at)) as updates:  # closed with the stream
            async for batch in updates:
                for index, piece, done, tokens in batch:
                    choice = reported[index].chunk(piece, tokens, job.choices[index].finish_reason if done else None)
                    yield format_sse_event(data_str=json.dumps({**head, "choices": [choice], **extra}))
    except ApiError as err:
        yield format_sse_event(data_str=json.dumps(err.body))
    if include_usage:
        yield format_sse_event(data_str=json.dumps({**head, "choices": [], "usage": usage(job)}))
    yield format_sse_event(data_str="[DONE]")


def create_app(service: Service, api_key: str | None, banner: str, hosts: list[str] | None) -> FastAPI:
    """The ASGI app, which prints the banner once it listens; hosts: the only Host header names it answers, or any."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        print(banner, file=sys.stderr, flush=True)
        yield
        await asyncio.to_thread(service.engine.thread.shutdown, cancel_futures=True)

    app = FastAPI(title="gpt-lab", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    if hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)

    def key_given(credentials: HTTPAuthorizationCredentials | None) -> bool:
        """No key is set, or the header's bytes (HTTP hands them over as latin-1) equal its UTF-8, in constant time."""
        given = b"" if credentials is None else credentials.credentials.encode("latin-1", "replace")
        return api_key is None or secrets.compare_digest(given, api_key.encode("utf-8"))  # b"" never equals a key

    async def authorised(credentials: Credentials) -> None:
        if not key_given(credentials):
            raise ApiError(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                           code="invalid_api_key")

    # errors as OpenAI's error object: a refused request, an unknown endpoint (a bug stays Starlette's 500)
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body, status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.url.path}"}.get(err.status_code, str(err.detail))
        return await api_error(request, ApiError(err.status_code, message))

    @app.get("/health")
    async def health(credentials: Credentials) -> dict[str, Any]:
        """Alive, for anyone (a load balancer's checks); the load too, with the key if one is set."""
        if not key_given(credentials):
            return {"status": "ok"}
        return {"status": "ok", "model": service.model_id, "running": service.requests,
                "finished": dict(service.engine.finished)}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, Any]:
        model = {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "gpt-lab"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(http: Request):
        request = await service.body(http, CompletionRequest)
        job = await asyncio.to_thread(service.job, request)  # tokenizing a long prompt: off the event loop
        token_text = service.token_text if request.logprobs is not None else None
        reported = [Reported(c, service.tokenizer.decode(c.prompt) if request.echo else "", token_text)
                    for c in job.choices]
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": service.model_id}  # one for the whole stream
        timeout_at = time.monotonic() + service.limits.timeout_s
        if request.stream:
            service.has_room()
            include_usage = bool((request.stream_options or {}).get("include_usage"))
            events = stream_events(service, head, job, reported, timeout_at, include_usage)
            return Events(events, timeout_at + SEND_GRACE_S)
        async for _ in updates_of(service, job, timeout_at, http):
            pass
        choices = [r.chunk(r.choice.text.text, len(r.choice.tokens), r.choice.finish_reason) for r in reported]
        return {**head, "choices": choices, "usage": usage(job)}

    add_tokenizer_and_page(app, service, authorised)
    return app


def add_tokenizer_and_page(app: FastAPI, service: Service, authorised: Callable[..., Any]) -> None:
    """vLLM's tokenizer endpoints, and the live page with its endpoints."""
    model, block_size = service.engine.model, service.engine.model.config.block_size

    # vLLM's tokenizer endpoints, which lm-evaluation-harness's local-completions uses by itself
    @app.get("/tokenizer_info", dependencies=[Depends(authorised)])
    async def tokenizer_info() -> dict[str, Any]:
        return {"eos_token": service.tokenizer.end_of_text, "bos_token": None, "pad_token": None,
                "model_max_length": block_size}

    @app.post("/tokenize", dependencies=[Depends(authorised)])
    async def tokenize(http: Request) -> dict[str, Any]:
        ids = await asyncio.to_thread(service.encode, (await service.body(http, TokenizeRequest)).prompt, True)
        return {"tokens": ids, "count": len(ids), "max_model_len": block_size}

    @app.post("/detokenize", dependencies=[Depends(authorised)])
    async def detokenize(http: Request) -> dict[str, str]:
        ids = await asyncio.to_thread(service.known_ids, (await service.body(http, DetokenizeRequest)).tokens)
        return {"prompt": await asyncio.to_thread(service.tokenizer.decode, ids)}

    # the live page and its endpoints, whose model work takes its turn as a request does
    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.post("/page/tokens", dependencies=[Depends(authorised)])
    async def page_tokens(http: Request) -> dict[str, Any]:
        _, tokens, n_prompt, note = await asyncio.to_thread(tokens_on_page, service, await service.body(http, PageText))
        return {"tokens": tokens, "prompt_tokens": n_prompt, "note": note}

    @app.post("/page/attention", dependencies=[Depends(authorised)], response_class=HTMLResponse)
    async def page_attention(http: Request) -> HTMLResponse:
        """The attention explorer's page (analysis/explorer.py) for the text on screen (the layers capture the maps)."""
        page = await service.body(http, PageText)
        ids, tokens, n_prompt, note = await asyncio.to_thread(tokens_on_page, service, page)
        if service.induction is None:
            service.induction = await service.run(lambda: induction_scores(model))
        title = f"{service.model_id} (live)"
        render = functools.partial(live_page, model, ids, tokens, max(1, n_prompt), title, service.induction, note)
        return HTMLResponse(await service.run(render))

    @app.post("/page/causality", dependencies=[Depends(authorised)])
    async def page_causality(http: Request) -> dict[str, Any]:
        """Replace one token with another: how much every position's prediction changes, on both attention paths."""
        change = await service.body(http, PageChange)
        ids, tokens, _, _ = await asyncio.to_thread(tokens_on_page, service, change)
        if not 0 <= change.position < len(ids):
            raise ApiError(400, f"position={change.position} is not a token of the text (0 to {len(ids) - 1})",
                           "position")
        replacement = service.encode(change.replacement, param="replacement")
        if len(replacement) != 1:
            raise ApiError(400, f"replacement {change.replacement!r} is {len(replacement)} tokens; give one token's "
                           "text", "replacement")
        if replacement[0] == ids[change.position]:
            raise ApiError(400, f"replacement {change.replacement!r} is the token already there; give another",
                           "replacement")
        report = await service.run(functools.partial(check_causality, model, ids, change.position, replacement[0]))
        return {"tokens": tokens, "position": change.position, "replacement": service.tokenizer.decode(replacement),
                "changes": {impl: change.tolist() for impl, change in report.changes.items()},
                "receptive_field": report.receptive_field, "last_reachable": report.last_reachable,
                "mask_held": report.mask_held, "verdict": verdict(report)}


def tokens_on_page(service: Service, page: PageText) -> tuple[list[int], list[str], int, str | None]:
    """The text's last block_size tokens (all the page shows), their texts, the prompt's count, and a note if cut."""
    if not page.text:
        raise ApiError(400, "text is empty; generate something first", "text")
    block_size = service.engine.model.config.block_size
    ids, prompt = service.encode(page.text, param="text"), page.text[: max(0, page.prompt_chars)]
    n_prompt = len(service.encode(prompt, param="text")) if prompt else 0
    cut = max(0, len(ids) - block_size)
    note = (f"showing the last {block_size} of the text's {len(ids)} tokens: the model's context "
            f"(block_size={block_size})") if cut else None
    return ids[cut:], [service.tokenizer.decode([i]) for i in ids[cut:]], max(0, n_prompt - cut), note


def bind(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY (no Nagle delay for each chunk) only on sockets naming it
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def serve(cfg: ServeConfig) -> None:
    """Until Ctrl-C or SIGTERM; then the requests in flight get shutdown_s to end (Server)."""
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    runtime = make_runtime(cfg.device, cfg.dtype)
    if runtime.device.type == "cpu":  # by default a core less, left to the event loop and the clients
        torch.set_num_threads(cfg.threads or default_num_proc())
    loaded = load_model(cfg.out_dir, cfg.init_from, cfg.ckpt, cfg.attn_impl)
    model_id = cfg.model_id or (cfg.init_from if cfg.out_dir is None else Path(cfg.out_dir).resolve().name)
    service = Service(Engine(loaded.model.to(runtime.device).eval(), runtime), loaded.tokenizer, model_id, cfg)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    address = ipaddress.ip_address(host)
    where = "this machine only" if address.is_loopback else "every interface" if address.is_unspecified else (
        f"the network address {address}")
    if not address.is_loopback and api_key is None and not cfg.allow_no_api_key:
        sock.close()
        raise ConfigError(f"host={cfg.host} listens on {where} with no API key, so anyone who reaches the port "
                          f"can use the model; set api_key=KEY (or ${API_KEY_ENV}), or allow_no_api_key=true")
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    device = f"cpu ({torch.get_num_threads()} threads)" if runtime.device.type == "cpu" else runtime.device
    banner = (f"serving {model_id} on {device} at {url} (OpenAI API at {url}/v1, page at {url}/; {where}, "
              f"{'an' if api_key else 'no'} API key; Ctrl-C stops)")
    # a loopback server answers only its own names (an IPv6 address in brackets, as Host carries it): no DNS rebinding
    names = ["localhost", "127.0.0.1", "[::1]", f"[{cfg.host}]" if ":" in cfg.host else cfg.host]
    app = create_app(service, api_key, banner, names if address.is_loopback else None)
    # uvicorn cancels what still runs a second after the requests' own end, which tells each client so
    server = Server(app, service, log_level=logging.WARNING, lifespan="on", ws="none", timeout_keep_alive=5,
                    timeout_graceful_shutdown=math.ceil(cfg.shutdown_s + 1))
    server.run(sockets=[sock])


class Server(uvicorn.Server):
    """uvicorn's server that answers past max_connections with OpenAI's error object (uvicorn's limit_concurrency
    answers in plain text), and on Ctrl-C or SIGTERM gives requests in flight shutdown_s, then ends each with one."""

    def __init__(self, app: FastAPI, service: Service, **settings: Any) -> None:
        self.service = service

        async def admit(scope: Scope, receive: Receive, send: Send) -> None:
            """The app, unless more than max_connections connections or requests are open, this one's among them."""
            limit, state = service.limits.max_connections, self.server_state
            if scope["type"] == "http" and max(len(state.connections), len(state.tasks)) > limit:
                error = ApiError(503, f"the server has {limit} connections or requests open (max_connections); retry "
                                 "shortly", kind="server_busy", headers={"Retry-After": "1", "Connection": "close"})
                await JSONResponse(error.body, error.status, error.headers)(scope, receive, send)
            else:
                await app(scope, receive, send)

        super().__init__(uvicorn.Config(admit, **settings))

    def handle_exit(self, sig: int, frame: Any) -> None:  # the event loop's thread (a signal handler)
        self.service.stop_by = min(self.service.stop_by, time.monotonic() + self.service.limits.shutdown_s)
        super().handle_exit(sig, frame)
