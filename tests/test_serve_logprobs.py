"""serve.py for evaluation clients: past a learned-position model's context as sample.py goes, token
log-probabilities (logprobs, echo, streamed too), prompts as token ids, and vLLM's tokenizer endpoints, which
lm-evaluation-harness's local-completions uses (tests/test_lm_eval_offline.py runs it)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_serve import PROMPT, sample_py

from conftest import ServeProcess

NEW = 150  # past the served run's block_size of 96, with the prompt's 6


def test_greedy_text_past_the_context_equals_sample_py(server: ServeProcess, served_run: Path) -> None:
    answer = server.client().completions.create(model="run", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == NEW
    assert sample_py(served_run, "temperature=0", "num_samples=1", f"max_new_tokens={NEW}") == [answer.choices[0].text]


def test_seeded_samples_past_the_context_equal_sample_py(server: ServeProcess, served_run: Path) -> None:
    answer = server.client().completions.create(model="run", prompt=PROMPT, max_tokens=NEW, temperature=0.9, n=2,
                                                seed=42, extra_body={"top_k": 20})
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    assert texts == sample_py(served_run, "seed=42", "temperature=0.9", "top_k=20", "num_samples=2",
                              f"max_new_tokens={NEW}")


def test_echo_scores_equal_the_scores_reported_as_the_tokens_were_generated(server: ServeProcess) -> None:
    """logprobs=3 on a sampled completion past the context, then echo of the same text with max_tokens=0: the
    same log-probabilities (those of the model, before temperature and top_k), the same alternatives."""
    client = server.client()
    made = client.completions.create(model="run", prompt=PROMPT, max_tokens=120, temperature=1.0, seed=3,
                                     logprobs=3, extra_body={"top_k": 10}).choices[0]
    assert len(made.logprobs.tokens) == 120 and "".join(made.logprobs.tokens) == made.text
    assert made.logprobs.text_offset[:3] == [0, 1, 2]
    assert all(len(top) == 3 and max(top.values()) >= lp for top, lp in
               zip(made.logprobs.top_logprobs, made.logprobs.token_logprobs, strict=True))
    echoed = client.completions.create(model="run", prompt=PROMPT + made.text, max_tokens=0, echo=True,
                                       logprobs=3).choices[0]
    assert echoed.text == PROMPT + made.text and echoed.finish_reason == "length"
    scores = echoed.logprobs
    assert scores.tokens == list(PROMPT + made.text) and scores.token_logprobs[0] is None
    assert scores.top_logprobs[0] is None and scores.text_offset == list(range(len(PROMPT) + 120))
    again = scores.token_logprobs[len(PROMPT):]
    assert again == pytest.approx(made.logprobs.token_logprobs, abs=1e-4)
    assert [sorted(t) for t in scores.top_logprobs[len(PROMPT):]] == [sorted(t) for t in made.logprobs.top_logprobs]
    assert math.fsum(math.exp(p) for p in scores.top_logprobs[1].values()) <= 1 + 1e-6


def test_streamed_logprobs_add_up_to_the_whole_answer_s(server: ServeProcess) -> None:
    client = server.client()
    kwargs = dict(model="run", prompt=PROMPT, max_tokens=150, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**kwargs, stream=True) if chunk.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert all("".join(c.logprobs.tokens) == c.text for c in chunks)  # each chunk its own tokens' (however many)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in getattr(c.logprobs, key)] == getattr(whole.logprobs, key)


def test_prompts_as_token_ids_and_the_tokenizer_endpoints(server: ServeProcess) -> None:
    ids = server.post({"prompt": PROMPT}, "/tokenize").json()["tokens"]
    assert len(ids) == len(PROMPT)
    assert server.post({"tokens": ids}, "/detokenize").json() == {"prompt": PROMPT}
    assert server.http.get("/tokenizer_info").json()["eos_token"] is None  # characters: no end-of-text token
    by_text = server.post({"prompt": PROMPT, "max_tokens": 20, "temperature": 0}).json()["choices"][0]["text"]
    by_ids = server.post({"prompt": [ids, ids], "max_tokens": 20, "temperature": 0}).json()["choices"]
    assert [c["text"] for c in by_ids] == [by_text, by_text]


def test_tokenize_gives_end_of_text_its_one_token_as_vllm_does() -> None:
    """lm-eval reads the end-of-text id as /tokenize's first token for the tokenizer_info's eos_token: one token,
    not the ordinary tokens that spell it (prompts themselves are tokenized as sample.py tokenizes them)."""
    from conftest import tiny_encoding
    from data.tokenizers import BpeTokenizer
    from inference.sampling import ServeConfig
    from inference.server import Service

    tokenizer = BpeTokenizer(tiny_encoding())
    service = Service(None, tokenizer, "bpe", ServeConfig(out_dir="unused"))
    end = tokenizer.end_of_text_id
    assert service.encode("<|endoftext|>", True) == [end]
    assert service.encode("and<|endoftext|>the", True) == [*tokenizer.encode("and"), end, *tokenizer.encode("the")]
    assert service.encode("<|endoftext|>") == tokenizer.encode("<|endoftext|>") != [end]
