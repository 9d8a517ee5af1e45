"""Continuous batching (inference/engine.py, model/batch_cache.py): each row gets exactly the tokens it would get
alone, whatever joins or leaves beside it, for every kind of model, rolling ones past block_size included."""

from __future__ import annotations

import pytest
import torch

from common.runtime import make_runtime
from conftest import MODERN
from inference.engine import Completion, Engine
from inference.sampling import SampleText
from model import GPT, GPTConfig
from model.gpt import Decoding, row_generators

SMALL = dict(vocab_size=50, n_layer=2, n_head=2, n_embd=32)
CONFIGS = {
    "gpt2": GPTConfig(**SMALL, block_size=128),
    "modern": GPTConfig(**SMALL, block_size=128, **MODERN),
    "windowed": GPTConfig(**{**SMALL, "n_layer": 3}, block_size=128, attn_window=8),
    "rolling": GPTConfig(**SMALL, block_size=32, pos_emb="rope", attn_window=8, window_pattern="SS"),
    # past the context as sample.py goes: rows outgrow block_size 16 mid-batch, or start past it (30 tokens)
    "short": GPTConfig(**SMALL, block_size=16),
    "short_modern": GPTConfig(**SMALL, block_size=16, **MODERN),
}
# prompts of different lengths; the rolling model's rows go well past its block_size of 32
PROMPTS = [[1, 2, 3], list(range(5, 25)), [7], list(range(30)), [4, 4, 4, 4, 9]]
NEW = 40


class Letters:
    """A tokenizer stand-in: token t is one letter."""

    end_of_text = None

    def token_bytes(self, token: int) -> bytes:
        return bytes([65 + token % 26])


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIGS[name]).eval()
    with torch.no_grad():  # zero-initialised parts (untied head, projections) would make every logit equal
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _completion(prompt: list[int], decoding: Decoding, generator: torch.Generator | None = None) -> Completion:
    return Completion(prompt, NEW, decoding, SampleText(Letters(), ""), lambda piece, done: None, generator)


def _alone(model: GPT, prompt: list[int], decoding: Decoding, seed: int | None = None) -> list[int]:
    generators = row_generators(seed, 1)
    steps = model.generate_tokens(torch.tensor([prompt]), NEW, decoding, generators=generators)
    return [int(token) for token in steps]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rows_joining_at_different_steps_get_the_greedy_tokens_they_get_alone(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import model.gpt as gpt_module

    monkeypatch.setattr(gpt_module, "PREFILL_CHUNK", 8)  # the rolling model's prompts run in chunks, and join rolled
    model = _model(name)
    alone = [_alone(model, prompt, Decoding(0.0)) for prompt in PROMPTS]
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=8)
    rows = [_completion(prompt, Decoding(0.0)) for prompt in PROMPTS]
    engine.submit(rows[0])
    engine.run_once()
    engine.run_once()
    engine.submit(rows[1])
    engine.run_once()
    for row in rows[2:]:
        engine.submit(row)
    batched = 0
    while engine.running or engine.waiting:
        batched = max(batched, len(engine.running))
        engine.run_once()
    assert batched == len(PROMPTS)
    assert [row.tokens for row in rows] == alone
    assert all(row.finish_reason == "length" for row in rows)


def test_a_seeded_row_draws_the_same_tokens_whoever_is_beside_it() -> None:
    model = _model("modern")
    decoding = Decoding(1.0, top_k=10)
    alone = _alone(model, PROMPTS[1], decoding, seed=99)
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=8)
    ours = _completion(PROMPTS[1], decoding, row_generators(99, 1)[0])
    others = [_completion(p, Decoding(0.7, top_p=0.9)) for p in PROMPTS]  # another decoding, torch's generator
    engine.submit(others[0])
    engine.run_once()
    engine.submit(ours)
    for other in others[1:]:
        engine.submit(other)
    while engine.running or engine.waiting:
        engine.run_once()
    assert ours.tokens == alone


def test_a_cancelled_row_leaves_at_the_next_step_and_the_others_go_on() -> None:
    model = _model("gpt2")
    alone = [_alone(model, prompt, Decoding(0.0)) for prompt in PROMPTS[:3]]
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=8)
    rows = [_completion(prompt, Decoding(0.0)) for prompt in PROMPTS[:3]]
    for row in rows:
        engine.submit(row)
    for _ in range(5):
        engine.run_once()
    rows[0].cancelled = True
    engine.run_once()
    assert rows[0].finish_reason == "cancelled" and len(engine.active) == 2
    assert len(rows[0].tokens) == 6  # the first from the prefill, then 5 steps
    while engine.running:
        engine.run_once()
    assert [row.tokens for row in rows[1:]] == alone[1:]
    assert engine.finished == {"cancelled": 1, "length": 2}


