"""serve.py on loopback, driven by the official openai client and by raw HTTP: the API's answers, its equality with
sample.py, log-probabilities and the tokenizer endpoints lm-eval uses (test_lm_eval_offline.py runs it), every bad
request refused with OpenAI's error object (and the server still serving), who may reach it, its limits, requests
taking turns on the model (a short one never waits for a long one to end), a client that leaves or stops reading,
and a clean stop."""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from conftest import REPO, ServeProcess, refused, run_in_process, tiny_encoding
from data.tokenizers import BpeTokenizer
from inference.sampling import SEPARATOR
from inference.server import Service, bind
from serve import ServeConfig

PROMPT = "ROMEO:"
NEW = 110  # past the served run's block_size of 96, with the prompt's 6


@pytest.fixture(scope="module")
def impatient(served_run: Path) -> Iterator[ServeProcess]:
    """A server whose requests time out at once, that takes two connections and has small limits of its own; it must
    stop with no traceback and no warning (a "coroutine ... was never awaited")."""
    server = ServeProcess(served_run, "timeout_s=0.02", "max_connections=2", "max_choices=2", "max_body_bytes=20000",
                          "max_prompt_tokens=300", "max_request_tokens=240")
    yield server
    _, stderr = server.stop()
    assert "Warning" not in stderr and "Traceback" not in stderr, stderr


def sample_py(run: Path, *overrides: str) -> list[str]:
    """sample.py's samples, each without the prompt (the command run in this process)."""
    args = [f"out_dir={run}", f"start={PROMPT}", "device=cpu", "stream=false", *overrides]
    result = run_in_process("sample.py", args, run.parent)
    assert result.returncode == 0, result.stderr
    return [text.removeprefix(PROMPT) for text in result.stdout.split(SEPARATOR)[:-1]]


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]


def test_models_lists_the_run_by_a_name_requests_can_use(server: ServeProcess, served_run: Path) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [served_run.name]
    assert server.client().completions.create(model=models[0].id, prompt=PROMPT, max_tokens=3).model == served_run.name


def test_greedy_and_seeded_text_equal_sample_py_s_past_the_context(server: ServeProcess, served_run: Path) -> None:
    """Greedy text is sample.py's at temperature=0, and choice i of a request with seed S is sample.py's sample i at
    seed=S (each from its own generator), past the model's context too."""
    greedy = server.client().completions.create(model="run", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert greedy.choices[0].finish_reason == "length"
    assert (greedy.usage.prompt_tokens, greedy.usage.completion_tokens, greedy.usage.total_tokens) == (
        len(PROMPT), NEW, len(PROMPT) + NEW)
    assert sample_py(served_run, "temperature=0", "num_samples=1", f"max_new_tokens={NEW}") == [greedy.choices[0].text]
    kwargs = dict(model="run", prompt=PROMPT, max_tokens=NEW, temperature=0.9, n=2, seed=1234, extra_body={"top_k": 20})
    texts = [c.text for c in sorted(server.client().completions.create(**kwargs).choices, key=lambda c: c.index)]
    again = [c.text for c in sorted(server.client().completions.create(**kwargs).choices, key=lambda c: c.index)]
    assert texts == again and len(set(texts)) > 1  # sampled, not greedy, and repeated
    ours = sample_py(served_run, "seed=1234", "temperature=0.9", "top_k=20", "num_samples=2", f"max_new_tokens={NEW}")
    assert ours == texts


def test_streamed_chunks_add_up_to_the_whole_answer(server: ServeProcess) -> None:
    """Each choice's chunks add up to its text (the echo first) and its logprobs, each chunk its own tokens'."""
    kwargs = dict(model="run", prompt=[PROMPT, "JULIET:"], max_tokens=50, temperature=0, n=2, logprobs=2, echo=True)
    whole = server.client().completions.create(**kwargs)
    chunks: dict[int, list] = {}
    for chunk in server.client().completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            chunks.setdefault(choice.index, []).append(choice)
    assert sorted(chunks) == [0, 1, 2, 3] and whole.usage.prompt_tokens == len(PROMPT) + len("JULIET:")  # once each
    for choice in whole.choices:
        pieces = chunks[choice.index]
        assert "".join(c.text for c in pieces) == choice.text and pieces[-1].finish_reason == "length"
        assert all("".join(c.logprobs.tokens) == c.text for c in pieces)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in pieces for v in getattr(c.logprobs, key)] == getattr(choice.logprobs, key)
    body = {"prompt": PROMPT, "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
    raw = server.post(body).text
    chunks = _events(raw.splitlines())
    assert raw.rstrip().endswith("data: [DONE]") and len("".join(c["choices"][0]["text"] for c in chunks[:-1])) == 30
    assert len({(c["id"], c["created"]) for c in chunks}) == 1  # one id and one time for the whole stream
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 30, "total_tokens": 36}


