"""Tokens' log-probabilities under the model, as OpenAI's logprobs report them: those of the model's own
distribution (its log-softmax), before temperature and the cut-offs, with the likeliest alternatives; and a
prompt's, scored as the model would have generated it (echo)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.runtime import Runtime
from model import GPT
from model.attention import KVCache
from model.gpt import PREFILL_CHUNK

WINDOWS_AT_ONCE = 16  # a prompt past a learned-position model's context: tokens scored per forward pass


@dataclass
class Scored:
    """A token's log-probability and the likeliest tokens' (id, log-probability) at its position, likeliest first."""

    logprob: float
    top: list[tuple[int, float]]


def score(logits: torch.Tensor, tokens: list[int], top: int) -> list[Scored]:
    """Each row's token's log-probability under the model (before temperature and the cut-offs, as OpenAI and
    vLLM report them), and the `top` likeliest tokens with theirs."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [Scored(lp, list(zip(i, v, strict=True))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist(),
                                                                        strict=True)]


def prompt_scores(model: GPT, runtime: Runtime, prompt: list[int], top: int,
                  cancelled: Callable[[], bool]) -> list[Scored]:
    """Each prompt token's score (but the first's) given the tokens before it, at most block_size of them for a
    learned-position model, all for a rolling one; PREFILL_CHUNK positions at a time, until cancelled()."""
    config, device = model.config, runtime.device
    scores: list[Scored] = []
    cache, block = KVCache(config), config.block_size
    first = len(prompt) if config.rolls else min(len(prompt), block)
    with runtime.autocast():
        for start in range(0, first, PREFILL_CHUNK):  # the first window's tokens (a rolling model's: all)
            chunk = torch.tensor([prompt[start : min(first, start + PREFILL_CHUNK)]], device=device)
            logits = model.logits(model.hidden(chunk, cache)[0])
            targets = prompt[start + 1 : start + 1 + chunk.size(1)]
            scores += score(logits[: len(targets)], targets, top)
        later = range(block + 1, len(prompt)) if not config.rolls else range(0)
        for start in later[::WINDOWS_AT_ONCE]:  # each later token from the block_size tokens before it
            if cancelled():  # (block_size forward passes per WINDOWS_AT_ONCE tokens: may be long)
                break
            ends = range(start, min(start + WINDOWS_AT_ONCE, len(prompt)))
            windows = torch.tensor([prompt[end - block : end] for end in ends], device=device)
            logits = model.logits(model.hidden(windows)[:, -1, :])
            scores += score(logits, [prompt[end] for end in ends], top)
    return scores
