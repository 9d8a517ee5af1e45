"""Benchmarks (not tests): timings on this machine, printed as a table, optionally saved as JSON.

    python bench.py                                   # every section
    python bench.py train --experiment shakespeare_char_cpu --json out.json
    python bench.py attention --lengths 256 1024 2048
    python bench.py sampling
    python bench.py sampling-batch --num-samples 8
    python bench.py muon --muon-shapes 384x128 768x2304

train: tokens/s, ms/iter and MFU of train.py's loop for an experiment, against a plain eager nanoGPT-style
  loop on the same model, data and machine, measured in the same run (warm-up excluded). MFU's peak comes
  from a datasheet for known GPUs, else from a matmul measured here; the table says which.
attention: the flash path against the math path, forward + backward, time and peak memory (bf16 on CUDA,
  as training runs there; fp32 on CPU, as it mostly does there); and the flash path with a sliding window of
  each --windows size.
  time_vs_shortest: the time over the same row's at the shortest length (linear cost: the ratio of lengths).
sampling: tokens/s of model.generate with and without the KV cache, on both attention paths; with --attn-window,
  also a model windowed in every layer (rope), whose cache rolls on past --block-size.
sampling-batch: sample.py's --num-samples samples as one batch with the KV cache (also streamed, as to a terminal),
  against the same one at a time and against nanoGPT's sample.py loop (one at a time, recomputing the window
  every step); vs_nanogpt: its time over the row's. nanoGPT's CPU model and sample.py: --block-size 64
  --new-tokens 500 --num-samples 3.
muon: Muon's Newton-Schulz orthogonalisation (training/muon.py's newton_schulz, float32, and the same given a
  bfloat16 matrix) against torch.optim.Muon's (bfloat16; torch 2.9 on), on the hidden matrices' shapes (the
  baby model's, then GPT-2 124M's), of a Gaussian matrix: ms per call, the singular values it leaves (the
  quintic aims at about 0.7..1.2, not 1), err_vs_uvt, its relative distance from the exact U V^T (by SVD), and
  diff_vs_ours_fp32, bfloat16's rounding. train.optimizer=muon runs ours in the run's precision (make_optimizer).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import itertools
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from model import ATTN_IMPLS, GPT, GPTConfig, causal_mask, masked_attention
from model.attention import windowed_attention

if TYPE_CHECKING:  # imported where used: the attention and sampling sections need no training code
    from common.runtime import Runtime
    from inference.sampling import Sampler
    from model.decoding import Decoding
    from training.schema import TrainRunConfig

REPO = Path(__file__).resolve().parent


def bench_train(args: argparse.Namespace) -> list[dict]:
    from hydra import compose, initialize_config_dir

    from common.config import typed_config
    from common.runtime import make_runtime
    from data.prepare import ensure_prepared
    from training.machine import peak_flops
    from training.run import train
    from training.schema import TrainRunConfig, register_schemas

    register_schemas()
    n = args.train_iters
    overrides = [
        f"experiment={args.experiment}",
        f"device={args.device}",
        *args.override,
        f"train.max_iters={2 * n}",
        f"train.log_interval={n}",
        f"train.eval_interval={10 * n}",
        "train.eval_iters=1",
        "train.target_val_loss=null",
    ]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = typed_config(compose(config_name="config", overrides=overrides), TrainRunConfig)
    out_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    config.out_dir = str(out_dir)
    try:
        trained_in = train(config).dtype  # the first n iterations warm up (and compile); the second n are measured
        ours = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()][-2]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)  # a throwaway run: its checkpoint is not worth keeping

    runtime = make_runtime(config.device, trained_in)  # the reference in the run's precision (auto may pick bf16)
    data = ensure_prepared(config.data)
    model_config = config.model.gpt_config(data.meta["vocab_size"])
    reference_tps = _nanogpt_style_tokens_per_sec(config, model_config, data.train.paths[0], runtime, n)
    peak = peak_flops(runtime.device, runtime.dtype)
    flops_per_token = GPT(model_config).flops_per_token()
    rows = []
    for loop, tps in (("nanogpt-style eager", reference_tps), ("train.py", ours["tokens_per_sec"])):
        rows.append(
            {
                "section": "train",
                "experiment": args.experiment,
                "loop": loop,
                "tokens_per_sec": tps,
                "ms_per_iter": 1000 * _tokens_per_iter(config) / tps,
                "mfu": flops_per_token * tps / peak.flops,
                "peak": peak.source,
                "speedup": tps / reference_tps,
            }
        )
    return rows


def _tokens_per_iter(config: TrainRunConfig) -> int:
    return config.train.batch_size * config.train.grad_accum * config.model.block_size


def _nanogpt_style_tokens_per_sec(
    config: TrainRunConfig, model_config: GPTConfig, train_bin: Path, runtime: Runtime, n: int
) -> float:
    """The reference: nanoGPT's train.py loop as written, eager, with its batch assembly and optimizer."""
    t = config.train
    torch.manual_seed(0)
    model = GPT(model_config).to(runtime.device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.beta1, t.beta2), fused=runtime.is_cuda)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == torch.float16)
    block = model_config.block_size

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(train_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block, (t.batch_size,))
        x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
        return x.to(runtime.device), y.to(runtime.device)

    def step() -> torch.Tensor:
        for _ in range(t.grad_accum):
            x, y = get_batch()
            with runtime.autocast():
                _, loss = model(x, y)
            scaler.scale(loss / t.grad_accum).backward()
        if t.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(n):
        step()
    runtime.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        loss = step()
    loss.item()
    runtime.synchronize()
    return _tokens_per_iter(config) * n / (time.perf_counter() - start)


