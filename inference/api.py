"""The API's wire format: OpenAI's error object, request bodies (pydantic-checked first), body and Host guards."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a JSON number, not "0.5"


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


class BodyLimit:
    """413 with OpenAI's error object for a body over max_bytes, by its Content-Length or as its chunks add up."""

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


class HostCheck:
    """421 (OpenAI's error object) for a Host naming another server: stops DNS-rebinding pages reading the answers."""

    def __init__(self, app: ASGIApp, names: set[str]) -> None:
        self.app, self.names = app, {name.lower() for name in names}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = Headers(scope=scope).get("host", "").lower() if scope["type"] == "http" else ""
        name = host[: host.find("]") + 1] if host.startswith("[") else host.split(":")[0]
        if host and name not in self.names:
            refused = ApiError(421, f"the Host header {host[:100]!r} is not this server's; use "
                               f"http://127.0.0.1:PORT (or localhost)", code="misdirected_request")
            return await refused.response()(scope, receive, send)
        await self.app(scope, receive, send)
