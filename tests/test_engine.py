"""The server's engine (inference/engine.py): a prompt's n choices decode as one batch and draw what sample.py draws,
for every kind of model, past the context too; echo scores a text as its generation scored it; a cancelled or
failing request ends, and the engine serves the next; a job runs a forward pass a step, so requests can take turns."""

from __future__ import annotations

import math

import pytest
import torch

from common.runtime import make_runtime
from conftest import MODERN
from inference.engine import Choice, Engine, Job, prompt_scores
from inference.sampling import SampleText
from model import GPT, GPTConfig
from model.gpt import Decoding, row_generators

SMALL = dict(vocab_size=50, n_layer=2, n_head=2, n_embd=32)
CONFIGS = {
    "gpt2": GPTConfig(**SMALL, block_size=128),
    "modern": GPTConfig(**SMALL, block_size=128, **MODERN),
    "rolling": GPTConfig(**SMALL, block_size=32, pos_emb="rope", attn_window=8, window_pattern="SS"),
    "short": GPTConfig(**SMALL, block_size=16),  # past the context as sample.py goes: recomputed windows
}
PROMPTS = [[1, 2, 3], list(range(5, 25))]
NEW = 40
CPU = make_runtime("cpu", "float32")


class Letters:
    """A tokenizer stand-in: token t is one letter."""

    end_of_text = None

    def token_bytes(self, token: int) -> bytes:
        return bytes([65 + token % 26])


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIGS[name]).eval()
    with torch.no_grad():  # zero-initialised parts would make every logit equal
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _run(engine: Engine, job: Job) -> None:
    """The job to its end in one go, as if no other request took a turn."""
    engine.advance(engine.steps(job), math.inf)


def _job(prompts: list[list[int]], n: int, decoding: Decoding, seed: int | None = None, max_new_tokens: int = NEW,
         logprobs: int | None = None, score_prompts: bool = False) -> Job:
    choices = [Choice(p * n + j, prompt, SampleText(Letters(), "")) for p, prompt in enumerate(prompts)
               for j in range(n)]
    return Job(choices, n, max_new_tokens, decoding, row_generators(seed, len(choices)), logprobs, score_prompts)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("decoding", [Decoding(0.0), Decoding(1.0, top_k=10)], ids=["greedy", "seeded"])
def test_each_prompt_s_choices_draw_what_sample_py_draws(name: str, decoding: Decoding) -> None:
    """Choice i of a request with seed S is sample.py's sample i at seed S (its own generator, seeded S + i)."""
    model = _model(name)
    job = _job(PROMPTS, 2, decoding, seed=7)
    _run(Engine(model, CPU), job)
    generators = row_generators(7, 4)
    expected = []
    for p, prompt in enumerate(PROMPTS):
        pair = generators[2 * p : 2 * p + 2]
        steps = model.generate_tokens(torch.tensor([prompt] * 2), NEW, decoding, generators=pair)
        expected += torch.cat(list(steps), dim=1).tolist()
    assert [choice.tokens for choice in job.choices] == expected
    assert all(choice.finish_reason == "length" for choice in job.choices)


@pytest.mark.parametrize("name", ["short", "rolling", "modern"])
def test_echo_scores_a_text_as_decoding_scored_it_when_it_generated_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt's log-probabilities (echo) equal those reported for the same tokens as they were generated, past
    the context too, 8 positions a forward pass, a short prompt padded beside a long one."""
    monkeypatch.setattr("inference.engine.PREFILL_CHUNK", 8)
    model = _model(name)
    engine = Engine(model, CPU)
    made = _job([[1, 2, 3]], 1, Decoding(0.7, top_k=5), seed=3, logprobs=3)
    _run(engine, made)
    (choice,) = made.choices
    assert len(choice.scores) == NEW and all(len(s.top) == 3 for s in choice.scores)
    text = choice.prompt + choice.tokens
    echoed = _job([text, [4, 5]], 1, Decoding(0.0), max_new_tokens=0, logprobs=3, score_prompts=True)
    _run(engine, echoed)
    assert [c.finish_reason for c in echoed.choices] == ["length"] * 2 and echoed.choices[0].tokens == []
    scores = echoed.choices[0].prompt_scores
    assert len(scores) == len(text) - 1 and len(echoed.choices[1].prompt_scores) == 1
    again = scores[len(choice.prompt) - 1 :]
    assert [s.logprob for s in again] == pytest.approx([s.logprob for s in choice.scores], abs=1e-4)
    assert [[t for t, _ in s.top] for s in again] == [[t for t, _ in s.top] for s in choice.scores]
    with torch.no_grad():  # the first tokens' scores, by hand: log-softmax of the plain forward pass
        logits, _ = model(torch.tensor([text[:8]]))
        _, (alone,) = _drained(prompt_scores(model, [[4, 5]], 3))
    by_hand = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(text[1:8])[:, None])[:, 0]
    assert [s.logprob for s in scores[:7]] == pytest.approx(by_hand.tolist(), abs=1e-5)
    assert echoed.choices[1].prompt_scores[0].logprob == pytest.approx(alone[0].logprob, abs=1e-5)


def _drained(steps):
    """How often a generator paused (the forward passes of prompt_scores) and its value once it has run to its end."""
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return pauses, done.value
        pauses += 1


def test_echo_scores_prompts_within_the_context_in_one_forward_pass() -> None:
    """Prompts within block_size are scored together in one forward pass; past it, each token in a window of its own,
    PREFILL_CHUNK positions of windows a pass."""
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        passes, scores = _drained(prompt_scores(model, [list(range(33)), list(range(40, 60))], 0))
        assert (passes, [len(s) for s in scores]) == (1, [32, 19])
        passes, scores = _drained(prompt_scores(model, [list(range(33)) * 3], 0))
        assert (passes, [len(s) for s in scores]) == (3, [98])  # 67 windows of 32 tokens, 32 a pass


def test_a_job_runs_a_forward_pass_a_step_and_a_closed_one_ends_as_cancelled() -> None:
    """The server advances a job a few steps in each turn: a step is one token of each choice of a prompt, and a job
    closed before its end (its client left) ends every choice as cancelled, counted once."""
    job = _job(PROMPTS, 2, Decoding(0.0))
    engine = Engine(_model("gpt2"), CPU)
    steps = engine.steps(job)
    for _ in range(5):
        engine.advance(steps, 0.0)  # one step each
    steps.close()
    assert [len(c.tokens) for c in job.choices] == [5, 5, 0, 0]
    assert [c.finish_reason for c in job.choices] == ["cancelled"] * 4 and engine.finished == {"cancelled": 4}


def test_a_failing_request_ends_in_error_and_the_engine_serves_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("gpt2")
    engine = Engine(model, CPU)
    failed, again = _job(PROMPTS[:1], 1, Decoding(0.0)), _job(PROMPTS[:1], 1, Decoding(0.0))
    with monkeypatch.context() as patch:
        patch.setattr(model, "generate_tokens", lambda *a, **k: (_ for _ in ()).throw(MemoryError("too long")))
        _run(engine, failed)
    assert failed.choices[0].finish_reason == "error"
    _run(engine, again)
    assert again.choices[0].finish_reason == "length" and engine.finished == {"error": 1, "length": 1}