def bench_attention(args: argparse.Namespace) -> list[dict]:
    rows = []
    kinds = [(impl, None) for impl in ATTN_IMPLS] + [("flash", window) for window in args.windows]
    for length in args.lengths:
        for impl, window in kinds:
            probe = [
                *(sys.executable, str(REPO / "bench.py"), "--attention-probe", impl, str(length), str(window or 0)),
                *("--device", args.device, "--repeats", str(args.repeats)),
                *("--attn-shape", *(str(v) for v in args.attn_shape)),
            ]
            result = subprocess.run(probe, capture_output=True, text=True, check=True)  # fresh process: clean peak
            row = {"section": "attention", "attn_impl": impl, "window": window or "-", "T": length}
            rows.append({**row, **json.loads(result.stdout)})
        flash, math_ = rows[-len(kinds)], rows[-len(kinds) + 1]
        for row in (flash, math_):
            row["math_over_flash_time"] = math_["seconds"] / flash["seconds"]
    for row in rows:
        same_kind = [r for r in rows if (r["attn_impl"], r["window"]) == (row["attn_impl"], row["window"])]
        row["time_vs_shortest"] = row["seconds"] / min(same_kind, key=lambda r: r["T"])["seconds"]
    return rows


def attention_probe(impl: str, length: int, window: int | None, device: str, repeats: int, shape: list[int]) -> dict:
    """Forward + backward of causal (or sliding-window) attention alone; peak memory above the inputs, in MiB."""
    batch, heads, head_dim = shape
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # as training runs on each
    q, k, v = (
        torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )

    def run() -> None:
        if impl == "flash" and window is not None:
            out = windowed_attention(q, k, v, window)
        elif impl == "flash":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out, _ = masked_attention(q, k, v, causal_mask(length, length, device, window))
        out.backward(torch.ones_like(out))

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        run()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    seconds = min(_timed(run, device) for _ in range(repeats))
    return {"seconds": seconds, "peak_mib": peak / 2**20}


