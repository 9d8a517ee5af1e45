"""serve.py for evaluation clients: past a learned-position model's context as sample.py goes, token
log-probabilities (logprobs, echo, streamed too), prompts as token ids, vLLM's tokenizer endpoints, and
lm-evaluation-harness's local-completions scoring a multiple-choice task through them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_serve import PROMPT, Server, sample_py

from evals.hellaswag import Example, ending_scores
from inference.sampling import load_model

NEW = 150  # past the served run's block_size of 96, with the prompt's 6


@pytest.fixture(scope="module")
def server(served_run: Path) -> Iterator[Server]:
    server = Server(served_run, "max_tokens=200")
    yield server
    server.stop()


def test_greedy_text_past_the_context_equals_sample_py(server: Server, served_run: Path) -> None:
    answer = server.client().completions.create(model="run", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == NEW
    assert sample_py(served_run, "temperature=0", "num_samples=1", f"max_new_tokens={NEW}") == [answer.choices[0].text]


def test_seeded_samples_past_the_context_equal_sample_py(server: Server, served_run: Path) -> None:
    answer = server.client().completions.create(model="run", prompt=PROMPT, max_tokens=NEW, temperature=0.9, n=2,
                                                seed=42, extra_body={"top_k": 20})
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    assert texts == sample_py(served_run, "seed=42", "temperature=0.9", "top_k=20", "num_samples=2",
                              f"max_new_tokens={NEW}")


def test_echo_scores_equal_the_scores_reported_as_the_tokens_were_generated(server: Server) -> None:
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


def test_streamed_logprobs_add_up_to_the_whole_answer_s(server: Server) -> None:
    client = server.client()
    kwargs = dict(model="run", prompt=PROMPT, max_tokens=150, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**kwargs, stream=True) if chunk.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert all("".join(c.logprobs.tokens) == c.text for c in chunks)  # each chunk its own tokens' (however many)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in getattr(c.logprobs, key)] == getattr(whole.logprobs, key)


def test_prompts_as_token_ids_and_the_tokenizer_endpoints(server: Server) -> None:
    ids = server.post({"prompt": PROMPT}, "/tokenize").json()["tokens"]
    assert len(ids) == len(PROMPT)
    assert server.post({"tokens": ids}, "/detokenize").json() == {"prompt": PROMPT}
    assert server.http.get("/tokenizer_info").json()["eos_token"] is None  # characters: no end-of-text token
    by_text = server.post({"prompt": PROMPT, "max_tokens": 20, "temperature": 0}).json()["choices"][0]["text"]
    by_ids = server.post({"prompt": [ids, ids], "max_tokens": 20, "temperature": 0}).json()["choices"]
    assert [c["text"] for c in by_ids] == [by_text, by_text]



def test_a_long_echo_is_scored_between_steps_and_a_short_completion_ends_meanwhile(server: Server) -> None:
    """2 prompts of 2,100 characters, echoed with logprobs and max_tokens=0 (past the context: hundreds of
    forward passes): a completion sent once their scoring has begun ends while it goes on, and the echo then
    ends whole."""
    import threading
    import time

    import httpx

    long = (PROMPT + " " + PROMPT.lower() + "\n") * 150  # 2,100 characters the run's tokenizer knows
    body = {"prompt": [long] * 2, "echo": True, "logprobs": 1, "max_tokens": 0}
    echoed: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: echoed.append(httpx.post(server.url + "/v1/completions", json=body,
                                                                      timeout=120)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while server.http.get("/health").json()["running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        short = server.post({"prompt": PROMPT, "max_tokens": 20, "temperature": 0})
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 20
        assert server.http.get("/health").json()["running"] == 2 and not echoed  # the echo's scoring goes on
    finally:
        thread.join(timeout=120)
    choices = echoed[0].json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["length"] * 2
    assert all(len(c["logprobs"]["token_logprobs"]) == len(long) for c in choices)


TASK = """task: shakespeare_lines
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def _task(corpus: str, count: int = 24) -> list[dict]:
    """Lines of the corpus cut in two: the true second half against three other lines' (a test's own task)."""
    lines = [line for line in corpus.splitlines()
             if 30 <= len(line) <= 60 and line == line.strip() and " " in line[10:-1]][: count * 4]
    docs = []
    for i in range(count):
        cut = lines[i].index(" ", 10)
        endings = [lines[i][cut + 1 :]] + [lines[j][lines[j].index(" ", 10) + 1 :] for j in (i + count,
                                                                                              i + 2 * count,
                                                                                              i + 3 * count)]
        label = i % 4
        endings[0], endings[label] = endings[label], endings[0]
        docs.append({"context": lines[i][:cut], "endings": endings, "label": label})
    return docs


def test_lm_eval_scores_a_task_through_the_server_as_the_project_does_directly(
    server: Server, served_run: Path, corpus_path: Path, tmp_path: Path
) -> None:
    """lm-evaluation-harness's local-completions (tokenizer found through /tokenizer_info): its accuracy equals
    the project's own multiple-choice scoring (evals/hellaswag.py's summed log-likelihood) of the same task."""
    docs = _task(corpus_path.read_text(encoding="utf-8"))
    data = tmp_path / "lines.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "shakespeare_lines.yaml").write_text(TASK.format(data=data), encoding="utf-8")
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model=run,base_url={server.url}/v1/completions", "--tasks", "shakespeare_lines",
               "--include_path", str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out"), "--log_samples"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PATH": "/usr/bin:/bin"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    lm_eval_acc = report["results"]["shakespeare_lines"]["acc,none"]

    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    theirs = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}  # per ending: its log-lik.

    loaded = load_model(str(served_run), None, "latest", None)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    correct = 0
    for i, doc in enumerate(docs):
        example = Example(tokenizer.encode(doc["context"]), [tokenizer.encode(" " + e) for e in doc["endings"]],
                          doc["label"])
        sums, _ = ending_scores(model, example, model.config.block_size, torch.device("cpu"))
        assert theirs[i] == pytest.approx(sums.tolist(), abs=1e-4)
        correct += int(sums.argmax()) == doc["label"]
    assert lm_eval_acc == pytest.approx(correct / len(docs), abs=1e-9)


def test_tokenize_gives_end_of_text_its_one_token_as_vllm_does() -> None:
    """lm-eval reads the end-of-text id as /tokenize's first token for the tokenizer_info's eos_token: one token,
    not the ordinary tokens that spell it (prompts themselves are tokenized as sample.py tokenizes them)."""
    from conftest import tiny_encoding
    from data.tokenizers import BpeTokenizer
    from inference.schema import ServeConfig
    from inference.server import Service

    tokenizer = BpeTokenizer(tiny_encoding())
    service = Service(None, tokenizer, "bpe", ServeConfig(out_dir="unused"))
    end = tokenizer.end_of_text_id
    assert service.encode("<|endoftext|>", True) == [end]
    assert service.encode("and<|endoftext|>the", True) == [*tokenizer.encode("and"), end, *tokenizer.encode("the")]
    assert service.encode("<|endoftext|>") == tokenizer.encode("<|endoftext|>") != [end]
