"""Who can reach serve.py, and what a legal but odd request gets: beyond loopback only with an API key (or said
so), a loopback server answers only its own names (DNS rebinding), the key compared as UTF-8 bytes, /health
telling a caller without the key only that it is alive, a host that isn't this machine's in one line, top_p below
float32's smallest number decoded as greedy, and a stop that ends a stream still running with an error event."""

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
        assert response.status_code == 400 and response.text == "Invalid host header", (host, response.text)
        assert server.http.get("/", headers={"Host": host}).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):  # IPv6 in brackets
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


def test_a_stop_ends_the_stream_still_running_with_an_error_event_not_a_traceback(served_run: Path) -> None:
    """Ctrl-C with a stream far from done: shutdown_s later, it gets OpenAI's error object and data: [DONE]."""
    import json
    import signal
    import threading
    import time

    import httpx

    server = ServeProcess(served_run, "shutdown_s=0.5", "max_request_tokens=16384")
    streams: list[list[str]] = [[]]

    def stream(lines: list[str]) -> None:
        body = {"prompt": PROMPT, "max_tokens": 1024, "n": 16, "stream": True}  # seconds of work
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