def bench_sampling(args: argparse.Namespace) -> list[dict]:
    rows = []
    shape = dict(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    rolling = dict(pos_emb="rope", attn_window=args.attn_window, window_pattern="S" * args.n_layer)
    windows = [None] if args.attn_window is None else [None, args.attn_window]
    for impl, window in itertools.product(ATTN_IMPLS, windows):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=65, **shape, attn_impl=impl, **(rolling if window else {}))
        model = GPT(config).to(args.device).eval()
        prompt = torch.randint(config.vocab_size, (1, args.prompt_tokens), device=args.device)
        seconds = {}
        for use_cache in (False, True):
            model.generate(prompt, 4, use_cache=use_cache)  # warm-up
            run = functools.partial(model.generate, prompt, args.new_tokens, use_cache=use_cache)
            seconds[use_cache] = min(_timed(run, args.device) for _ in range(args.repeats))
        for use_cache, s in seconds.items():
            rows.append(
                {
                    "section": "sampling",
                    "attn_impl": impl,
                    "window": window or "-",
                    "kv_cache": use_cache,
                    "new_tokens": args.new_tokens,
                    "seconds": s,
                    "tokens_per_sec": args.new_tokens / s,
                    "speedup": seconds[False] / s,
                }
            )
    return rows


NANOGPT_SAMPLING = dict(temperature=0.8, top_k=200)  # nanoGPT's sample.py defaults, ours too


def bench_batched_sampling(args: argparse.Namespace) -> list[dict]:
    """sample.py's way (--num-samples drawn side by side as one batch, KV cache) against the same samples one at a
    time, and against nanoGPT's sample.py loop: one sample at a time, the cropped window recomputed every step."""
    from common.runtime import make_runtime
    from data.tokenizers import CharTokenizer
    from inference.sampling import Sampler
    from model.decoding import Decoding

    torch.manual_seed(0)
    shape = dict(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(GPTConfig(vocab_size=65, **shape, bias=False)).to(args.device).eval()
    sampler = Sampler(model, CharTokenizer([chr(32 + i) for i in range(65)]), make_runtime(args.device, "auto"))
    decoding = Decoding(**NANOGPT_SAMPLING)
    prompt = torch.randint(65, (args.prompt_tokens,)).tolist()
    n, new = args.num_samples, args.new_tokens

    ways: dict[str, Callable[[], object]] = {
        "nanoGPT's loop, one at a time": lambda: [_nanogpt_sample(model, prompt, new, args.device) for _ in range(n)],
        "one at a time, KV cache": lambda: [sampler.generate(prompt, 1, new, decoding) for _ in range(n)],
        "one batch, KV cache (sample.py)": lambda: sampler.generate(prompt, n, new, decoding),
        "the same, streamed": lambda: sampler.generate(prompt, n, new, decoding, stream=io.StringIO()),
    }
    sampler.generate(prompt, n, 4, decoding)  # warm-up
    seconds = {way: min(_timed(run, args.device) for _ in range(args.repeats)) for way, run in ways.items()}
    reference = seconds["nanoGPT's loop, one at a time"]
    return [
        {
            "section": "sampling: batch and nanoGPT",
            "way": way,
            "samples": n,
            "new_tokens": new,
            "block_size": args.block_size,
            "seconds": s,
            "tokens_per_sec": n * new / s,
            "vs_nanogpt": reference / s,
        }
        for way, s in seconds.items()
    ]


@torch.no_grad()
def _nanogpt_sample(model: GPT, prompt: list[int], max_new_tokens: int, device: str) -> torch.Tensor:
    """nanoGPT's model.generate as written (the same weights): every step runs the last block_size tokens and
    keeps the last position's logits."""
    idx = torch.tensor([prompt], device=device)
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -model.config.block_size :]
        logits = model.lm_head(model.hidden(idx_cond)[:, [-1], :])[:, -1, :] / NANOGPT_SAMPLING["temperature"]
        v, _ = torch.topk(logits, min(NANOGPT_SAMPLING["top_k"], logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("Inf")
        idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


SERVE_PROMPT = "ROMEO:\nWhat light through yonder"


def bench_serve(args: argparse.Namespace) -> list[dict]:
    """serve.py on loopback under --serve-clients concurrent streaming clients (each sends --serve-requests
    requests one after another, sample.py's default decoding, --serve-tokens tokens each), against sample.py's
    own generation of one sample of the same length, timed in this process. The model: --serve-run's checkpoint,
    else the CPU preset's shape (4x4x128, block 64) with random weights, which time the same. The clients run
    here, on the same CPU as the server: their share of it is in the figures."""
    from common.runtime import make_runtime
    from inference.load import load_model
    from inference.sampling import Sampler
    from model.decoding import Decoding

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.serve_run) if args.serve_run else _random_run(Path(tmp) / "run")
        loaded = load_model(str(run), None, "latest", None)
        sampler = Sampler(loaded.model.to(args.device).eval(), loaded.tokenizer, make_runtime(args.device, "auto"))
        prompt = loaded.tokenizer.encode(SERVE_PROMPT)
        tokens = min(args.serve_tokens, loaded.model.config.block_size - len(prompt))
        decoding = Decoding(**NANOGPT_SAMPLING)
        sampler.generate(prompt, 1, 4, decoding)  # warm-up
        alone = min(_timed(lambda: sampler.generate(prompt, 1, tokens, decoding), args.device) for _ in range(5))
        rows = [{"section": "serve", "way": "sample.py, one sample", "clients": 1, "tokens_per_sec": tokens / alone,
                 "aggregate_tokens_per_sec": tokens / alone, "p50_ms": 1000 * alone, "p99_ms": 1000 * alone}]
        rows += _engine_alone(sampler, prompt, tokens, decoding, args.serve_clients)
        server = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), f"out_dir={run}", "port=0", f"device={args.device}",
             f"max_batch={max(args.serve_clients)}", f"max_tokens={tokens}", *args.serve_override],
            cwd=tmp, stderr=subprocess.PIPE, text=True,
        )
        try:
            line = server.stderr.readline()
            url = line.split(" at ", 1)[1].split(" ", 1)[0] if " at http" in line else None
            if url is None:
                raise RuntimeError(f"serve.py didn't start: {line}{server.stderr.read()}")
            usage = {"include_usage": True}  # the last chunk counts the tokens (a chunk may hold several)
            body = {"prompt": SERVE_PROMPT, "max_tokens": tokens, "stream": True, "stream_options": usage,
                    **NANOGPT_SAMPLING}
            for clients in args.serve_clients:
                result = asyncio.run(_load(url, body, clients, args.serve_requests))
                latencies = np.array(result["latencies"])
                rows.append({
                    "section": "serve", "way": "serve.py, streaming clients", "clients": clients,
                    "tokens_per_sec": tokens / float(np.median(latencies)),
                    "aggregate_tokens_per_sec": result["tokens"] / result["seconds"],
                    "p50_ms": 1000 * float(np.percentile(latencies, 50)),
                    "p99_ms": 1000 * float(np.percentile(latencies, 99)),
                    "ttft_p50_ms": 1000 * float(np.percentile(result["first"], 50)),
                    "ttft_p99_ms": 1000 * float(np.percentile(result["first"], 99)),
                    "client_cpu_ms": 1000 * result["cpu"] / len(latencies),  # the load generator's, a request
                })
        finally:
            server.terminate()
            server.wait(timeout=30)
    for row in rows:
        single = next(r for r in rows if r["way"] == row["way"] and r["clients"] == 1)
        row["vs_one_client"] = row["aggregate_tokens_per_sec"] / single["aggregate_tokens_per_sec"]
    return rows


