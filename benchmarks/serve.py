"""bench.py serve: serve.py under streaming clients, against sample.py's one sample and the engine alone."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from benchmarks.shared import NANOGPT_SAMPLING, REPO, cpu_model, timed

if TYPE_CHECKING:  # imported where used
    from inference.sampling import Sampler
    from model.gpt import Decoding

SERVE_PROMPT = "ROMEO:\nWhat light through yonder"  # 32 characters: the 32 tokens generated fill the block of 64


def bench_serve(args: argparse.Namespace) -> list[dict]:
    from common.runtime import make_runtime
    from data.tokenizers import CharTokenizer
    from inference.sampling import Sampler
    from model.checkpoint import CKPT_NAME, Checkpoint, save_checkpoint
    from model.gpt import Decoding

    chars = sorted(set(SERVE_PROMPT) | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n"))
    tokenizer = CharTokenizer(chars + [chr(0x100 + i) for i in range(65 - len(chars))])
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
    with tempfile.TemporaryDirectory() as run:  # serve.py's run directory: the same weights
        save_checkpoint(Path(run) / CKPT_NAME, Checkpoint(model.config, model.state_dict(), tokenizer.metadata()))
        server = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), f"out_dir={run}", "port=0", f"device={args.device}",
             f"max_batch={max(args.serve_clients)}", f"max_tokens={tokens}"],
            cwd=run, stderr=subprocess.PIPE, text=True,
        )
        try:
            line = server.stderr.readline()
            if " at http" not in line:
                raise RuntimeError(f"serve.py didn't start: {line}{server.stderr.read()}")
            url = line.split(" at ", 1)[1].split(" ", 1)[0]
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
        finally:
            server.terminate()
            server.wait(timeout=30)
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
