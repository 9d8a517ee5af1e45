"""Tokens' log-probabilities as OpenAI's logprobs report them: the model's log-softmax, before temperature and the
cut-offs, with the likeliest alternatives; and a prompt's, scored as if the model had generated it (echo)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.runtime import Runtime
from model import GPT
from model.attention import KVCache
from model.gpt import PREFILL_CHUNK


@dataclass
class Scored:
    """A token's log-probability and the likeliest tokens' (id, log-probability) at its position, likeliest first."""

    logprob: float
    top: list[tuple[int, float]]


def score(logits: torch.Tensor, tokens: list[int], top: int) -> list[Scored]:
    """Each row's token's log-probability (before temperature and cut-offs), and the `top` likeliest tokens'."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [Scored(lp, list(zip(i, v, strict=True))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist(),
                                                                        strict=True)]


def prompt_scores(model: GPT, runtime: Runtime, prompt: list[int], top: int) -> Iterator[list[Scored]]:
    """Each prompt token's score but the first's, given up to block_size tokens before it (a rolling model: all), one
    forward pass an item (PREFILL_CHUNK tokens at most), so that the engine can decode between them."""
    config, device = model.config, runtime.device
    cache, block = KVCache(config), config.block_size
    first = len(prompt) if config.rolls else min(len(prompt), block)
    for start in range(0, first, PREFILL_CHUNK):  # the first window's tokens (a rolling model's: all)
        chunk = torch.tensor([prompt[start : min(first, start + PREFILL_CHUNK)]], device=device)
        with runtime.autocast():
            logits = model.logits(model.hidden(chunk, cache)[0])
        targets = prompt[start + 1 : start + 1 + chunk.size(1)]
        yield score(logits[: len(targets)], targets, top)
    at_once = max(1, PREFILL_CHUNK // block)  # windows a pass
    for start in range(block + 1, 0 if config.rolls else len(prompt), at_once):  # each from the block before it
        ends = range(start, min(start + at_once, len(prompt)))
        windows = torch.tensor([prompt[end - block : end] for end in ends], device=device)
        with runtime.autocast():
            logits = model.logits(model.hidden(windows)[:, -1, :])
        yield score(logits, [prompt[end] for end in ends], top)