def _engine_alone(
    sampler: Sampler, prompt: list[int], tokens: int, decoding: Decoding, counts: list[int]
) -> list[dict]:
    """The engine in this process, no HTTP: `count` completions submitted at once, run to the end, with the
    server's default CPU threads (serve_run.cpu_threads). What batching gives before the HTTP side takes its
    share of the CPU."""
    from inference.engine import Completion, Engine
    from inference.sample_text import SampleText
    from inference.serve_run import cpu_threads

    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads())
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


def _random_run(run: Path) -> Path:
    """A run directory whose ckpt.pt holds the CPU preset's shape with random weights, for timing only."""
    from data.tokenizers import CharTokenizer
    from model.checkpoint import CKPT_NAME, Checkpoint, save_checkpoint

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, n_layer=4, n_head=4, n_embd=128, block_size=64, bias=False)
    chars = sorted(set(SERVE_PROMPT) | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n"))
    chars += [chr(0x100 + i) for i in range(65 - len(chars))]
    run.mkdir(parents=True)
    tokenizer = CharTokenizer(chars)
    save_checkpoint(run / CKPT_NAME, Checkpoint(config, GPT(config).state_dict(), tokenizer.metadata()))
    return run


async def _load(url: str, body: dict, clients: int, requests: int) -> dict:
    """`clients` concurrent streams, each `requests` requests in a row: every request's latency (send to its last
    event) and time to its first token (send to its first chunk of text), the completion tokens, and the wall time
    and this process's CPU time (the load generator's share of the cores) of all."""
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

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await client(http)  # warm-up: the first request's connection and the server's first step
        latencies.clear()
        first.clear()
        tokens = 0
        began, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    return {"latencies": latencies, "first": first, "tokens": tokens, "seconds": seconds, "cpu": cpu}


MEMORY_PRESETS = ["shakespeare_char_cpu", "speedrun_cpu", "window_cpu", "shakespeare", "speedrun_gpu",
                  "finetune_shakespeare", "gpt2", "gpt2_speedrun"]
GPT2_SHAPES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
               "gpt2-xl": (48, 25, 1600)}