def test_stop_strings_end_the_text_before_them_as_in_sample_py(server: ServeProcess, served_run: Path) -> None:
    kwargs = dict(model="run", prompt=PROMPT, max_tokens=60, temperature=1.0, seed=7)
    whole = server.client().completions.create(**kwargs).choices[0].text
    stop = next(c for c in whole if c.isalpha())  # a letter the text holds
    choice = server.client().completions.create(**kwargs, stop=[stop, "zzz"]).choices[0]
    assert choice.finish_reason == "stop" and choice.text == whole[: whole.index(stop)]
    streamed = "".join(c.choices[0].text for c in server.client().completions.create(**kwargs, stop=stop, stream=True))
    assert streamed == choice.text
    ours = sample_py(served_run, "seed=7", "temperature=1.0", "num_samples=1", "max_new_tokens=60", f"stop=[{stop}]")
    assert ours == [choice.text]


def test_echo_scores_equal_the_scores_reported_as_the_tokens_were_generated(server: ServeProcess) -> None:
    """logprobs=3 on a sampled completion past the context, then echo of the same text with max_tokens=0: the
    same log-probabilities (those of the model, before temperature and top_k), the same alternatives."""
    client = server.client()
    made = client.completions.create(model="run", prompt=PROMPT, max_tokens=120, temperature=1.0, seed=3,
                                     logprobs=3, extra_body={"top_k": 10}).choices[0]
    assert len(made.logprobs.tokens) == 120 and "".join(made.logprobs.tokens) == made.text
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


def test_prompts_as_token_ids_and_the_tokenizer_endpoints(server: ServeProcess) -> None:
    ids = server.post({"prompt": PROMPT}, "/tokenize").json()["tokens"]
    assert len(ids) == len(PROMPT)
    assert server.post({"tokens": ids}, "/detokenize").json() == {"prompt": PROMPT}
    assert server.http.get("/tokenizer_info").json()["eos_token"] is None  # characters: no end-of-text token
    by_text = server.post({"prompt": PROMPT, "max_tokens": 20, "temperature": 0}).json()["choices"][0]["text"]
    by_ids = server.post({"prompt": [ids, ids], "max_tokens": 20, "temperature": 0}).json()["choices"]
    assert [c["text"] for c in by_ids] == [by_text, by_text]
    # lm-eval reads /tokenize's first token as the tokenizer_info's eos_token's id: one token, not the ordinary
    # tokens that spell it (prompts themselves are tokenized as sample.py tokenizes them)
    tokenizer = BpeTokenizer(tiny_encoding())
    service = Service(None, tokenizer, "bpe", ServeConfig(out_dir="unused"))
    end = tokenizer.end_of_text_id
    assert service.encode("<|endoftext|>", True) == [end]
    assert service.encode("and<|endoftext|>the", True) == [*tokenizer.encode("and"), end, *tokenizer.encode("the")]
    assert service.encode("<|endoftext|>") == tokenizer.encode("<|endoftext|>") != [end]


