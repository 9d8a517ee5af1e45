"""The live page at / and its endpoints under /page/: tokens, the attention explorer, and the causal-mask demo. Their
model work runs on the engine's thread between steps (Service.call): attention maps switch the layers to capturing."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import HTMLResponse

from analysis.causality import check_causality, verdict
from analysis.diagnostics import induction_scores
from analysis.explorer import live_page
from common.errors import UserError
from inference.api import ApiError, PageChange, PageText

if TYPE_CHECKING:  # the server's Service, which imports this module
    from inference.server import Service

PAGE = Path(__file__).with_name("serve_page.html")


def add_page(app: FastAPI, service: Service, authorised: Callable[..., Any]) -> None:
    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.post("/page/tokens", dependencies=[Depends(authorised)])
    async def page_tokens(text: PageText) -> dict[str, Any]:
        ids, n_prompt, note = await asyncio.to_thread(tokens_on_page, service, text)
        return {"tokens": [service.tokenizer.decode([i]) for i in ids], "prompt_tokens": n_prompt, "note": note}

    @app.post("/page/attention", dependencies=[Depends(authorised)], response_class=HTMLResponse)
    async def page_attention(text: PageText) -> HTMLResponse:
        """The attention explorer's page (analysis/explorer.py) for the text on screen."""
        ids, n_prompt, note = await asyncio.to_thread(tokens_on_page, service, text)
        tokens = [service.tokenizer.decode([i]) for i in ids]
        engine = service.engine
        if service.induction is None:
            service.induction = await service.call(lambda: induction_scores(engine.model))
        title = f"{service.model_id} (live)"
        task = functools.partial(live_page, engine.model, ids, tokens, max(1, n_prompt), title, service.induction,
                                 note)
        return HTMLResponse(await service.call(task))

    @app.post("/page/causality", dependencies=[Depends(authorised)])
    async def page_causality(change: PageChange) -> dict[str, Any]:
        """Replace one token: how much every position's prediction changes, on both attention paths."""
        ids, replacement = await asyncio.to_thread(checked_change, service, change)
        report = await service.call(functools.partial(check_causality, service.engine.model, ids, change.position,
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