GPU_GIB = (24, 40, 80, 141)  # a 4090 or 3090, an A100 40GB, an A100/H100 80GB, an H200
GPU_USABLE = 0.9  # of a GPU's memory for tensors: the CUDA context and the allocator's fragmentation take the rest
STEP_TOKENS = 491_520  # nanoGPT's GPT-2 step (12 x 1024 x 40): grad_accum reaches it from the largest batch
# (n_layer, n_embd, block_size, batch_size, activation_checkpointing): shapes this CPU can measure in seconds
# (n_layer, n_embd, block_size, batch_size, activation_checkpointing, vocab_size, bf16): shapes this CPU can
# measure in seconds; GPT-2's vocabulary too, where the head dominates
MEMORY_PROBES = [(6, 384, 256, 16, 0, 65, 0), (6, 384, 256, 16, 1, 65, 0), (8, 128, 512, 16, 0, 65, 0),
                 (8, 128, 512, 16, 1, 65, 0), (12, 256, 512, 8, 1, 65, 0), (4, 256, 256, 32, 0, 65, 0),
                 (2, 128, 256, 8, 0, 50257, 0), (2, 128, 256, 8, 0, 50257, 1), (2, 128, 256, 8, 1, 50257, 1),
                 (4, 256, 256, 16, 0, 65, 1)]


def bench_memory(args: argparse.Namespace) -> list[dict]:
    """training/memory.py's prediction of a training step's peak memory: each preset at its batch size, what fits
    on common GPUs for GPT-2's shapes at block 1024, and the prediction against a CPU measurement (the peak RSS
    of two AdamW steps in a process of its own, float32, above the process's RSS before the model)."""
    from hydra import compose, initialize_config_dir

    from common.config import typed_config
    from training.memory import GIB, largest_batch, training_memory
    from training.schema import TrainRunConfig, register_schemas

    register_schemas()
    rows = []
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        for preset in MEMORY_PRESETS:
            config = typed_config(compose(config_name="config", overrides=[f"experiment={preset}"]), TrainRunConfig)
            vocab = 65 if config.data.tokenizer == "char" else 50257
            model = config.model.gpt_config(vocab)
            opt = config.train
            estimates = {
                name: training_memory(model, opt.batch_size, bf16, opt.optimizer, ck).total / GIB
                for name, bf16, ck in (("fp32_gib", False, False), ("bf16_gib", True, False),
                                       ("bf16_checkpointed_gib", True, True))
            }
            rows.append({"section": "memory: presets", "preset": preset,
                         "params_m": training_memory(model, 0, False).params / 4e6, "batch_size": opt.batch_size,
                         "block_size": model.block_size, **estimates})
    for name, (n_layer, n_head, n_embd) in GPT2_SHAPES.items():
        model = GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        for gib in GPU_GIB:
            row = {"section": "memory: what fits (bf16, block 1024)", "model": name, "gpu_gib": gib}
            for label, ck in (("plain", False), ("checkpointed", True)):
                batch = largest_batch(model, GPU_USABLE * gib * GIB, True, ck)
                accum = -(-STEP_TOKENS // (batch * 1024)) if batch else "-"
                row[label] = f"batch_size={batch} grad_accum={accum}" if batch else "does not fit"
            rows.append(row)
    for probe in MEMORY_PROBES[: args.memory_probes] if sys.platform == "linux" else []:  # reads /proc
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}  # freed memory leaves RSS
        command = [sys.executable, str(REPO / "bench.py"), "--memory-probe", *map(str, probe)]
        measured = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)
        n_layer, n_embd, block_size, batch_size, ck, vocab, bf16 = probe
        model = GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=4, n_embd=n_embd, bias=False)
        predicted = training_memory(model, batch_size, bool(bf16), checkpointing=bool(ck)).total
        rows.append({"section": "memory: predicted against measured (CPU)",
                     "shape": f"{n_layer}x{n_embd}, vocab {vocab}, block {block_size}, batch {batch_size}",
                     "dtype": "bfloat16" if bf16 else "float32", "checkpointing": bool(ck),
                     "measured_mib": measured / 2**20, "predicted_mib": predicted / 2**20,
                     "predicted_over_measured": predicted / measured})
    return rows