def test_max_batch_makes_the_rest_wait_and_join_as_rows_free() -> None:
    model = _model("rolling")
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=2)
    rows = [_completion(prompt, Decoding(0.0)) for prompt in PROMPTS]
    for row in rows:
        engine.submit(row)
    engine.run_once()
    assert engine.load == (2, 3)
    while engine.running or engine.waiting:
        assert len(engine.active) <= 2
        engine.run_once()
    assert [row.tokens for row in rows] == [_alone(model, p, Decoding(0.0)) for p in PROMPTS]


def test_the_engine_thread_serves_submissions_and_closes_after_them() -> None:
    model = _model("gpt2")
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=4)
    pieces: list[tuple[str, bool]] = []
    row = Completion(PROMPTS[0], NEW, Decoding(0.0), SampleText(Letters(), ""), lambda p, d: pieces.append((p, d)))
    engine.start()
    engine.submit(row)
    engine.close()
    assert pieces[-1][1] and sum(done for _, done in pieces) == 1
    assert "".join(p for p, _ in pieces) == "".join(chr(65 + t % 26) for t in _alone(model, PROMPTS[0], Decoding(0.0)))
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(row)


def test_a_failing_prompt_or_step_fails_its_rows_and_the_engine_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("gpt2")
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=4)
    ended: list[str] = []

    def completion(prompt: list[int]) -> Completion:
        return Completion(prompt, NEW, Decoding(0.0), SampleText(Letters(), ""), lambda p, d: d and ended.append(p))

    prefill, step = engine._prefill, engine._step

    def bad_prefill(group: list[Completion]) -> None:
        if any(c.prompt == [13] for c in group):
            raise MemoryError("too long")  # an Exception: these prompts alone fail
        prefill(group)

    monkeypatch.setattr(engine, "_prefill", bad_prefill)
    rows = [completion(PROMPTS[0]), completion([13]), completion(PROMPTS[1])]
    for row in rows:
        engine.submit(row)
    engine.run_once()
    assert [row.finish_reason for row in rows] == [None, "error", None] and len(engine.active) == 2

    monkeypatch.setattr(engine, "_step", lambda: (_ for _ in ()).throw(RuntimeError("a bug in a step")))
    engine.run_once()
    assert [row.finish_reason for row in rows] == ["error"] * 3 and engine.active == [] and engine.cache.rows == 0
    monkeypatch.setattr(engine, "_step", step)
    again = completion(PROMPTS[0])
    engine.submit(again)
    while engine.running or engine.waiting:
        engine.run_once()
    assert again.tokens == _alone(model, PROMPTS[0], Decoding(0.0)) and engine.finished["error"] == 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread re-raises it
def test_an_engine_thread_that_dies_fails_what_it_held_and_takes_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(_model("gpt2"), Letters(), make_runtime("cpu", "float32"), max_batch=4)
    monkeypatch.setattr(engine, "_drop_cancelled", lambda: (_ for _ in ()).throw(SystemExit("going down")))
    flushed: list[int] = []
    engine.after_step = flushed.append
    row = _completion(PROMPTS[0], Decoding(0.0))
    engine.start()
    engine.submit(row)
    engine._thread.join(timeout=30)
    assert engine.failed and row.finish_reason == "error" and flushed == [0]
    with pytest.raises(RuntimeError, match="stopped after an error"):
        engine.submit(_completion(PROMPTS[0], Decoding(0.0)))
    with pytest.raises(RuntimeError, match="stopped after an error"):
        engine.call(lambda: None)


@pytest.mark.parametrize("name", ["short", "rolling"])
def test_a_seeded_row_past_the_context_draws_what_sample_py_draws(name: str) -> None:
    """Rows that outgrow block_size mid-batch, or start past it, beside rows still in the batch cache."""
    model = _model(name)
    decoding = Decoding(1.0, top_k=10)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1]]  # 3 tokens, 30 (past 16 from the start), 20
    alone = [_alone(model, prompt, decoding, seed=7 + i) for i, prompt in enumerate(prompts)]
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=8)
    rows = [_completion(p, decoding, row_generators(7 + i, 1)[0]) for i, p in enumerate(prompts)]
    for row in rows:
        engine.submit(row)
        engine.run_once()
    while engine.running or engine.waiting:
        engine.run_once()
    assert [row.tokens for row in rows] == alone


