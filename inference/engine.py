"""The server's model work, one request at a time: a prompt's n choices decode as one batch through
model/gpt.py's generate_tokens (its KVCache), exactly as sample.py draws its samples; several prompts run one after
another. With logprobs each token comes scored (Scored); with echo the prompts are scored too, those within the
context together, right-padded, in one forward pass."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from common.runtime import Runtime
from inference.sampling import SampleText
from model import GPT
from model.attention import KVCache
from model.gpt import PREFILL_CHUNK, Decoding

log = logging.getLogger("serve")


@dataclass
class Scored:
    """A token's log-probability and the likeliest tokens' (id, log-probability) at its position, likeliest first."""

    logprob: float
    top: list[tuple[int, float]]


def score(logits: Tensor, tokens: list[int], top: int) -> list[Scored]:
    """Each row's token's log-probability (the model's, before temperature and cut-offs), and the `top` likeliest."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [Scored(lp, list(zip(i, v, strict=True))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist(),
                                                                        strict=True)]


def prompt_scores(model: GPT, prompts: list[list[int]], top: int) -> list[list[Scored]]:
    """Each prompt token's score but the first's, from up to block_size tokens before it (a rolling model: all), as
    if the model had generated it. Prompts within block_size run together, right-padded (a causal model's earlier
    positions never see the padding), PREFILL_CHUNK positions a forward pass; a longer one on its own."""
    block = model.config.block_size
    scores: list[list[Scored]] = [[] for _ in prompts]
    short = sorted((i for i, p in enumerate(prompts) if len(p) <= block), key=lambda i: -len(prompts[i]))
    while short:
        width = len(prompts[short[0]])  # the longest left
        rows = short[: max(1, PREFILL_CHUNK // width)]
        idx = torch.tensor([prompts[i] + [0] * (width - len(prompts[i])) for i in rows], device=_device(model))
        logits = model.logits(model.hidden(idx))
        for row, i in enumerate(rows):
            scores[i] = score(logits[row, : len(prompts[i]) - 1], prompts[i][1:], top)
        short = short[len(rows) :]
    for i in (i for i, p in enumerate(prompts) if len(p) > block):
        scores[i] = _long_prompt_scores(model, prompts[i], top)
    return scores


def _long_prompt_scores(model: GPT, prompt: list[int], top: int) -> list[Scored]:
    """A rolling model's prompt through the cache, PREFILL_CHUNK tokens at a time; a learned-position model's first
    block_size tokens in one pass, then each later token from the block_size before it, many windows a pass."""
    config, device, scores = model.config, _device(model), []
    cache, block = KVCache(config), config.block_size
    first = len(prompt) if config.rolls else block
    for start in range(0, first, PREFILL_CHUNK):
        chunk = torch.tensor([prompt[start : min(first, start + PREFILL_CHUNK)]], device=device)
        logits = model.logits(model.hidden(chunk, cache)[0])
        targets = prompt[start + 1 : start + 1 + chunk.size(1)]
        scores += score(logits[: len(targets)], targets, top)
    at_once = max(1, PREFILL_CHUNK // block)
    for start in range(block + 1, 0 if config.rolls else len(prompt), at_once):
        ends = range(start, min(start + at_once, len(prompt)))
        windows = torch.tensor([prompt[end - block : end] for end in ends], device=device)
        scores += score(model.logits(model.hidden(windows)[:, -1, :]), [prompt[end] for end in ends], top)
    return scores


def _device(model: GPT) -> torch.device:
    return next(model.parameters()).device


@dataclass(frozen=True)
class ScoredDecoding(Decoding):
    """Decoding that keeps the logits it was given (the model's, before temperature and cut-offs): logprobs."""

    seen: list[Tensor] = field(default_factory=list, compare=False)

    def next_token(self, logits: Tensor, generators: list[torch.Generator] | None = None) -> Tensor:
        self.seen[:] = [logits]
        return super().next_token(logits, generators)


@dataclass(eq=False)
class Choice:
    """One choice of a request: its prompt, its text (stop strings as in sample.py), and what it has generated."""

    index: int
    prompt: list[int]
    text: SampleText
    tokens: list[int] = field(default_factory=list)
    scores: list[Scored] = field(default_factory=list)  # with logprobs: one per generated token
    prompt_scores: list[Scored] | None = None  # with echo and logprobs: one per prompt token but the first
    finish_reason: str | None = None  # "stop" (a stop string, the end of text), "length", "cancelled" or "error"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


Update = tuple[int, str, bool, int]  # choice index, a piece of text, done, its token count when it came


@dataclass(eq=False)
class Job:
    """One request's work: its choices (prompt-major: prompt p's are p*n .. p*n + n - 1), how they decode, and
    on_update(updates), called after each step on the engine's thread with each piece of text no later token can
    change (a choice's last with done=True)."""

    choices: list[Choice]
    n: int
    max_new_tokens: int  # 0: echo alone, nothing generated
    decoding: Decoding
    generators: list[torch.Generator] | None  # one per choice (seed + index), or torch's global one
    logprobs: int | None  # report each token's log-probability and this many likeliest alternatives (0-5)
    score_prompts: bool  # echo with logprobs
    on_update: Callable[[list[Update]], None] = lambda updates: None
    cancelled: bool = False  # set from any thread (a client left, a timeout): the job ends at its next step


class Engine:
    """The model, run on one thread (`thread`, where torch keeps serve.py's thread count) one job at a time."""

    def __init__(self, model: GPT, runtime: Runtime) -> None:
        self.model, self.runtime = model, runtime
        self.thread = ThreadPoolExecutor(1, "engine", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))
        self.finished: Counter[str] = Counter()  # choices ended, by finish_reason (GET /health shows them)

    @torch.inference_mode()
    def run(self, job: Job) -> None:
        """The job's prompts scored (echo with logprobs), then each prompt's n choices generated as one batch."""
        try:
            with self.runtime.autocast():
                if job.score_prompts:
                    prompts = [choice.prompt for choice in job.choices[:: job.n]]
                    for p, scores in enumerate(prompt_scores(self.model, prompts, job.logprobs or 0)):
                        for choice in job.choices[p * job.n : (p + 1) * job.n]:
                            choice.prompt_scores = scores
                for start in range(0, len(job.choices), job.n):
                    self._generate(job, job.choices[start : start + job.n])
        except Exception:  # this request fails (too long for memory, say): the engine serves the next
            log.exception("a request failed")
            self._end(job, "error")
        self._end(job, "cancelled" if job.cancelled else "length")

    def _generate(self, job: Job, choices: list[Choice]) -> None:
        """One prompt's choices as one batch, token by token, until each ends or the job is cancelled."""
        if job.max_new_tokens == 0 or job.cancelled:
            return
        decoding = job.decoding if job.logprobs is None else ScoredDecoding(**dataclasses.asdict(job.decoding))
        generators = None if job.generators is None else [job.generators[c.index] for c in choices]
        idx = torch.tensor([choices[0].prompt] * len(choices), device=self.runtime.device)
        steps = self.model.generate_tokens(idx, job.max_new_tokens, decoding, generators=generators)
        with contextlib.closing(steps):
            for step in steps:
                tokens = step[:, 0].tolist()
                scores = [None] * len(tokens) if job.logprobs is None else score(decoding.seen[0], tokens,
                                                                                job.logprobs)
                updates = [self._add(choice, token, scored, job.max_new_tokens)
                           for choice, token, scored in zip(choices, tokens, scores, strict=True) if not choice.done]
                job.on_update([update for update in updates if update[1] or update[2]])
                if job.cancelled or all(choice.done for choice in choices):
                    return

    def _add(self, choice: Choice, token: int, scored: Scored | None, max_new_tokens: int) -> Update:
        choice.tokens.append(token)
        choice.text.add(token)
        if scored is not None:
            choice.scores.append(scored)
        if choice.text.stopped or len(choice.tokens) == max_new_tokens:
            self._finish(choice, "stop" if choice.text.stopped else "length")
        return choice.index, choice.text.unshown(), choice.done, len(choice.tokens)

    def _finish(self, choice: Choice, reason: str) -> None:
        choice.finish_reason = reason
        choice.text.finish()
        self.finished[reason] += 1

    def _end(self, job: Job, reason: str) -> None:
        """Every choice not yet ended ends for `reason`, and says so."""
        ended = [choice for choice in job.choices if not choice.done]
        for choice in ended:
            self._finish(choice, reason)
        if ended:
            job.on_update([(c.index, c.text.unshown(), True, len(c.tokens)) for c in ended])
