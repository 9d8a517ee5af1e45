"""serve.py on loopback, driven by the official openai client and by raw HTTP: the API's answers, its equality with
sample.py, every bad request refused with OpenAI's error object (and the server still serving), auth, limits, a
client that leaves, and a clean stop."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ServeProcess, run_in_process
from inference.sampling import SEPARATOR
from inference.server import bind

PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def server(served_run: Path) -> Iterator[ServeProcess]:
    """This module's own server (not conftest's shared one): the limits its tests reach."""
    server = ServeProcess(served_run, "max_request_tokens=240", "max_choices=8", "max_body_bytes=20000",
                          "max_prompt_tokens=300")
    yield server
    server.stop()


def sample_py(run: Path, *overrides: str) -> list[str]:
    """sample.py's samples, each without the prompt (the command run in this process)."""
    args = [f"out_dir={run}", f"start={PROMPT}", "device=cpu", "stream=false", *overrides]
    result = run_in_process("sample.py", args, run.parent)
    assert result.returncode == 0, result.stderr
    return [text.removeprefix(PROMPT) for text in result.stdout.split(SEPARATOR)[:-1]]


def _streamed_text(lines: list[str]) -> str:
    """The text of a one-choice stream's chunks (several tokens may share one)."""
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    return "".join(chunk["choices"][0]["text"] for chunk in chunks)


def test_models_lists_the_run_by_a_name_requests_can_use(server: ServeProcess, served_run: Path) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [served_run.name]
    answer = server.client().completions.create(model=models[0].id, prompt=PROMPT, max_tokens=3)
    assert answer.model == served_run.name
    assert server.http.get("/health").json()["status"] == "ok"


def test_greedy_text_equals_sample_py_byte_for_byte(server: ServeProcess, served_run: Path) -> None:
    answer = server.client().completions.create(model="run", prompt=PROMPT, max_tokens=60, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and len(choice.text) == 60
    assert sample_py(served_run, "temperature=0", "num_samples=1", "max_new_tokens=60") == [choice.text]
    assert answer.usage.prompt_tokens == len(PROMPT) and answer.usage.completion_tokens == 60
    assert answer.usage.total_tokens == len(PROMPT) + 60


def test_a_seed_gives_sample_py_s_samples_and_repeats(server: ServeProcess, served_run: Path) -> None:
    """Choice i of a request with seed S draws what sample.py's sample i draws with seed=S."""
    kwargs = dict(model="run", prompt=PROMPT, max_tokens=40, temperature=0.9, n=3, seed=1234)
    extra = {"top_k": 20}
    first = server.client().completions.create(**kwargs, extra_body=extra)
    again = server.client().completions.create(**kwargs, extra_body=extra)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # sampled, not greedy
    ours = sample_py(served_run, "seed=1234", "temperature=0.9", "top_k=20", "num_samples=3", "max_new_tokens=40")
    assert ours == texts


def test_streamed_chunks_add_up_to_the_whole_text(server: ServeProcess) -> None:
    kwargs = dict(model="run", prompt=[PROMPT, "JULIET:"], max_tokens=50, temperature=0, n=2)
    whole = server.client().completions.create(**kwargs)
    pieces: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in server.client().completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason
    assert sorted(pieces) == [0, 1, 2, 3]
    assert [pieces[c.index] for c in whole.choices] == [c.text for c in whole.choices]
    assert set(reasons.values()) == {"length"}
    assert whole.usage.prompt_tokens == len(PROMPT) + len("JULIET:")  # each prompt once, not once per choice
    raw = server.post({"prompt": PROMPT, "max_tokens": 5, "stream": True}).text
    assert raw.rstrip().endswith("data: [DONE]")
    assert len(_streamed_text(raw.splitlines())) == 5
    body = {"prompt": PROMPT, "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
    lines = server.post(body).text.splitlines()
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1  # one id and one time for the whole stream
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 30, "total_tokens": 36}


def test_stop_strings_end_the_text_before_them_as_in_sample_py(server: ServeProcess, served_run: Path) -> None:
    kwargs = dict(model="run", prompt=PROMPT, max_tokens=60, temperature=1.0, seed=7)
    whole = server.client().completions.create(**kwargs).choices[0].text
    stop = next(c for c in whole if c.isalpha())  # a letter the text holds
    answer = server.client().completions.create(**kwargs, stop=[stop, "zzz"])
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == whole[: whole.index(stop)]
    streamed = "".join(c.choices[0].text for c in server.client().completions.create(**kwargs, stop=stop, stream=True))
    assert streamed == choice.text
    ours = sample_py(served_run, "seed=7", "temperature=1.0", "num_samples=1", "max_new_tokens=60", f"stop=[{stop}]")
    assert ours == [choice.text]


BAD_REQUESTS = [
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "max_tokens=0 must be at least 1 (0 with echo=true)"),
    ({"prompt": PROMPT, "max_tokens": 121, "n": 2}, 400, "max_tokens",
     "max_tokens=121 for 2 choice(s) asks for 242 tokens; this server generates at most 240 a request "
     "(max_request_tokens)"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature", "temperature: Input should be a valid number"),
    ({"prompt": PROMPT, "temperature": "0.5"}, 400, "temperature", "temperature: Input should be a valid number"),
    ({"prompt": PROMPT, "temperature": 3}, 400, "temperature", "temperature=3.0 must be between 0 and 2"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p", "top_p=0.0 must be in (0, 1]"),
    ({"prompt": PROMPT, "top_p": 1.5}, 400, "top_p", "top_p=1.5 must be in (0, 1]"),
    ({"prompt": PROMPT, "top_k": 0}, 400, "top_k", "top_k=0 must be at least 1"),
    ({"prompt": PROMPT, "min_p": 2}, 400, "min_p", "min_p=2.0 must be in (0, 1]"),
    ({"prompt": PROMPT, "seed": -5}, 400, "seed", "seed=-5 must be between 0 and"),
    ({"prompt": PROMPT, "n": 9}, 400, "n", "asks for 9 choices; this server takes at most 8 a request (max_choices)"),
    ({"prompt": PROMPT, "n": 0}, 400, "n", "n=0 must be at least 1"),
    ({"prompt": PROMPT, "stop": ["", "x"]}, 400, "stop", "stop has an empty string"),
    ({"prompt": PROMPT, "stop": list("abcde")}, 400, "stop", "stop takes at most 4 strings of at most 256 characters"),
    ({"prompt": PROMPT, "stop": "x" * 257}, 400, "stop", "stop takes at most 4 strings"),
    ({"prompt": PROMPT, "best_of": 3}, 400, "best_of", "best_of=3 is not supported"),
    ({"prompt": PROMPT, "logprobs": 6}, 400, "logprobs", "logprobs=6 must be between 0 and 5"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model", "model 'gpt-4' does not exist; this server serves"),
    ({"prompt": ""}, 400, "prompt", "prompt is empty"),
    ({"prompt": []}, 400, "prompt", "prompt is an empty list"),
    ({"prompt": [[3, 4], []]}, 400, "prompt", "prompt is an empty list"),
    ({"prompt": [5, 99999]}, 400, "prompt", "token id 99999 is not in this model's vocabulary (0 to "),
    ({"prompt": ["x" * 151] * 2}, 400, "prompt", "the prompts have 302 tokens; this server takes at most 300 a "
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
    assert "Traceback" not in response.text
    assert server.post({"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_malformed_and_oversized_bodies_are_refused_too(server: ServeProcess) -> None:
    headers = {"content-type": "application/json"}
    cases = [
        (server.http.post("/v1/completions", content=b'{"prompt": "ROMEO:", ', headers=headers), 400, "not valid JSON"),
        (server.http.post("/v1/completions", content=b"\xff\xfe", headers=headers), 400, "not valid JSON"),
        (server.post({"prompt": "x" * 30000}), 413, "larger than 20000 bytes"),
        (
            server.http.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 30000, b'"}']), headers=headers),
            413,
            "larger than 20000 bytes",
        ),
        (server.http.get("/v1/nothing"), 404, "no such endpoint"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        assert message in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="asks for 500 tokens; this server generates at most 240"):
        server.client().completions.create(model="run", prompt=PROMPT, max_tokens=500)
    assert server.post({"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_concurrent_requests_each_get_the_text_they_get_alone(server: ServeProcess) -> None:
    """They take turns for the model: greedy text is identical."""
    prompts = ["ROMEO:", "First Citizen:\nBefore we", "KING", "O", "To be, or not to be, that", "JULIET:\nAh me"]
    alone = [
        server.post({"prompt": p, "max_tokens": 50, "temperature": 0}).json()["choices"][0]["text"] for p in prompts
    ]
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            answer = http.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 50, "temperature": 0})
            together[i] = answer.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [together[i] for i in range(len(prompts))] == alone


def test_a_full_queue_answers_503_and_a_client_that_leaves_mid_stream_frees_the_model(served_run: Path) -> None:
    server = ServeProcess(served_run, "max_queue=0", "timeout_s=600")
    try:
        body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True}
        with server.http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            # the model is this stream's and nothing may wait: the next request is turned away
            busy = server.post({"prompt": PROMPT, "max_tokens": 2})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "server_busy"
        deadline = time.monotonic() + 10
        while "cancelled" not in (health := server.http.get("/health").json())["finished"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        assert health["running"] == 0 and health["finished"].get("cancelled") == 1, health  # the model is free
        assert server.post({"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


def test_an_api_key_is_required_when_set(served_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = ServeProcess(served_run, "api_key=s3cret")
    try:
        latin = {"Authorization": b"Bearer s\xe9cret"}  # not ASCII: refused, not a 500
        wrong = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, latin)
        for headers in wrong:
            response = server.post({"prompt": PROMPT, "max_tokens": 2}, headers=headers)
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert server.http.get("/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").completions.create(model="run", prompt=PROMPT, max_tokens=2)
        answer = server.client("s3cret").completions.create(model="run", prompt=PROMPT, max_tokens=2)
        assert len(answer.choices[0].text) == 2
        assert server.http.get("/health").status_code == 200  # for a load balancer's checks
    finally:
        server.stop()


def test_sigterm_lets_the_request_in_flight_finish_then_exits(served_run: Path) -> None:
    server = ServeProcess(served_run)
    received: list[str] = []

    def stream() -> None:
        body = {"prompt": PROMPT, "max_tokens": 80, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                received.extend(r.iter_lines())

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    status, stderr = server.stop(signal.SIGTERM)
    thread.join(timeout=30)
    assert time.monotonic() - started < 15
    assert "Traceback" not in stderr, stderr
    assert status in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    assert "data: [DONE]" in received and len(_streamed_text(received)) == 80


def test_a_port_in_use_is_one_line(served_run: Path, server: ServeProcess) -> None:
    port = server.url.rsplit(":", 1)[1]
    result = run_in_process("serve.py", [f"out_dir={served_run}", f"port={port}", "device=cpu"], served_run.parent)
    assert result.returncode == 2
    expected = f"error: can't listen on host=127.0.0.1 port={port} (Address already in use); pick another port"
    assert result.stderr.strip() == expected


def test_a_request_past_timeout_s_is_cancelled_with_504(served_run: Path) -> None:
    server = ServeProcess(served_run, "timeout_s=0.02")
    try:
        response = server.post({"prompt": PROMPT, "max_tokens": 90})
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout"
        streamed = server.post({"prompt": PROMPT, "max_tokens": 90, "stream": True}).text
        assert '"type": "timeout"' in streamed and streamed.rstrip().endswith("data: [DONE]")
        deadline = time.monotonic() + 10
        while server.http.get("/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.http.get("/health").json()["running"] == 0  # the model was freed
    finally:
        server.stop()


def test_the_server_s_connections_send_each_chunk_at_once() -> None:
    """TCP_NODELAY on every connection uvicorn accepts on serve.py's socket: without it, Nagle held a stream's
    chunks after the headers until the client's delayed ACK (40 ms on Linux), so they all came with the last."""
    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Record, sock=bind("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