BAD_REQUESTS = [
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "max_tokens=0 must be at least 1 (0 with echo=true)"),
    ({"prompt": PROMPT, "max_tokens": 2049, "n": 2}, 400, "max_tokens",
     "max_tokens=2049 for 2 choice(s) asks for 4098 tokens; this server generates at most 4096 a request "
     "(max_request_tokens)"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": PROMPT, "temperature": "0.5"}, 400, "temperature", "temperature: Input should be a valid number"),
    ({"prompt": PROMPT, "temperature": 3}, 400, "temperature", "temperature: Input should be less than or equal to 2"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p", "top_p: Input should be greater than 0 (got 0)"),
    ({"prompt": PROMPT, "top_k": 0}, 400, "top_k", "top_k: Input should be greater than or equal to 1"),
    ({"prompt": PROMPT, "min_p": 2}, 400, "min_p", "min_p: Input should be less than or equal to 1"),
    ({"prompt": PROMPT, "seed": -5}, 400, "seed", "seed: Input should be greater than or equal to 0"),
    ({"prompt": PROMPT, "n": 17}, 400, "n", "17 choices; this server takes at most 16 a request (max_choices)"),
    ({"prompt": PROMPT, "n": 0}, 400, "n", "n: Input should be greater than or equal to 1"),
    ({"prompt": PROMPT, "stop": ["", "x"]}, 400, "stop", "stop has an empty string"),
    ({"prompt": PROMPT, "stop": list("abcde")}, 400, "stop", "stop takes at most 4 strings of at most 256 characters"),
    ({"prompt": PROMPT, "best_of": 3}, 400, "best_of", "best_of=3 is not supported"),
    ({"prompt": PROMPT, "logprobs": 6}, 400, "logprobs", "logprobs: Input should be less than or equal to 5"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model", "model 'gpt-4' does not exist; this server serves"),
    ({"prompt": ""}, 400, "prompt", "prompt is empty"),
    ({"prompt": [[3, 4], []]}, 400, "prompt", "prompt is empty; give at least one character or token id"),
    ({"prompt": [5, 99999]}, 400, "prompt", "token id 99999 is not in this model's vocabulary (0 to "),
    ({"prompt": ["x" * 4097] * 2}, 400, "prompt", "the prompts have 8194 tokens; this server takes at most 8192 a "
     "request (max_prompt_tokens)"),
    ({"prompt": "ROMEO: Ω"}, 400, "prompt", "character 'Ω' is not in the model's vocabulary"),
    ({"max_tokens": 5}, 400, "prompt", "prompt: Field required"),
]


@pytest.mark.parametrize(("body", "status", "param", "message"), BAD_REQUESTS, ids=[m for *_, m in BAD_REQUESTS])
def test_a_bad_request_is_refused_naming_the_field_and_the_server_goes_on(
    server: ServeProcess, body: dict, status: int, param: str, message: str
) -> None:
    response = server.post(body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert server.post({"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_malformed_oversized_and_unmeasured_bodies_are_refused_too(server: ServeProcess) -> None:
    headers = {"content-type": "application/json"}
    cases = [
        (server.http.post("/v1/completions", content=b'{"prompt": "ROMEO:", ', headers=headers), 400, "not valid JSON"),
        (server.http.post("/v1/completions", content=b"\xff\xfe", headers=headers), 400, "not valid JSON"),
        (server.post({"prompt": "x" * 1_000_000}), 413, "larger than 1000000 bytes"),
        (server.http.post("/v1/completions", content=iter([b'{"prompt": "x"}'])), 411, "Content-Length"),  # chunked
        (server.http.get("/v1/nothing"), 404, "no such endpoint"),
    ]
    for response, status, message in cases:
        assert response.status_code == status and message in response.json()["error"]["message"], response.text
    with pytest.raises(openai.BadRequestError, match="asks for 5000 tokens; this server generates at most 4096"):
        server.client().completions.create(model="run", prompt=PROMPT, max_tokens=5000)


def test_concurrent_requests_each_get_the_text_they_get_alone(server: ServeProcess) -> None:
    """They take turns for the model: greedy text is identical."""
    prompts = ["ROMEO:", "First Citizen:\nBefore we", "KING", "O", "To be, or not to be, that", "JULIET:\nAh me"]

    def ask(prompt: str) -> str:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 50, "temperature": 0})
            return answer.json()["choices"][0]["text"]

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == alone


def _unread_request(server: ServeProcess, body: dict) -> socket.socket:
    """The request sent on a socket of its own that nothing reads; closing it is a client that leaves."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def _wait_for(server: ServeProcess, what: str, running: int, cancelled: int | None = None) -> None:
    """Until `running` requests are under way and, if given, `cancelled` choices have ended so; the 60 s limit only
    catches a hang."""
    deadline = time.monotonic() + 60
    while (health := server.http.get("/health").json())["running"] != running or (
            cancelled is not None and health["finished"].get("cancelled") != cancelled):
        assert time.monotonic() < deadline, f"{what}: {health}"
        time.sleep(0.02)


def test_a_full_queue_answers_503_and_a_client_that_leaves_mid_stream_frees_the_model(served_run: Path) -> None:
    server = ServeProcess(served_run, "max_queue=0")
    try:
        with server.http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000,
                                                                  "stream": True}) as r:
            lines = r.iter_lines()  # kept: its end would close the stream
            assert next(lines).startswith("data: ")
            # the model is this stream's and nothing may wait: the next request is turned away
            busy = server.post({"prompt": PROMPT, "max_tokens": 2})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "server_busy"
        _wait_for(server, "the stream outlived its client", running=0, cancelled=1)
        assert server.post({"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


def test_a_request_past_timeout_s_is_cancelled_with_504(impatient: ServeProcess) -> None:
    response = impatient.post({"prompt": PROMPT, "max_tokens": 90})
    assert response.status_code == 504 and response.json()["error"]["type"] == "timeout", response.text
    streamed = impatient.post({"prompt": PROMPT, "max_tokens": 90, "stream": True}).text
    assert '"type": "timeout"' in streamed and streamed.rstrip().endswith("data: [DONE]")
    _wait_for(impatient, "a request past its time kept the model", running=0)


def test_the_limits_a_server_is_started_with_are_the_ones_it_holds(impatient: ServeProcess) -> None:
    cases = [({"prompt": PROMPT, "n": 3}, 400, "3 choices; this server takes at most 2 a request (max_choices)"),
             ({"prompt": "x" * 30000}, 413, "larger than 20000 bytes"),
             ({"prompt": "x" * 301}, 400, "301 tokens; this server takes at most 300 a request (max_prompt_tokens)"),
             ({"prompt": PROMPT, "max_tokens": 241}, 400, "this server generates at most 240 a request")]
    for body, status, message in cases:
        response = impatient.post(body)
        assert response.status_code == status and message in response.json()["error"]["message"], response.text


def test_past_max_connections_the_503_is_openai_s_error_object(impatient: ServeProcess) -> None:
    """Two connections are let in, idle or not, and a third is refused."""
    impatient.http.close()  # earlier tests' keep-alive connection would count as one more
    impatient.http = httpx.Client(base_url=impatient.url, timeout=60)
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=impatient.url) as first, httpx.Client(base_url=impatient.url) as second:
        # both answered, so both are open and counted; a 503 means closed connections are still counted: again
        while any(client.get("/health").status_code == 503 for client in (first, second)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        busy = httpx.post(f"{impatient.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})  # a third
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
    error = busy.json()["error"]
    assert error["type"] == "server_busy" and "(max_connections)" in error["message"], error
    while (answer := impatient.http.get("/health")).status_code == 503:  # until the two are gone
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.05)


HEAVY = {  # the longest work the default limits allow, a request each
    "max_tokens=4096": {"prompt": PROMPT, "max_tokens": 4096},
    "max_tokens=256, n=16, streamed": {"prompt": PROMPT, "max_tokens": 256, "n": 16, "stream": True},
    "an echo of 8,192 tokens with logprobs": {"prompt": ("ROMEO:" * 1366)[:8192], "max_tokens": 0, "echo": True,
                                              "logprobs": 1},
}


def test_a_short_request_ends_before_any_long_one_under_way_and_a_client_that_leaves_frees_the_model(
    server: ServeProcess,
) -> None:
    """Requests take turns on the model a slice at a time, so a short one behind the longest request the default
    limits allow ends first, and that request still runs; once its client leaves, its choices end as cancelled."""
    for name, body in HEAVY.items():
        before = server.http.get("/health").json()["finished"]
        heavy = _unread_request(server, body)
        _wait_for(server, f"{name} never started", running=1)
        short = server.post({"prompt": PROMPT, "max_tokens": 20})
        assert short.status_code == 200 and len(short.json()["choices"][0]["text"]) == 20, short.text
        health = server.http.get("/health").json()
        assert health["running"] == 1, (name, health)  # still under way
        assert health["finished"] == {**before, "length": before.get("length", 0) + 1}, (name, health)
        heavy.close()
        cancelled = before.get("cancelled", 0) + body.get("n", 1)
        _wait_for(server, f"{name} outlived its client", running=0, cancelled=cancelled)


def test_a_stream_whose_client_stops_reading_ends_at_timeout_s(served_run: Path) -> None:
    """The client keeps its connection and reads nothing: the model goes on serving others, and the stream ends by
    timeout_s (with the send queue full, a send that waits past it closes the connection)."""
    server = ServeProcess(served_run, "timeout_s=3")
    try:  # each choice's first event echoes the prompt's logprobs: 16 x 400 kB, more than the socket's buffers take
        body = {"prompt": "ROMEO:" * 400, "echo": True, "logprobs": 5, "max_tokens": 256, "n": 16, "stream": True}
        stalled = _unread_request(server, body)
        _wait_for(server, "the stream never started", running=1)
        assert server.post({"prompt": PROMPT, "max_tokens": 20}).status_code == 200
        _wait_for(server, "a stalled reader kept its request", running=0, cancelled=16)
        stalled.close()
    finally:
        _, stderr = server.stop()
    assert "Traceback" not in stderr, stderr


def test_a_stop_lets_the_stream_in_flight_finish_and_ends_the_next_with_an_error_event(served_run: Path) -> None:
    """SIGTERM with one stream near its end and one far from it behind: the first ends whole; shutdown_s later the
    second gets OpenAI's error object and data: [DONE], and the server exits with no traceback."""
    server = ServeProcess(served_run, "shutdown_s=3", "max_request_tokens=65536")
    near, far = [], []

    def stream(lines: list[str], body: dict) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "stream": True, **body}) as r:
                lines.extend(r.iter_lines())

    threads = [threading.Thread(target=stream, args=(near, {"max_tokens": 300})),
               threading.Thread(target=stream, args=(far, {"max_tokens": 4096, "n": 16}))]  # seconds of work
    threads[0].start()
    deadline = time.monotonic() + 60  # bounds a hang: each wait ends on what the server says
    while len(near) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    threads[1].start()
    while server.http.get("/health").json()["running"] < 2:  # far: under way beside near
        assert time.monotonic() < deadline and "data: [DONE]" not in near, "the second stream never started"
        time.sleep(0.01)
    started = time.monotonic()
    status, stderr = server.stop(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=30)
    assert time.monotonic() - started < 10 and status in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    assert "Traceback" not in stderr and "ASGI" not in stderr, stderr
    assert "data: [DONE]" in near and len("".join(c["choices"][0]["text"] for c in _events(near))) == 300
    events = [line.removeprefix("data: ") for line in far if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_unavailable" and "shutting down" in error["message"]


def test_an_api_key_is_required_when_set_and_compared_as_utf8(served_run: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPT_LAB_API_KEY", "sécret")  # the key's variable: kept off the command line
    server = ServeProcess(served_run)
    try:
        utf8 = {"Authorization": "Bearer sécret".encode()}
        wrong = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sécret".encode()},
                 {"Authorization": "Bearer sécret".encode("latin-1")})
        for headers in wrong:
            response = server.post({"prompt": PROMPT, "max_tokens": 2}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", headers
        assert server.http.get("/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").completions.create(model="run", prompt=PROMPT, max_tokens=2)
        assert len(server.post({"prompt": PROMPT, "max_tokens": 2}, headers=utf8).json()["choices"][0]["text"]) == 2
        assert server.http.get("/health").json() == {"status": "ok"}  # alive, for a load balancer's checks: no more
        full = server.http.get("/health", headers=utf8).json()
        assert full["finished"]["length"] == 1 and full["running"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize(("host", "message"), [
    ("0.0.0.0", "error: host=0.0.0.0 listens on every interface with no API key, so anyone who reaches the port can "
     "use the model; set api_key=KEY (or $GPT_LAB_API_KEY), or allow_no_api_key=true\n"),
    ("", "error: host= listens on every interface with no API key"),
    ("999.1.1.1", "error: host=999.1.1.1 is not an address of this machine ("),
    ("127.0.0.1", "error: can't listen on host=127.0.0.1 port=PORT (Address already in use); pick another port\n"),
])
def test_a_host_beyond_loopback_without_a_key_not_this_machine_s_or_a_port_in_use_is_one_line(
    server: ServeProcess, served_run: Path, host: str, message: str
) -> None:
    port = server.url.rsplit(":", 1)[1] if host == "127.0.0.1" else "0"  # the running server's: in use
    result = run_in_process("serve.py", [f"out_dir={served_run}", f"host={host}", f"port={port}", "device=cpu"],
                            served_run.parent)
    message = message.replace("PORT", port)
    assert refused(result).startswith(message.rstrip("\n"))


def test_every_interface_said_so_starts_and_says_where(served_run: Path) -> None:
    args = [sys.executable, str(REPO / "serve.py"), f"out_dir={served_run}", "host=0.0.0.0", "port=0", "device=cpu",
            "allow_no_api_key=true"]
    process = subprocess.Popen(args, cwd=served_run.parent, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert "at http://0.0.0.0:" in line and "every interface, no API key" in line, line


def test_a_loopback_server_answers_only_its_own_names(server: ServeProcess) -> None:
    """No DNS rebinding: a web page's request names its own host."""
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", "localhost.evil.example"):
        response = server.post({"prompt": PROMPT, "max_tokens": 2}, headers={"Host": host})
        assert response.status_code == 400 and response.text == "Invalid host header", (host, response.text)
        assert server.http.get("/", headers={"Host": host}).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):  # IPv6 in brackets
        assert server.post({"prompt": PROMPT, "max_tokens": 2}, headers={"Host": host}).status_code == 200


def test_the_server_s_socket_names_tcp_so_each_chunk_goes_at_once() -> None:
    """asyncio sets TCP_NODELAY only on connections of a socket naming IPPROTO_TCP: without it, Nagle held a stream's
    chunks after the headers until the client's delayed ACK (40 ms on Linux), so they all came with the last."""
    with bind("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP
