"""Who can reach serve.py, and what a legal but odd request gets: beyond loopback only with an API key (or said
so), a loopback server answers only its own names (DNS rebinding), the key compared as UTF-8 bytes, /health
telling a caller without the key only that it is alive, a host that isn't this machine's in one line, choices
that can never fit a 400, and top_p below float32's smallest number decoded as greedy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_serve import PROMPT, sample_py

from conftest import REPO, ServeProcess, run_in_process


@pytest.mark.parametrize("host", ["0.0.0.0", "0", ""])
def test_every_interface_without_a_key_is_refused_in_one_line(served_run: Path, host: str) -> None:
    result = run_in_process("serve.py", [f"out_dir={served_run}", f"host={host}", "port=0", "device=cpu"],
                            served_run.parent)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: host={host} listens on every interface with no API key, so anyone who reaches the port can use "
        "the model; set api_key=KEY (or $GPT_LAB_API_KEY), or allow_no_api_key=true")


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


def test_a_host_that_is_not_this_machine_s_is_one_line(served_run: Path) -> None:
    result = run_in_process("serve.py", [f"out_dir={served_run}", "host=999.1.1.1", "port=0", "device=cpu"],
                            served_run.parent)
    assert result.returncode == 2
    assert result.stderr.startswith("error: host=999.1.1.1 is not an address of this machine (")
    assert "pick another port" not in result.stderr


def test_a_loopback_server_answers_only_its_own_names(server: ServeProcess) -> None:
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", "localhost.evil.example"):
        response = server.post({"prompt": PROMPT, "max_tokens": 2}, headers={"Host": host})
        assert response.status_code == 421, (host, response.text)
        assert response.json()["error"]["code"] == "misdirected_request"
        assert server.http.get("/", headers={"Host": host}).status_code == 421
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST"):
        assert server.post({"prompt": PROMPT, "max_tokens": 2}, headers={"Host": host}).status_code == 200


def test_a_non_ascii_key_is_compared_as_utf8_and_health_says_little_without_it(
    served_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPT_LAB_API_KEY", "sécret")
    server = ServeProcess(served_run)
    try:
        utf8 = {"Authorization": "Bearer sécret".encode()}
        latin1 = {"Authorization": "Bearer sécret".encode("latin-1")}
        assert server.post({"prompt": PROMPT, "max_tokens": 2}, headers=utf8).status_code == 200
        assert server.post({"prompt": PROMPT, "max_tokens": 2}, headers=latin1).status_code == 401
        assert server.http.get("/health").json() == {"status": "ok"}
        assert server.http.get("/health", headers=latin1).json() == {"status": "ok"}
        full = server.http.get("/health", headers=utf8).json()
        assert full["status"] == "ok" and full["finished"]["length"] == 1 and "running" in full
    finally:
        server.stop()


def test_choices_that_can_never_fit_are_a_400_not_a_retry(served_run: Path) -> None:
    server = ServeProcess(served_run, "max_batch=2", "max_queue=1", "max_choices=8")
    try:
        response = server.post({"prompt": PROMPT, "max_tokens": 2, "n": 4})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            "n=4 for 1 prompt(s) asks for 4 choices; this server holds 3 at most (max_batch + max_queue)")
        assert server.post({"prompt": PROMPT, "max_tokens": 2, "n": 3}).status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_a_top_p_that_rounds_to_zero_decodes_as_greedy(server: ServeProcess, served_run: Path, top_p: float) -> None:
    """(The shared server's stderr is checked for a traceback when it stops.)"""
    whole = server.post({"prompt": PROMPT, "max_tokens": 20, "top_p": top_p, "seed": 1})
    assert whole.status_code == 200, whole.text
    greedy = server.post({"prompt": PROMPT, "max_tokens": 20, "temperature": 0}).json()["choices"][0]["text"]
    assert whole.json()["choices"][0]["text"] == greedy
    streamed = server.post({"prompt": PROMPT, "max_tokens": 20, "top_p": top_p, "stream": True})
    assert streamed.status_code == 200 and '"error"' not in streamed.text and "data: [DONE]" in streamed.text
    assert sample_py(served_run, f"top_p={top_p}", "num_samples=1", "max_new_tokens=20") == [greedy]


def test_the_live_page_s_work_is_bounded_so_completions_keep_their_latency(served_run: Path) -> None:
    """In-process, the engine's thread not started: past PAGE_TASKS waiting, the page's work gets 503 at once;
    the engine holds one at a time and runs them one a run_once, and then there is room again."""
    import asyncio

    from common.runtime import make_runtime
    from inference.api import ApiError
    from inference.engine import Engine
    from inference.sampling import load_model
    from inference.schema import ServeConfig
    from inference.server import PAGE_TASKS, Service

    loaded = load_model(str(served_run), None, "latest", None)
    engine = Engine(loaded.model.eval(), loaded.tokenizer, make_runtime("cpu", "float32"), max_batch=2)
    service = Service(engine, loaded.tokenizer, "run", ServeConfig(out_dir=str(served_run)))

    async def scenario() -> None:
        held = [asyncio.create_task(service.call(lambda i=i: i)) for i in range(PAGE_TASKS)]
        await asyncio.sleep(0)
        with pytest.raises(ApiError, match=rf"the live page's work is busy \({PAGE_TASKS} tasks\)") as refused:
            await service.call(lambda: "one too many")
        assert refused.value.status == 503 and service.page_tasks == PAGE_TASKS
        for i, task in enumerate(held):
            while not engine.tasks:  # the next one's turn: the page's lock passes on in the event loop
                await asyncio.sleep(0)
            assert len(engine.tasks) == 1  # one in the engine at a time (a render's memory), the rest waiting
            await asyncio.to_thread(engine.run_once)
            assert await task == i  # one a run_once, in order
        assert service.page_tasks == 0
        again = asyncio.create_task(service.call(lambda: "room again"))
        await asyncio.sleep(0)
        await asyncio.to_thread(engine.run_once)
        assert await again == "room again"

    asyncio.run(scenario())


def test_a_stop_ends_the_streams_still_running_with_an_error_event_not_a_traceback(served_run: Path) -> None:
    """Ctrl-C with streams far from done: shutdown_s later, each gets OpenAI's error object and data: [DONE]."""
    import json
    import signal
    import threading
    import time

    import httpx

    server = ServeProcess(served_run, "shutdown_s=0.5", "max_tokens=1024")
    streams: list[list[str]] = [[] for _ in range(3)]

    def stream(lines: list[str]) -> None:
        body = {"prompt": PROMPT, "max_tokens": 1024, "n": 4, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    lines.append(line)

    threads = [threading.Thread(target=stream, args=(lines,)) for lines in streams]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while not all(len(lines) > 2 for lines in streams) and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    status, stderr = server.stop(signal.SIGINT)
    for thread in threads:
        thread.join(timeout=30)
    assert time.monotonic() - started < 10
    assert "Traceback" not in stderr and "ASGI" not in stderr, stderr
    assert status in (0, -signal.SIGINT, 128 + signal.SIGINT)
    for lines in streams:
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_unavailable" and "shutting down" in error["message"]


def test_a_flood_of_partial_headers_is_capped_timed_out_and_logged_once(served_run: Path) -> None:
    """200 connections that send half a request line, against max_connections=50 and header_timeout_s=1: past
    the cap the oldest go at once (about 150 closed before any timeout), a normal request is answered meanwhile
    (it makes room too), the rest close at the header timeout, and the log holds one line per kind, no
    traceback."""
    import select
    import socket
    import time

    server = ServeProcess(served_run, "max_connections=50", "header_timeout_s=1")
    host, port = server.url.removeprefix("http://").split(":")
    flood = []
    try:
        began = time.monotonic()
        for _ in range(200):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /v1/comp")
            flood.append(sock)
        closed_early: list = []  # closed by the server: readable (EOF or a reset); a busy machine takes a while
        while len(closed_early) < 145 and time.monotonic() - began < 0.9:
            time.sleep(0.05)
            closed_early = select.select(flood, [], [], 0)[0]
        assert time.monotonic() - began < 1, "the flood took longer than the header timeout: nothing to tell apart"
        assert 145 <= len(closed_early) <= 151, len(closed_early)
        response = server.post({"prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 200
        time.sleep(2.5)
        assert len(select.select(flood, [], [], 0)[0]) == len(flood)
    finally:
        for sock in flood:
            sock.close()
        _, stderr = server.stop()
    assert "Traceback" not in stderr
    refused = [line for line in stderr.splitlines() if "(max_connections)" in line]
    timed_out = [line for line in stderr.splitlines() if "(header_timeout_s)" in line]
    assert len(refused) == 1 and len(timed_out) == 1, stderr


def test_connections_stalled_in_their_body_are_evicted_and_timed_out(served_run: Path) -> None:
    """max_connections connections that sent their headers and half a body, against header_timeout_s=1: a new
    client is answered at once (the oldest stalled one makes room), and every stalled one is closed at the
    timeout, with no traceback in the log."""
    import select
    import socket
    import time

    server = ServeProcess(served_run, "max_connections=4", "header_timeout_s=1")
    host, port = server.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n{\"prompt\": ").encode()
    stalled = []
    try:
        for _ in range(4):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(head)
            stalled.append(sock)
        time.sleep(0.1)
        began = time.monotonic()
        response = server.post({"prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 200 and time.monotonic() - began < 0.5, response.text
        assert select.select(stalled[:1], [], [], 0)[0] == stalled[:1]  # the oldest went
        assert select.select(stalled[1:], [], [], 0)[0] == []
        while len(select.select(stalled, [], [], 0.05)[0]) < len(stalled) and time.monotonic() - began < 3:
            pass
        assert len(select.select(stalled, [], [], 0)[0]) == len(stalled)  # the rest, at the timeout
        assert 0.8 < time.monotonic() - began < 1.6
    finally:
        for sock in stalled:
            sock.close()
        _, stderr = server.stop()
    assert "Traceback" not in stderr and "(header_timeout_s)" in stderr, stderr


def test_tokenizing_a_huge_prompt_leaves_the_event_loop_free(served_run: Path) -> None:
    """In-process, through the ASGI app: a tokenizer that takes a second (as a 950 KB prompt to a BPE model does)
    runs off the event loop, so /health answers meanwhile; the prompt is then refused by max_prompt_tokens."""
    import asyncio
    import time

    import httpx

    from common.runtime import make_runtime
    from inference.engine import Engine
    from inference.sampling import load_model
    from inference.schema import ServeConfig
    from inference.server import Service, create_app

    loaded = load_model(str(served_run), None, "latest", None)
    tokenizer = loaded.tokenizer

    class Slow:
        vocab_size, end_of_text, end_of_text_id = tokenizer.vocab_size, None, None

        def encode(self, text: str) -> list[int]:
            time.sleep(1.0)  # releases the GIL, as tiktoken's encoder does
            return [0] * len(text)

        def decode(self, ids: list[int]) -> str:
            return tokenizer.decode(ids)

    engine = Engine(loaded.model.eval(), tokenizer, make_runtime("cpu", "float32"), max_batch=2)
    service = Service(engine, Slow(), "run", ServeConfig(out_dir=str(served_run), max_prompt_tokens=100))
    app = create_app(service)

    async def scenario() -> tuple[httpx.Response, float, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            began = time.monotonic()
            big = asyncio.create_task(http.post("/v1/completions", json={"prompt": "7" * 200_000}))
            await asyncio.sleep(0.2)
            health = await http.get("/health")
            health_at = time.monotonic() - began
            assert health.json()["status"] == "ok"
            return await big, health_at, time.monotonic() - began

    refused, health_at, done_at = asyncio.run(scenario())
    assert health_at < 0.6 < done_at, (health_at, done_at)
    assert refused.status_code == 400 and "max_prompt_tokens" in refused.json()["error"]["message"]
