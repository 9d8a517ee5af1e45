"""bench.py serve: serve.py's streaming vs sample.py and the engine; python -m benchmarks.serve: bench_serve_abuse."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from benchmarks.shared import NANOGPT_SAMPLING, REPO, cpu_model, timed

if TYPE_CHECKING:  # imported where used
    from data.tokenizers import CharTokenizer
    from inference.sampling import Sampler
    from model.gpt import Decoding

SERVE_PROMPT = "ROMEO:\nWhat light through yonder"  # 32 characters: the 32 tokens generated fill the block of 64


def _char_tokenizer() -> CharTokenizer:
    from data.tokenizers import CharTokenizer

    chars = sorted(set(SERVE_PROMPT) | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n"))
    return CharTokenizer(chars + [chr(0x100 + i) for i in range(65 - len(chars))])


@contextlib.contextmanager
def _served(model: torch.nn.Module, tokenizer: CharTokenizer, device: str, *overrides: str) -> Iterator[str]:
    """serve.py on a free port serving `model`'s weights from a run directory of its own: its URL."""
    from model.checkpoint import CKPT_NAME, Checkpoint, save_checkpoint

    with tempfile.TemporaryDirectory() as run:
        save_checkpoint(Path(run) / CKPT_NAME, Checkpoint(model.config, model.state_dict(), tokenizer.metadata()))
        server = subprocess.Popen([sys.executable, str(REPO / "serve.py"), f"out_dir={run}", "port=0",
                                   f"device={device}", *overrides], cwd=run, stderr=subprocess.PIPE, text=True)
        try:
            line = server.stderr.readline()
            if " at http" not in line:
                raise RuntimeError(f"serve.py didn't start: {line}{server.stderr.read()}")
            yield line.split(" at ", 1)[1].split(" ", 1)[0]
        finally:
            server.terminate()
            server.wait(timeout=30)


def bench_serve(args: argparse.Namespace) -> list[dict]:
    from common.runtime import make_runtime
    from inference.sampling import Sampler
    from model.gpt import Decoding

    tokenizer = _char_tokenizer()
    model = cpu_model(64)
    prompt = tokenizer.encode(SERVE_PROMPT)
    tokens = model.config.block_size - len(prompt)
    sampler = Sampler(model.to(args.device), tokenizer, make_runtime(args.device, "auto"))
    decoding = Decoding(**NANOGPT_SAMPLING)
    sampler.generate(prompt, 1, 4, decoding)  # warm-up
    alone = min(timed(lambda: sampler.generate(prompt, 1, tokens, decoding), args.device) for _ in range(5))
    rows = [{"section": "serve", "way": "sample.py, one sample", "clients": 1, "tokens_per_sec": tokens / alone,
             "aggregate_tokens_per_sec": tokens / alone, "p50_ms": 1000 * alone, "p99_ms": 1000 * alone}]
    rows += _engine_alone(sampler, prompt, tokens, decoding, args.serve_clients)
    overrides = (f"max_batch={max(args.serve_clients)}", f"max_tokens={tokens}")
    with _served(model, tokenizer, args.device, *overrides) as url:
        body = {"prompt": SERVE_PROMPT, "max_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True}, **NANOGPT_SAMPLING}  # the last chunk counts the tokens
        for clients in args.serve_clients:
            result = asyncio.run(_load(url, body, clients, args.serve_requests))
            latencies = result["latencies"]
            p50, p99 = (1000 * float(ms) for ms in np.percentile(latencies, [50, 99]))
            ttft_p50, ttft_p99 = (1000 * float(ms) for ms in np.percentile(result["first"], [50, 99]))
            rows.append({"section": "serve", "way": "serve.py, streaming clients", "clients": clients,
                         "tokens_per_sec": tokens / float(np.median(latencies)),
                         "aggregate_tokens_per_sec": result["tokens"] / result["seconds"], "p50_ms": p50,
                         "p99_ms": p99, "ttft_p50_ms": ttft_p50, "ttft_p99_ms": ttft_p99,
                         "client_cpu_ms": 1000 * result["cpu"] / len(latencies)})  # the load generator's
    for row in rows:
        single = next(r for r in rows if r["way"] == row["way"] and r["clients"] == 1)
        row["vs_one_client"] = row["aggregate_tokens_per_sec"] / single["aggregate_tokens_per_sec"]
    return rows


def _engine_alone(sampler: Sampler, prompt: list[int], tokens: int, decoding: Decoding, counts: list[int]) -> list:
    """The engine in this process, no HTTP, with the server's CPU threads: `count` completions at once, best of 3."""
    from data.corpus import default_num_proc
    from inference.engine import Completion, Engine
    from inference.sampling import SampleText

    threads = torch.get_num_threads()
    torch.set_num_threads(default_num_proc())
    engine = Engine(sampler.model, sampler.tokenizer, sampler.runtime, max(counts))
    rows = []
    try:
        for count in counts:
            best = math.inf
            for _ in range(3):
                for _ in range(count):
                    text = SampleText(sampler.tokenizer, "")
                    engine.submit(Completion(prompt, tokens, decoding, text, lambda piece, done: None))
                began = time.perf_counter()
                while engine.running or engine.waiting:
                    engine.run_once()
                best = min(best, time.perf_counter() - began)
            rows.append({"section": "serve", "way": "the engine alone, in-process", "clients": count,
                         "tokens_per_sec": tokens / best, "aggregate_tokens_per_sec": count * tokens / best,
                         "p50_ms": 1000 * best, "p99_ms": 1000 * best})
    finally:
        torch.set_num_threads(threads)
    return rows


async def _load(url: str, body: dict, clients: int, requests: int) -> dict:
    """`clients` concurrent streams of `requests` requests each: latencies, times to first token, tokens, time."""
    import httpx

    latencies: list[float] = []
    first: list[float] = []
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for _ in range(requests):
            began, seen = time.perf_counter(), False
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not seen and line.startswith('data: {"id"') and '"text": ""' not in line:
                        first.append(time.perf_counter() - began)
                        seen = True
                    if line.startswith('data: {"id"') and '"usage": {' in line:  # the last chunk: usage not null
                        tokens += json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]
            latencies.append(time.perf_counter() - began)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
        await client(http)  # warm-up: the first request's connection and the server's first step
        latencies.clear()
        first.clear()
        tokens = 0
        began, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    return {"latencies": latencies, "first": first, "tokens": tokens, "seconds": seconds, "cpu": cpu}