@pytest.mark.parametrize("name", ["short", "rolling", "modern"])
def test_echo_scores_a_text_as_decoding_scored_it_when_it_generated_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt's log-probabilities (echo) equal those reported for the same tokens as they were generated, past
    the context too (in chunks of 8 positions, windows past it); and both are the model's log-softmax before
    temperature and cut-offs."""
    import inference.scoring as scoring

    monkeypatch.setattr(scoring, "PREFILL_CHUNK", 8)
    model = _model(name)
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=4)
    made = _completion([1, 2, 3], Decoding(0.7, top_k=5), row_generators(3, 1)[0])
    made.logprobs = 3
    engine.submit(made)
    while engine.running or engine.waiting:
        engine.run_once()
    assert len(made.scores) == NEW and all(len(s.top) == 3 for s in made.scores)
    echoed = _completion(made.prompt + made.tokens, Decoding(0.0))
    echoed.max_new_tokens, echoed.logprobs, echoed.score_prompt = 0, 3, True
    engine.submit(echoed)
    while not echoed.done:
        engine.run_once()
    assert echoed.done and echoed.tokens == [] and echoed.finish_reason == "length"
    assert len(echoed.prompt_scores) == len(echoed.prompt) - 1
    again = echoed.prompt_scores[len(made.prompt) - 1 :]
    assert [s.logprob for s in again] == pytest.approx([s.logprob for s in made.scores], abs=1e-4)
    assert [[t for t, _ in s.top] for s in again] == [[t for t, _ in s.top] for s in made.scores]
    with torch.no_grad():  # the first tokens' scores, by hand: log-softmax of the plain forward pass
        logits, _ = model(torch.tensor([echoed.prompt[:8]]))
    by_hand = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(echoed.prompt[1:8])[:, None])[:, 0]
    assert [s.logprob for s in echoed.prompt_scores[:7]] == pytest.approx(by_hand.tolist(), abs=1e-5)


def test_a_cancelled_row_past_the_context_leaves_and_the_others_go_on() -> None:
    model = _model("short")
    alone = _alone(model, PROMPTS[1], Decoding(0.0))
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=8)
    rows = [_completion(PROMPTS[3], Decoding(0.0)), _completion(PROMPTS[1], Decoding(0.0))]  # 30 tokens, 20
    for row in rows:
        engine.submit(row)
    for _ in range(3):
        engine.run_once()
    assert engine.cropped == rows and engine.load == (2, 0)
    rows[0].cancelled = True
    engine.run_once()
    assert rows[0].finish_reason == "cancelled" and engine.cropped == [rows[1]]
    while engine.running:
        engine.run_once()
    assert rows[1].tokens == alone and engine.finished == {"cancelled": 1, "length": 1}


@pytest.mark.parametrize("name", ["gpt2", "modern", "rolling", "windowed"])
def test_prompts_of_one_length_arriving_together_prefill_as_one_batch_with_each_row_s_tokens(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four prompts of 12 tokens and one of 5, submitted together: two prefills (counted), and every row's
    tokens, greedy or seeded, what they are alone."""
    model = _model(name)
    prompts = [list(range(i, i + 12)) for i in range(4)] + [PROMPTS[4]]
    decodings = [Decoding(0.0), Decoding(1.0, top_k=10), Decoding(0.0), Decoding(0.8), Decoding(0.0)]
    alone = [_alone(model, p, d, seed=5) for p, d in zip(prompts, decodings, strict=True)]
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=8)
    batches: list[int] = []
    prefill = model.prefill
    monkeypatch.setattr(model, "prefill", lambda idx, cache: batches.append(idx.size(0)) or prefill(idx, cache))
    rows = [_completion(p, d, row_generators(5, 1)[0]) for p, d in zip(prompts, decodings, strict=True)]
    for row in rows:
        engine.submit(row)
    while engine.running or engine.waiting:
        engine.run_once()
    assert sorted(batches) == [1, 4]
    assert [row.tokens for row in rows] == alone


