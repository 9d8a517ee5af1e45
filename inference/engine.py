"""The server's model work, a forward pass at a time, so that requests can take turns on the model: a prompt's n
choices decode as one batch through GPT.generate_tokens, exactly as sample.py draws its samples, and several prompts
run one after another. With logprobs each token comes scored; with echo the prompts are scored too, as if the model
had generated them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from common.runtime import Runtime
from evals.perplexity import windows
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
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [Scored(lp, list(zip(i, v, strict=True))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist(),
                                                                        strict=True)]


def prompt_scores(model: GPT, prompts: list[list[int]], top: int) -> Generator[None, None, list[list[Scored]]]:
    """Each prompt token's score but the first's, from the tokens generation would have seen before it: perplexity's
    windows at stride 1 (one over the first block_size tokens, then one a token; a prompt within the context is one
    window), right-padded together PREFILL_CHUNK positions a forward pass (a causal model's earlier positions never see
    the padding); a rolling model's prompt past block_size through its KV cache instead. A generator that pauses after
    each forward pass (the engine runs other requests' between) and returns the scores."""
    config, device = model.config, next(model.parameters()).device
    scores: list[list[Scored]] = [[] for _ in prompts]
    rows = []
    for i, prompt in enumerate(prompts):
        if config.rolls and len(prompt) > config.block_size:
            scores[i] = yield from _rolled_scores(model, prompt, top)
        else:
            rows += [(i, w) for w in windows(len(prompt), config.block_size, 1)]
    rows.sort(key=lambda row: -row[1].length)  # stable: a prompt's windows stay in order
    while rows:
        width = rows[0][1].length  # the longest left
        batch, rows = rows[: max(1, PREFILL_CHUNK // width)], rows[max(1, PREFILL_CHUNK // width) :]
        pad = [prompts[i][w.start : w.start + w.length] + [0] * (width - w.length) for i, w in batch]
        hidden = model.hidden(torch.tensor(pad, device=device))
        for row, (i, w) in enumerate(batch):
            end = w.start + w.length  # the index of its last target
            scored = model.logits(hidden[row, w.length - w.scored : w.length])
            scores[i] += score(scored, prompts[i][end - w.scored + 1 : end + 1], top)
        yield
    return scores


def _rolled_scores(model: GPT, prompt: list[int], top: int) -> Generator[None, None, list[Scored]]:
    """A rolling model's prompt through its KV cache, PREFILL_CHUNK tokens at a time: each token from all before it."""
    cache, scores, device = KVCache(model.config), [], next(model.parameters()).device
    for start in range(0, len(prompt), PREFILL_CHUNK):
        chunk = prompt[start : start + PREFILL_CHUNK]
        logits = model.logits(model.hidden(torch.tensor([chunk], device=device), cache)[0])
        targets = prompt[start + 1 : start + 1 + len(chunk)]
        scores += score(logits[: len(targets)], targets, top)
        yield
    return scores


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
    scores: list[Scored] = field(default_factory=list)  # with logprobs: one per generated token
    prompt_scores: list[Scored] | None = None  # with echo and logprobs: one per prompt token but the first
    finish_reason: str | None = None  # "stop" (a stop string, the end of text), "length", "cancelled" or "error"

    @property
    def tokens(self) -> list[int]:
        """Those generated: the text's, which takes none once it is finished."""
        return self.text.tokens


Update = tuple[int, str, bool, int]  # choice index, a piece of text, done, its token count when it came


@dataclass(eq=False)
class Job:
    """One request's work: its choices (prompt p's are p*n .. p*n + n - 1) and how they decode."""

    choices: list[Choice]
    n: int
    max_new_tokens: int  # 0: echo alone, nothing generated
    decoding: Decoding
    generators: list[torch.Generator] | None  # one per choice (seed + index), or torch's global one
    logprobs: int | None  # report each token's log-probability and this many likeliest alternatives (0-5)
    score_prompts: bool  # echo with logprobs


class Engine:
    """The model, run on one thread (where torch keeps serve.py's thread count). A job runs as steps, one forward pass
    each, that the server advances a slice (a few steps) at a time, the requests' slices taking turns."""

    def __init__(self, model: GPT, runtime: Runtime) -> None:
        self.model, self.runtime = model, runtime
        self.thread = ThreadPoolExecutor(1, "engine", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))
        self.finished: Counter[str] = Counter()  # choices ended, by finish_reason (GET /health shows them)

    def steps(self, job: Job) -> Iterator[list[Update] | None]:
        """The job's forward passes one at a time, each generation step's updates (the pieces of text no later token
        can change) as it ends: the prompts scored (echo with logprobs), then each prompt's n choices generated as one
        batch. Closed before its end (its client left, its time ran out), its choices end as cancelled."""
        try:
            if job.score_prompts:  # each prompt once, however many choices it has
                prompts = [c.prompt for c in job.choices[:: job.n]]
                scores = yield from prompt_scores(self.model, prompts, job.logprobs or 0)
                for choice in job.choices:
                    choice.prompt_scores = scores[choice.index // job.n]
            for start in range(0, len(job.choices), job.n):
                yield from self._generate(job, job.choices[start : start + job.n])
        except GeneratorExit:
            self._end(job.choices, "cancelled")
            raise
        except Exception:  # this request fails (too long for memory, say): the engine serves the others
            log.exception("a request failed")
            yield self._end(job.choices, "error")
        else:
            yield self._end(job.choices, "length")

    def advance(self, steps: Iterator[list[Update] | None], seconds: float) -> tuple[list[Update], bool]:
        """A job's steps for about `seconds` (one at least), on the engine's thread: their updates, and whether the
        job is done."""
        updates: list[Update] = []
        end = time.monotonic() + seconds
        with torch.inference_mode(), self.runtime.autocast():
            for step in steps:
                updates += step or []
                if time.monotonic() >= end:
                    return updates, False
        return updates, True

    def _generate(self, job: Job, choices: list[Choice]) -> Iterator[list[Update]]:
        """One prompt's choices as one batch, token by token, until each ends."""
        if job.max_new_tokens == 0:
            return
        decoding = job.decoding if job.logprobs is None else ScoredDecoding(**dataclasses.asdict(job.decoding))
        generators = None if job.generators is None else [job.generators[c.index] for c in choices]
        idx = torch.tensor([choices[0].prompt] * len(choices), device=self.runtime.device)
        steps = self.model.generate_tokens(idx, job.max_new_tokens, decoding, generators=generators)
        with contextlib.closing(steps):
            for step in steps:
                tokens = step[:, 0].tolist()
                scores = [None] * len(tokens) if job.logprobs is None else score(decoding.seen[0], tokens, job.logprobs)
                updates: list[Update] = []
                for choice, token, scored in zip(choices, tokens, scores, strict=True):
                    if choice.finish_reason is not None:
                        continue
                    choice.text.add(token)
                    if scored is not None:
                        choice.scores.append(scored)
                    if choice.text.stopped or len(choice.tokens) == job.max_new_tokens:
                        updates += self._end([choice], "stop" if choice.text.stopped else "length")
                    elif piece := choice.text.unshown():
                        updates.append((choice.index, piece, False, len(choice.tokens)))
                yield updates
                if all(choice.finish_reason is not None for choice in choices):
                    return

    def _end(self, choices: list[Choice], reason: str) -> list[Update]:
        """The choices not yet ended end for `reason`: their last updates."""
        ended = [choice for choice in choices if choice.finish_reason is None]
        for choice in ended:
            choice.finish_reason = reason
            choice.text.finish()
            self.finished[reason] += 1
        return [(c.index, c.text.unshown(), True, len(c.tokens)) for c in ended]
