"""Continuous batching: many completions decoded by one forward pass a step, each as if it ran alone.

Prompts of one length arriving together are prefilled as one KVCache batch, then each joins the running batch
(BatchKVCache), where every step feeds each row its newest token at its own position; rows leave and join between
steps. A learned-position row past block_size recomputes its last block_size tokens each step ("cropped"), as in
sample.py. Each row draws from its own generator, so its tokens depend on its seed, not the batch; text goes through
SampleText (stop strings as in sample.py); with logprobs each token comes scored (Scored), with echo the prompt's too.

The engine runs on its own thread (torch releases the GIL while it computes); callers submit Completions from any
thread and hear back through `on_update`. Other model work (the live page, echo's prompt scoring) runs as tasks
between steps, each followed by as much time for the rows: a completion decodes at half its speed at least. A task
that returns a generator runs one piece (up to its next yield: a forward pass) a turn, so that a completion waits
for one piece of it, not the whole."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from common.runtime import Runtime
from data.tokenizers import Tokenizer
from inference.sampling import SampleText
from inference.scoring import Scored, prompt_scores, score
from model import GPT
from model.attention import KVCache
from model.batch_cache import BatchKVCache
from model.gpt import PREFILL_CHUNK, Decoding

log = logging.getLogger("serve")
PREFILL_SLOTS = 8192  # cache positions a batched prefill may hold: 8 rows of GPT-2's 1,024


@dataclass(eq=False)
class Completion:
    """One sequence to generate. on_update(piece, done) is called on the engine's thread with each piece of text
    no later token can change, then with done=True when the completion ends (finish_reason set)."""

    prompt: list[int]
    max_new_tokens: int
    decoding: Decoding
    text: SampleText
    on_update: Callable[[str, bool], None]
    generator: torch.Generator | None = None
    logprobs: int | None = None  # report each token's log-probability and this many likeliest alternatives (0-5)
    score_prompt: bool = False  # score the prompt's tokens too (prompt_scores: echo with logprobs)
    tokens: list[int] = field(default_factory=list)  # generated so far
    scores: list[Scored] = field(default_factory=list)  # with logprobs: one per generated token
    prompt_scores: list[Scored] | None = None  # with echo: one per prompt token but the first
    finish_reason: str | None = None  # "stop" (stop string or end of text), "length", "cancelled" or "error" (logged)
    cancelled: bool = False  # set from any thread (a client left, a timeout): the row leaves at the next step

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _prefill_groups(completions: list[Completion], block_size: int) -> list[list[Completion]]:
    """Prompts that arrived together, by length (one forward pass a group), at most PREFILL_CHUNK tokens and
    PREFILL_SLOTS cache positions (block_size a row) a group: a group costs about what one long prompt costs."""
    by_length: dict[int, list[Completion]] = {}
    for completion in completions:
        by_length.setdefault(len(completion.prompt), []).append(completion)
    groups = []
    for length, same in by_length.items():
        rows = max(1, min(PREFILL_CHUNK // length, PREFILL_SLOTS // block_size))
        groups += [same[i : i + rows] for i in range(0, len(same), rows)]
    return groups


def pick_tokens(logits: torch.Tensor, completions: list[Completion]) -> list[int]:
    """Each row's next token by its own Decoding and generator; rows that decode alike are cut together."""
    groups: dict[Decoding, list[int]] = {}
    for row, completion in enumerate(completions):
        groups.setdefault(completion.decoding, []).append(row)
    if len(groups) == 1:  # the common case: one decoding for all, no regrouping
        return _pick(logits, completions)[:, 0].tolist()
    picked = torch.empty(len(completions), dtype=torch.long, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        picked[index] = _pick(logits[index], [completions[row] for row in rows])[:, 0]
    return picked.tolist()


def _pick(logits: torch.Tensor, completions: list[Completion]) -> torch.Tensor:
    """Rows that decode alike; each seeded one from its own generator (unseeded ones: torch's global one)."""
    generators = [c.generator for c in completions]
    return completions[0].decoding.next_token(logits, None if all(g is None for g in generators) else generators)


class Engine:
    """Owns the model while running: nothing else may call it then."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, runtime: Runtime, max_batch: int) -> None:
        self.model, self.tokenizer, self.runtime, self.max_batch = model, tokenizer, runtime, max_batch
        self.waiting: deque[Completion] = deque()
        self.tasks: deque[tuple[Callable[[], Any] | Generator, Future]] = deque()  # call()'s and scoring's
        self.scoring: list[Completion] = []  # admitted, their prompts being scored (echo) before their prefill
        self._owed = 0.0  # seconds of tasks the rows have not yet had back in steps: no task until repaid
        self.active: list[Completion] = []  # row i of the batch cache is active[i]
        self.cropped: list[Completion] = []  # past a learned-position model's block_size: recomputed each step
        self.cache = BatchKVCache(model.config)
        self._wake = threading.Condition()
        self._closing, self._failed = False, False  # _failed: the thread died, nothing more is taken
        self._thread: threading.Thread | None = None
        self.steps = 0  # decode steps run
        self.finished: Counter[str] = Counter()  # completions ended, by finish_reason (GET /health shows them)
        # after each run_once, with the completions left (0: idle): lets the server's Mailbox batch on_updates
        self.after_step: Callable[[int], None] | None = None

    # --- any thread ---
    def start(self) -> None:
        threads = torch.get_num_threads()  # OpenMP's count is the calling thread's own: hand it on
        self._thread = threading.Thread(target=self._run, args=(threads,), name="engine", daemon=True)
        self._thread.start()

    def submit(self, completion: Completion) -> None:
        """RuntimeError once the engine is closing or has failed."""
        with self._wake:
            self._check_open()
            self.waiting.append(completion)
            self._wake.notify()

    def call(self, task: Callable[[], Any]) -> Future:
        """Run `task()` (other model use, e.g. the live page's attention maps) on the engine's thread between steps;
        if it returns a generator, one piece a turn."""
        with self._wake:  # (its lock is reentrant)
            self._check_open()
            return self._queue(task)

    def _queue(self, task: Callable[[], Any] | Generator, future: Future | None = None) -> Future:
        future = Future() if future is None else future
        with self._wake:
            self.tasks.append((task, future))
            self._wake.notify()
        return future

    def _check_open(self) -> None:
        if self._closing or self._failed:
            raise RuntimeError("the engine is " + ("closed" if self._closing else "stopped after an error"))

    @property
    def failed(self) -> bool:
        return self._failed

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) completions; those whose prompts are being scored run."""
        return len(self.active) + len(self.cropped) + len(self.scoring), len(self.waiting)

    def close(self) -> None:
        """Finish what is running and waiting, then stop the thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    # --- the engine's thread ---
    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            while True:
                with self._wake:
                    while not (self.waiting or self.running or self.tasks or self._closing):
                        self._wake.wait()
                    if self._closing and not (self.waiting or self.running or self.tasks):
                        return
                self.run_once()
        except BaseException as err:  # a bug outside a step, or the process going down: fail everything held
            log.exception("the engine stopped")
            with self._wake:
                self._failed = True
                held, tasks = [*self.running, *self.scoring, *self.waiting], list(self.tasks)
                self.active, self.cropped, self.scoring = [], [], []
                self.waiting.clear()
                self.tasks.clear()
            self._fail(held)
            for _, future in tasks:
                future.set_exception(RuntimeError(f"the engine stopped ({type(err).__name__})"))
            if self.after_step is not None:
                self.after_step(0)
            raise

    @torch.inference_mode()
    def run_once(self) -> None:
        """A task unless the rows are owed time, then admit what fits, then one decode step for every row."""
        if self.tasks and (self._owed <= 0 or not self.running):
            began = time.perf_counter()
            with self._wake:
                task, future = self.tasks.popleft()
            self._run_task(task, future)
            self._owed = time.perf_counter() - began
        began = time.perf_counter()
        self._drop_cancelled()
        for group in _prefill_groups(self._admit(), self.model.config.block_size):
            try:
                self._prefill(group)
            except Exception:  # these prompts (too long for memory, say): the others go on
                log.exception("a prompt failed")
                self._leave(group)
                self._fail(group)
        if self.active or self.cropped:
            try:
                self._step()
            except Exception:  # every row of the step: they leave, and the engine serves what comes next
                log.exception("a decode step failed")
                failed, self.active, self.cropped = self.running, [], []
                self.cache = BatchKVCache(self.model.config)
                self._fail(failed)
        self._owed = max(0.0, self._owed - (time.perf_counter() - began)) if self.running else 0.0
        if self.after_step is not None:
            self.after_step(len(self.active) + len(self.cropped) + len(self.waiting))

    def _run_task(self, task: Callable[[], Any] | Generator, future: Future) -> None:
        """A task, or the next piece of one that returned a generator (then back in line: other tasks take turns)."""
        if not isinstance(task, Generator) and not future.set_running_or_notify_cancel():
            return  # cancelled while it waited
        try:
            result = task if isinstance(task, Generator) else task()
            if isinstance(result, Generator):
                try:
                    next(result)
                except StopIteration as done:
                    result = done.value
                else:
                    self._queue(result, future)
                    return
        except Exception as err:  # the caller's to handle: the engine goes on
            future.set_exception(err)
            return
        future.set_result(result)

    def _admit(self) -> list[Completion]:
        """Waiting completions while rows are free, PREFILL_CHUNK prompt tokens a step; echo's go to _score first."""
        admitted: list[Completion] = []
        tokens = 0  # of the admitted prompts
        while len(self.active) + len(self.cropped) + len(self.scoring) + len(admitted) < self.max_batch:
            with self._wake:
                if not self.waiting or (admitted and tokens + len(self.waiting[0].prompt) > PREFILL_CHUNK):
                    break
                completion = self.waiting.popleft()
            if completion.cancelled:
                continue
            if completion.score_prompt and completion.prompt_scores is None:
                self._score(completion)
            else:
                admitted.append(completion)
                tokens += len(completion.prompt)
        return admitted

    def _score(self, completion: Completion) -> None:
        """Score its prompt one forward pass a turn; then it waits first in line for its prefill, or ends."""

        def passes() -> Iterator[None]:
            scores: list[Scored] = []
            try:
                parts = prompt_scores(self.model, self.runtime, completion.prompt, completion.logprobs or 0)
                while not completion.cancelled and (part := next(parts, None)) is not None:
                    scores.extend(part)
                    yield
            except Exception:  # this prompt (too long for memory, say): the others go on
                log.exception("a prompt failed")
                completion.finish_reason = "error"
            self.scoring.remove(completion)
            completion.prompt_scores = scores
            if completion.done or completion.cancelled or completion.max_new_tokens == 0:
                self._end(completion, completion.finish_reason or ("cancelled" if completion.cancelled else "length"))
            else:
                with self._wake:
                    self.waiting.appendleft(completion)

        self.scoring.append(completion)
        self._queue(passes)

    @property
    def running(self) -> list[Completion]:
        return self.active + self.cropped

    def _past_context(self, completion: Completion) -> bool:
        """Its next token needs a position past a learned-position model's block_size: sample.py's crop then."""
        config = self.model.config
        return not config.rolls and len(completion.prompt) + len(completion.tokens) > config.block_size

    def _prefill(self, group: list[Completion]) -> None:
        """Prompts of one length through one KVCache, their first tokens, then each a row (past context: cropped)."""
        plain = []
        for completion in group:
            if completion.max_new_tokens == 0:  # echo alone, nothing generated
                self._end(completion, "length")
            elif self._past_context(completion):
                self.cropped.append(completion)
            else:
                plain.append(completion)
        if not plain:
            return
        cache = KVCache(self.model.config)
        idx = torch.tensor([completion.prompt for completion in plain], dtype=torch.long, device=self.runtime.device)
        with self.runtime.autocast():
            logits = self.model.logits(self.model.prefill(idx, cache)[:, -1, :])
        self._deliver_all(logits, plain)
        for row, completion in enumerate(plain):
            if not completion.done:
                self.cache.add(cache, row)
                self.active.append(completion)

    def _step(self) -> None:
        """One token for every row: the batch cache's by their newest token, the cropped by their last block_size."""
        for row in reversed(range(len(self.active))):
            if self._past_context(self.active[row]):
                self.cropped.append(self.active[row])
                self._remove(row)
        device, parts = self.runtime.device, []
        with self.runtime.autocast():
            if self.active:
                idx = torch.tensor([[completion.tokens[-1]] for completion in self.active], device=device)
                parts.append(self.model.logits(self.model.hidden(idx, self.cache)[:, -1, :]))
            if self.cropped:
                block = self.model.config.block_size
                idx = torch.tensor([completion.sequence[-block:] for completion in self.cropped], device=device)
                parts.append(self.model.logits(self.model.hidden(idx)[:, -1, :]))
        self._deliver_all(parts[0] if len(parts) == 1 else torch.cat(parts), self.running)  # no copy for one
        self.steps += 1
        for row in reversed(range(len(self.active))):  # descending: a removed row's place takes the last row
            if self.active[row].done:
                self._remove(row)
        self.cropped = [completion for completion in self.cropped if not completion.done]

    def _deliver_all(self, logits: torch.Tensor, completions: list[Completion]) -> None:
        """Each completion's next token from its row of logits, with its score where asked for."""
        tokens = pick_tokens(logits, completions)
        asked = [row for row, completion in enumerate(completions) if completion.logprobs is not None]
        if asked:
            top = max(completions[row].logprobs for row in asked)
            for row, scored in zip(asked, score(logits[asked], [tokens[row] for row in asked], top), strict=True):
                scored.top = scored.top[: completions[row].logprobs]
                completions[row].scores.append(scored)
        for completion, token in zip(completions, tokens, strict=True):
            self._deliver(completion, token)

    def _deliver(self, completion: Completion, token: int) -> None:
        completion.add(token)
        if completion.done:
            completion.text.finish()
            self.finished[completion.finish_reason] += 1
        piece = completion.text.unshown()
        if piece or completion.done:
            completion.on_update(piece, completion.done)

    def _fail(self, completions: list[Completion]) -> None:
        for completion in [c for c in completions if not c.done]:
            self._end(completion, "error")

    def _drop_cancelled(self) -> None:
        for row in reversed(range(len(self.active))):
            if self.active[row].cancelled:
                self._end(self.active[row], "cancelled")
                self._remove(row)
        for completion in [c for c in self.cropped if c.cancelled]:
            self._end(completion, "cancelled")
            self.cropped.remove(completion)

    def _end(self, completion: Completion, reason: str) -> None:
        """Ended without a token (cancelled, failed, or echo alone), and said so."""
        completion.finish_reason = reason
        self.finished[reason] += 1
        completion.on_update("", True)

    def _leave(self, completions: list[Completion]) -> None:
        """Those of them already running (a group that failed after some of it joined) leave the batch."""
        for row in reversed(range(len(self.active))):
            if self.active[row] in completions:
                self._remove(row)
        self.cropped = [completion for completion in self.cropped if completion not in completions]

    def _remove(self, row: int) -> None:
        self.cache.remove(row)
        last = self.active.pop()
        if row < len(self.active):
            self.active[row] = last