def test_a_prefill_group_that_fails_half_way_leaves_no_row_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch cache fails to take the second of three prompts of one length (memory, say): all three end in
    error once, none stays in the batch, and the engine serves on."""
    model = _model("gpt2")
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=8)
    add, calls = engine.cache.add, []

    def failing_add(prefilled, row=0):
        calls.append(row)
        if len(calls) == 2:
            raise MemoryError("no room")
        return add(prefilled, row)

    monkeypatch.setattr(engine.cache, "add", failing_add)
    ended: list[bool] = []
    rows = [Completion(list(range(i, i + 6)), NEW, Decoding(0.0), SampleText(Letters(), ""),
                       lambda piece, done: done and ended.append(done)) for i in range(3)]
    for row in rows:
        engine.submit(row)
    engine.run_once()
    assert [row.finish_reason for row in rows] == ["error"] * 3 and len(ended) == 3
    assert engine.running == [] and engine.cache.rows == 0 and engine.finished == {"error": 3}
    monkeypatch.setattr(engine.cache, "add", add)
    again = _completion(PROMPTS[0], Decoding(0.0))
    engine.submit(again)
    while engine.running or engine.waiting:
        engine.run_once()
    assert again.tokens == _alone(model, PROMPTS[0], Decoding(0.0))


def test_tasks_take_turns_with_the_rows_so_a_completion_runs_at_half_speed_at_least(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page client that keeps two tasks queued (each 5 ms on a fake clock, a step 1 ms): after each task the
    rows get as much time before the next, so the completion ends in about twice its steps, and the tasks go on."""
    import types

    import inference.engine as engine_module

    now = [0.0]
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    engine = Engine(_model("gpt2"), Letters(), make_runtime("cpu", "float32"), max_batch=4)
    events: list[str] = []
    step = engine._step
    monkeypatch.setattr(engine, "_step", lambda: (events.append("S"), now.__setitem__(0, now[0] + 0.001), step()))

    def render() -> None:
        events.append("T")
        now[0] += 0.005
        if events.count("T") < 100:
            engine.call(render)

    engine.call(render)
    engine.call(render)
    row = _completion(PROMPTS[0], Decoding(0.0))
    engine.submit(row)
    while not row.done:
        engine.run_once()
    during = "".join(events)
    assert during.count("S") == NEW - 1 and 6 <= during.count("T") <= NEW // 5 + 1, during  # prefill: token 1
    assert all(len(between) >= 5 for between in during.split("T")[1:-1]), during  # 5 ms of steps per task
    assert row.tokens == _alone(engine.model, PROMPTS[0], Decoding(0.0))
    while engine.tasks:  # idle rows: the page's work runs on, one task a run_once
        engine.run_once()
    assert events.count("T") >= 100


def test_an_echoed_prompt_is_scored_in_bounded_passes_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt past the context, echoed with logprobs and max_tokens=0, scored PREFILL_CHUNK positions a pass
    as tasks between steps: a completion submitted after it ends first, and the scores equal one pass's."""
    import inference.scoring as scoring

    model = _model("short")  # block_size 16
    prompt = [(7 * i) % 50 for i in range(300)]
    whole = [s.logprob for part in scoring.prompt_scores(model, make_runtime("cpu", "float32"), prompt, 2)
             for s in part]
    monkeypatch.setattr(scoring, "PREFILL_CHUNK", 32)  # 2 windows of 16 a pass
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=4)
    sizes: list[int] = []
    hidden = model.hidden
    monkeypatch.setattr(model, "hidden", lambda idx, *cache: sizes.append(idx.numel()) or hidden(idx, *cache))
    echoed, gone = _completion(prompt, Decoding(0.0)), _completion(prompt, Decoding(0.0))
    for row in (echoed, gone):
        row.max_new_tokens, row.logprobs, row.score_prompt = 0, 2, True
    short = _completion(PROMPTS[0], Decoding(0.0))
    for row in (echoed, gone, short):
        engine.submit(row)
    assert engine.load == (0, 3)
    engine.run_once()
    assert engine.load == (3, 0) and engine.scoring == [echoed, gone]  # scoring holds its place in the batch
    gone.cancelled = True  # its client left: it ends at its next turn
    while not short.done:
        engine.run_once()
    assert gone.finish_reason == "cancelled" and not echoed.done and max(sizes) <= 32
    while not echoed.done:
        engine.run_once()
    assert echoed.finish_reason == "length" and engine.load == (0, 0)
    assert [s.logprob for s in echoed.prompt_scores] == pytest.approx(whole, abs=1e-5)
    assert short.tokens == _alone(model, PROMPTS[0], Decoding(0.0))


def test_the_live_page_renders_one_forward_pass_a_turn_beside_a_completion() -> None:
    """A task that returns a generator (analysis.explorer.live_page) runs one piece a turn: a completion submitted
    meanwhile decodes between the pieces, gets the tokens it gets alone, and ends
    first; the page equals the one rendered in one go."""
    from analysis.diagnostics import run_to_end
    from analysis.explorer import live_page

    model = _model("gpt2")
    ids = [(3 * i) % 50 for i in range(60)]
    tokens = [chr(65 + i % 26) for i in ids]
    whole = run_to_end(live_page(model, ids, tokens, 5, "t"))
    engine = Engine(model, Letters(), make_runtime("cpu", "float32"), max_batch=4)
    row = _completion(PROMPTS[0], Decoding(0.0))
    at = []  # the row's tokens so far, at each of the page's pieces

    def page_pieces():
        render = live_page(model, ids, tokens, 5, "t")
        while True:
            at.append(len(row.tokens))
            try:
                next(render)
            except StopIteration as done:
                return done.value
            yield

    page = engine.call(page_pieces)
    engine.submit(row)
    while not row.done:
        engine.run_once()
    assert not page.done() and len(set(at)) > NEW // 2  # pieces all along the row's decoding
    assert row.tokens == _alone(model, PROMPTS[0], Decoding(0.0))
    while not page.done():
        engine.run_once()
    assert page.result() == whole and len(at) == 60 - 5 + 3  # the maps, the prompt, each step, then the page