def memory_probe(
    n_layer: int, n_embd: int, block_size: int, batch_size: int, checkpointing: int, vocab: int, bf16: int
) -> int:
    """Bytes of RSS two AdamW steps of this shape add, in this process (bench.py --memory-probe runs it alone).
    The peak is VmHWM, this process image's own: getrusage's ru_maxrss keeps the peak of the process that forked
    this one (pytest's, hundreds of MB) across exec."""

    def status(field: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=4, n_embd=n_embd, bias=False)
    before = status("VmRSS")
    model = GPT(config).train()
    model.activation_checkpointing = bool(checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        idx = torch.randint(vocab, (batch_size, block_size))
        with torch.autocast("cpu", torch.bfloat16, enabled=bool(bf16)):
            _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return status("VmHWM") - before


def bench_muon(args: argparse.Namespace) -> list[dict]:
    from training.muon import NS_COEFFICIENTS, newton_schulz

    ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "ours, float32": newton_schulz,
        "ours, bfloat16": lambda g: newton_schulz(g.bfloat16()),
    }
    if hasattr(torch.optim, "Muon"):  # since torch 2.9
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
        from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

        assert NS_COEFFICIENTS == (DEFAULT_A, DEFAULT_B, DEFAULT_C)  # the same iteration: only the arithmetic differs
        ways["torch.optim.Muon's (bfloat16)"] = lambda g: torch_newton_schulz(
            g, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS
        )
    rows = []
    for shape in args.muon_shapes:
        n_rows, n_cols = (int(n) for n in shape.split("x"))
        torch.manual_seed(0)
        grad = torch.randn(n_rows, n_cols, device=args.device)
        u, _, vh = torch.linalg.svd(grad.double(), full_matrices=False)
        exact = u @ vh
        small, large = sorted((n_rows, n_cols))
        calls = min(100, max(1, round(2e8 / (10 * small * small * large))))  # about 0.2 GFLOP a timing
        seconds, outputs = {}, {}
        for way, fn in ways.items():
            outputs[way] = out = fn(grad).double()  # and the warm-up
            run = functools.partial(_call_repeatedly, fn, grad, calls)
            seconds[way] = min(_timed(run, args.device) for _ in range(args.repeats))
            singular = torch.linalg.svdvals(out)
            reference = outputs["ours, float32"]
            rows.append(
                {
                    "section": "muon: Newton-Schulz",
                    "shape": shape,
                    "way": way,
                    "ms": 1000 * seconds[way] / calls,
                    "sv_min": singular.min().item(),
                    "sv_max": singular.max().item(),
                    "err_vs_uvt": ((out - exact).norm() / exact.norm()).item(),
                    "diff_vs_ours_fp32": ((out - reference).norm() / reference.norm()).item(),
                    "speedup": seconds["ours, float32"] / seconds[way],
                }
            )
    return rows