SHORT = [("300-token greedy", 300), ("5-token greedy", 5)]  # the short completions timed under each load
ABUSE_LOADS = {"page": "1 client looping on /page/attention", "page10": "10 clients looping on /page/attention",
               "page5x2": "5 clients sending 2 /page/attention at once",
               "stalled": "20 connections stalled mid-body (max_connections=20)",
               "echo": "echo + logprobs=5, max_tokens=0: 16 prompts of 8,192 characters"}


def bench_serve_abuse(args: argparse.Namespace) -> list[dict]:
    """A short completion's time (median of --abuse-requests, each on a new connection) under each of issue 49's
    loads and alone just before it, on one server with max_connections=20 (the CPU preset's shape, random
    weights); the loads run on the same cores."""
    tokenizer, model = _char_tokenizer(), cpu_model(64)
    rows = []
    with _served(model, tokenizer, args.device, "max_connections=20", "max_tokens=300") as url:
        for load in args.abuse_loads or list(ABUSE_LOADS):
            time.sleep(3.0)  # what the last load left queued drains
            alone, _ = asyncio.run(_under(url, None, args.abuse_requests))
            loaded, extra = asyncio.run(_under(url, load, args.abuse_requests))
            for (name, _), before, seconds in zip(SHORT, alone, loaded, strict=True):
                p50, alone_p50 = (1000 * float(np.median(times)) for times in (seconds, before))
                rows.append({"section": "serve-abuse", "load": ABUSE_LOADS[load], "completion": name,
                             "alone_p50_ms": alone_p50, "p50_ms": p50, "max_ms": 1000 * max(seconds),
                             "vs_alone": p50 / alone_p50, **extra})
    return rows


async def _under(url: str, load: str | None, requests: int) -> tuple[list[list[float]], dict]:
    """The short completions' seconds while `load` runs, and what the load got (answers, refusals)."""
    import httpx

    host, port = url.removeprefix("http://").split(":")
    counts: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as http:

        async def page_loop() -> None:
            text = {"text": SERVE_PROMPT + "x" * 32, "prompt_chars": 6}  # 64 tokens, 58 of them generated
            while True:
                status = (await http.post("/page/attention", json=text)).status_code
                counts[f"page_{status}"] = counts.get(f"page_{status}", 0) + 1

        async def stalled() -> None:  # one connection at a time, opened again a second after the server closes it
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    "Content-Length: 1000\r\n\r\n{").encode()
            while True:
                reader, writer = await asyncio.open_connection(host, int(port))
                try:
                    writer.write(head)
                    await reader.read()  # until closed
                finally:
                    writer.close()
                counts["stalled_closed"] = counts.get("stalled_closed", 0) + 1
                await asyncio.sleep(1.0)

        async def echo() -> None:
            body = {"prompt": ["ROMEO: " * 1170 + "O! " for _ in range(16)], "echo": True, "logprobs": 5,
                    "max_tokens": 0}  # 8,193 characters, cut to 8,192 below
            body["prompt"] = [p[:8192] for p in body["prompt"]]
            counts["echo_status"] = (await http.post("/v1/completions", json=body)).status_code

        workers = {None: [], "page": [page_loop], "page10": [page_loop] * 10, "page5x2": [page_loop] * 10,
                   "stalled": [stalled] * 20, "echo": [echo]}
        tasks = [asyncio.create_task(worker()) for worker in workers[load]]
        await asyncio.sleep(2.0 if tasks else 0)  # the load first, then the short completions
        times: list[list[float]] = [[] for _ in SHORT]
        try:
            for _ in range(requests):
                for (_, tokens), seconds in zip(SHORT, times, strict=True):
                    began = time.perf_counter()
                    answer = await http.post("/v1/completions", json={"prompt": SERVE_PROMPT, "max_tokens": tokens,
                                                                       "temperature": 0})
                    answer.raise_for_status()
                    seconds.append(time.perf_counter() - began)
            counts["running"] = (await http.get("/health")).json()["running"]  # the load's completions too
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return times, counts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench_serve_abuse.__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--abuse-requests", type=int, default=5)
    parser.add_argument("--abuse-loads", nargs="+", choices=ABUSE_LOADS, help="default: all")
    for row in bench_serve_abuse(parser.parse_args()):
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))