def _call_repeatedly(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, times: int) -> None:
    for _ in range(times):
        fn(x)


def _timed(fn: Callable[[], object], device: str) -> float:
    from common.runtime import synchronize

    synchronize(torch.device(device))
    start = time.perf_counter()
    fn()
    synchronize(torch.device(device))
    return time.perf_counter() - start


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "train": bench_train,
    "attention": bench_attention,
    "sampling": bench_sampling,
    "sampling-batch": bench_batched_sampling,
    "muon": bench_muon,
    "serve": bench_serve,
    "memory": bench_memory,
}


def print_table(rows: list[dict]) -> None:
    for section in dict.fromkeys(row["section"] for row in rows):
        part = [row for row in rows if row["section"] == section]
        columns = list(dict.fromkeys(k for row in part for k in row))
        cells = [[_cell(row.get(c, "")) for c in columns] for row in part]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
        for r in cells:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
        print()


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)}; default: all")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    train_args = parser.add_argument_group("train")
    train_args.add_argument("--experiment", default="shakespeare_char_cpu")
    train_args.add_argument("--override", action="append", default=[], help="a Hydra override, repeatable")
    train_args.add_argument("--train-iters", type=int, default=30, help="measured after as many warm-up ones")
    attention_args = parser.add_argument_group("attention")
    attention_args.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    attention_args.add_argument("--attn-shape", type=int, nargs=3, default=[4, 6, 64], metavar=("B", "H", "D"))
    attention_args.add_argument("--windows", type=int, nargs="*", default=[256], help="sliding windows to time")
    attention_args.add_argument("--attention-probe", nargs=3, metavar=("IMPL", "T", "W"), help=argparse.SUPPRESS)
    sampling_args = parser.add_argument_group("sampling")
    sampling_args.add_argument("--n-layer", type=int, default=4)
    sampling_args.add_argument("--n-head", type=int, default=4)
    sampling_args.add_argument("--n-embd", type=int, default=128)
    sampling_args.add_argument("--block-size", type=int, default=256)
    sampling_args.add_argument("--prompt-tokens", type=int, default=8)
    sampling_args.add_argument("--new-tokens", type=int, default=240)
    sampling_args.add_argument("--attn-window", type=int, help="also a model with this window in every layer")
    sampling_args.add_argument("--num-samples", type=int, default=8, help="sampling-batch: samples in the batch")
    memory_args = parser.add_argument_group("memory")
    memory_args.add_argument("--memory-probes", type=int, default=len(MEMORY_PROBES), help="shapes to measure")
    memory_args.add_argument("--memory-probe", type=int, nargs=7, help=argparse.SUPPRESS)
    serve_args = parser.add_argument_group("serve")
    serve_args.add_argument("--serve-run", help="a run directory to serve; default: the CPU preset's shape, random")
    serve_args.add_argument("--serve-clients", type=int, nargs="+", default=[1, 4, 16, 64])
    serve_args.add_argument("--serve-requests", type=int, default=4, help="requests each client sends in a row")
    serve_args.add_argument("--serve-tokens", type=int, default=56, help="max_tokens of each request")
    serve_args.add_argument("--serve-override", action="append", default=[], help="a serve.py override, repeatable")
    muon_args = parser.add_argument_group("muon")
    # the baby model's c_attn, attention c_proj, c_fc, MLP c_proj (out x in); then GPT-2 124M's
    muon_shapes = ["384x128", "128x128", "512x128", "128x512", "2304x768", "768x768", "3072x768", "768x3072"]
    muon_args.add_argument("--muon-shapes", nargs="+", default=muon_shapes, metavar="ROWSxCOLS")
    args = parser.parse_args()
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.memory_probe:
        print(json.dumps(memory_probe(*args.memory_probe)))
        return
    if args.attention_probe:
        impl, length, window = args.attention_probe
        probe = attention_probe(impl, int(length), int(window) or None, args.device, args.repeats, args.attn_shape)
        print(json.dumps(probe))
        return
    rows = [row for name in (args.sections or SECTIONS) for row in SECTIONS[name](args)]
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
