"""Benchmarks (not tests): timings on this machine as a table, and as JSON with --json. Sections (default: all):

train           train.py's loop against nanoGPT's (PlainGPT and nanogpt_step below: its model and loop on our tokens),
                eager and compiled: tokens/s, ms/iter, MFU (`peak`: its source), speed over the compiled reference's
attention       flash, math and flash with a 256-token window: forward + backward of attention alone
sampling        model.generate with and without the KV cache; --attn-window adds a model whose cache rolls
sampling-batch  sample.py's samples as one batch (also streamed), one at a time, and nanoGPT's sampling loop
memory          training_memory's prediction: what fits on 24-141 GB GPUs, and the prediction against measurements

    python bench.py train --experiment shakespeare_char_cpu
    python bench.py sampling --block-size 256 --new-tokens 2000 --attn-window 64   # the CPU preset's shape, random
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import functools
import gc
import io
import itertools
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn
from torch.profiler import ProfilerActivity, profile

from common.config import CONFIG_DIR, typed_config
from common.files import read_records
from common.runtime import Runtime, datasheet_peak, make_runtime, synchronize
from data.prepare import TokenFiles, ensure_prepared
from data.tokenizers import CharTokenizer
from inference.sampling import Sampler
from model import GPT, GPTConfig, causal_mask, masked_attention
from model.attention import windowed_attention
from model.gpt import Decoding
from train import TrainConfig, TrainRunConfig, train

NANOGPT_SAMPLING = {"temperature": 0.8, "top_k": 200}  # nanoGPT's sample.py defaults, ours too


def timed(fn: Callable[[], object], device: str | torch.device, times: int = 1) -> float:
    """Seconds `times` calls of fn take, the device's queued work included."""
    synchronize(torch.device(device))
    start = time.perf_counter()
    for _ in range(times):
        fn()
    synchronize(torch.device(device))
    return time.perf_counter() - start


# --- nanoGPT's model and training loop as its users run them, reading our prepared tokens: train's yardstick ---


class Block(nn.Module):
    """A pre-LN GPT-2 block without biases; attention through SDPA with is_causal."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=False), nn.LayerNorm(n_embd, bias=False)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd, bias=False), nn.Linear(n_embd, n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """GPT-2 with tied embeddings and the token table padded to a multiple of 64 (50304 rows for GPT-2's BPE)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        padded = -(-vocab_size // 64) * 64
        self.wte, self.wpe = nn.Embedding(padded, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, padded, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # residual projections scaled down, as GPT-2 initialises them
            if p.dim() == 2:
                residual = name.endswith(("c_proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the loss, as nanoGPT's model returns them (the compiled graph keeps the logits too)."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def nanogpt_step(model: PlainGPT, runtime: Runtime, tokens: TokenFiles, t: TrainConfig,
                 backend: str | None) -> Callable[[], None]:
    """One iteration of nanoGPT's train.py loop at the run's batch size, grad_accum and AdamW settings, the model
    compiled by torch.compile's `backend` (None: eager); the next batch is drawn while the device runs the forward."""
    block, batch_size, grad_accum = model.wpe.num_embeddings, t.batch_size, t.grad_accum
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.beta1, t.beta2), fused=runtime.is_cuda or None)
    forward = torch.compile(model, backend=backend) if backend else model

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = tokens.open(0)  # memmapped anew each call, as nanoGPT does
        ix = torch.randint(len(data) - block, (batch_size,))
        x, y = (torch.stack([torch.from_numpy(data[i + s : i + s + block].astype("int64")) for i in ix])
                for s in (0, 1))
        if runtime.is_cuda:  # pinned, so that the copy overlaps the device's work
            return tuple(t.pin_memory().to(runtime.device, non_blocking=True) for t in (x, y))
        return x, y

    batch = [get_batch()]

    def step() -> None:
        for _ in range(grad_accum):
            with runtime.autocast():
                loss = forward(*batch[0])[1] / grad_accum
            batch[0] = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


class Measured(Exception):
    """Raised before the step after the measured ones: no evaluation, and no checkpoint, that nothing here reads."""


def run_config(overrides: list[str]) -> TrainRunConfig:
    """train.py's typed config, composed from configs/ with these Hydra overrides as the command composes it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return typed_config(compose(config_name="config", overrides=overrides), TrainRunConfig)


def bench_train(args: argparse.Namespace) -> list[dict]:
    n = args.train_iters  # no evaluation, so one compiled graph
    config = run_config([f"experiment={args.experiment}", f"device={args.device}", *args.override,
                         f"train.max_iters={2 * n + 1}", f"train.log_interval={n}", f"train.eval_interval={10 * n}",
                         f"train.eval_from={10 * n}", "train.target_val_loss=null"])

    def stop_when_measured(it: int) -> None:
        if it == 2 * n:
            raise Measured

    with tempfile.TemporaryDirectory(prefix="bench-", ignore_cleanup_errors=True) as out_dir:  # a throwaway run
        config.out_dir = out_dir
        with contextlib.suppress(Measured):
            train(config, before_step=stop_when_measured)  # n iterations warm up (and compile), n are measured
        ours = read_records(Path(out_dir))[0][-1]
    print(f"train.py: {ours['tokens_per_sec']:.0f} tokens/s", flush=True)  # before the references: a run cut short

    runtime = make_runtime(config.device, config.train.dtype)  # the run's precision, for the reference too
    data = ensure_prepared(config.data)
    t, m = config.train, config.model.with_vocabulary(data.meta["vocab_size"])
    tokens_per_iter = t.batch_size * t.grad_accum * m.block_size
    seconds = {}
    for loop, backend in (("nanoGPT, eager", None), ("nanoGPT, compiled", args.compile_backend)):
        torch.manual_seed(0)
        model = PlainGPT(m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd).to(runtime.device)
        step = nanogpt_step(model, runtime, data.train, t, backend)
        for _ in range(n):  # warm-up, and the compile
            step()
        seconds[loop] = timed(step, runtime.device, n) / n
    seconds["train.py"] = tokens_per_iter / ours["tokens_per_sec"]
    with torch.device("meta"):
        flops_per_token = GPT(m).flops_per_token()
    peak = datasheet_peak(runtime.device, runtime.dtype) if runtime.is_cuda else None
    source = "datasheet" if peak else f"measured {runtime.dtype_name} matmul"
    peak = peak or matmul_flops(runtime.device, runtime.dtype)
    return [{"section": "train", "experiment": args.experiment, "loop": loop, "tokens_per_sec": tokens_per_iter / s,
             "ms_per_iter": 1000 * s, "mfu": flops_per_token * tokens_per_iter / s / peak, "peak": source,
             "vs_compiled_nanogpt": seconds["nanoGPT, compiled"] / s} for loop, s in seconds.items()]


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """A practical peak where no datasheet has one (CPUs, unknown GPUs): the best of five timed n x n matmuls."""
    n, times = (1024, 1) if device.type == "cpu" else (4096, 10)
    a = torch.ones(n, n, device=device, dtype=dtype)  # the values don't matter; the random state stays untouched
    a @ a  # warm-up
    return 2 * n**3 * times / min(timed(lambda: a @ a, device, times) for _ in range(5))


def bench_attention(args: argparse.Namespace) -> list[dict]:
    """Forward + backward of attention alone in the baby GPU model's heads (batch 4, 6 of 64), training's dtype."""
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    rows, shortest = [], {}
    for length, path in itertools.product(sorted(args.lengths), (("flash", None), ("math", None), ("flash", 256))):
        torch.manual_seed(0)
        q, k, v = (torch.randn(4, 6, length, 64, device=args.device, dtype=dtype, requires_grad=True) for _ in range(3))
        run = functools.partial(attention_pass, q, k, v, *path)
        peak, _ = peak_bytes(run, args.device)  # the first pass warms up too
        seconds = min(timed(run, args.device) for _ in range(args.repeats))
        shortest.setdefault(path, seconds)  # the lengths in order: each path's first is its shortest
        rows.append({"section": "attention", "attn_impl": path[0], "window": path[1] or "-", "T": length,
                     "seconds": seconds, "peak_mib": peak / 2**20, "time_vs_shortest": seconds / shortest[path]})
    return rows


def attention_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str, window: int | None) -> None:
    """Causal (or sliding-window) attention on `impl`'s path, and its backward."""
    if impl == "math":
        out, _ = masked_attention(q, k, v, causal_mask(q.size(2), q.size(2), q.device, window))
    elif window:
        out = windowed_attention(q, k, v, window)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))


def peak_bytes(fn: Callable[[], object], device: str) -> tuple[int, int]:
    """The peak bytes fn adds to those allocated, and the allocator's whole reserved peak (CUDA's; 0 elsewhere): the
    CUDA allocator's peaks, or on a CPU the peak of live tensor bytes from the allocations and frees the profiler
    records (RSS would count the allocator's slack too)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - allocated, torch.cuda.max_memory_reserved()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    return max(itertools.accumulate((change for _, change in changes), initial=0)), 0


def cpu_model(block_size: int, **options: object) -> GPT:
    """The CPU preset's shape with random weights, in eval mode."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=block_size, n_layer=4, n_head=4, n_embd=128, bias=False,
                         **options)).eval()


def bench_sampling(args: argparse.Namespace) -> list[dict]:
    rows = []
    rolling = {"pos_emb": "rope", "attn_window": args.attn_window, "window_pattern": "SSSS"}
    for impl, window in itertools.product(("flash", "math"), dict.fromkeys([None, args.attn_window])):
        model = cpu_model(args.block_size, attn_impl=impl, **(rolling if window else {})).to(args.device)
        prompt = torch.randint(65, (1, 8), device=args.device)
        seconds = {}
        for use_cache in (False, True):
            model.generate(prompt, 4, use_cache=use_cache)  # warm-up
            run = functools.partial(model.generate, prompt, args.new_tokens, use_cache=use_cache)
            seconds[use_cache] = min(timed(run, args.device) for _ in range(args.repeats))
        rows += [{"section": "sampling", "attn_impl": impl, "window": window or "-", "kv_cache": use_cache,
                  "new_tokens": args.new_tokens, "seconds": s, "tokens_per_sec": args.new_tokens / s,
                  "speedup": seconds[False] / s} for use_cache, s in seconds.items()]
    return rows


def bench_batched_sampling(args: argparse.Namespace) -> list[dict]:
    model = cpu_model(args.block_size).to(args.device)
    sampler = Sampler(model, CharTokenizer([chr(32 + i) for i in range(65)]), make_runtime(args.device, "auto"))
    decoding = Decoding(**NANOGPT_SAMPLING)
    prompt = torch.randint(65, (8,)).tolist()
    n, new = args.num_samples, args.new_tokens
    nanogpt = functools.partial(model.generate, torch.tensor([prompt], device=args.device), new, use_cache=False,
                                **NANOGPT_SAMPLING)  # nanoGPT's generate: each step runs the last block_size tokens
    ways: dict[str, Callable[[], object]] = {
        "nanoGPT's loop, one at a time": lambda: [nanogpt() for _ in range(n)],
        "one at a time, KV cache": lambda: [sampler.generate(prompt, 1, new, decoding) for _ in range(n)],
        "one batch, KV cache (sample.py)": lambda: sampler.generate(prompt, n, new, decoding),
        "the same, streamed": lambda: sampler.generate(prompt, n, new, decoding, stream=io.StringIO()),
    }
    sampler.generate(prompt, n, 4, decoding)  # warm-up
    seconds = {way: min(timed(run, args.device) for _ in range(args.repeats)) for way, run in ways.items()}
    reference = seconds["nanoGPT's loop, one at a time"]
    return [{"section": "sampling: batch and nanoGPT", "way": way, "samples": n, "new_tokens": new,
             "block_size": args.block_size, "seconds": s, "tokens_per_sec": n * new / s, "vs_nanogpt": reference / s}
            for way, s in seconds.items()]


# --- memory: a training step's peak, predicted (training_memory, behind docs/gpu.md's table of what fits) and measured
GIB = 2**30
GPT2_SHAPES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
               "gpt2-xl": (48, 25, 1600)}
GPU_GIB = (24, 40, 80, 141)  # a 4090 or 3090, an A100 40GB, an A100/H100 80GB, an H200
# Assumed, not yet measured on a GPU (scripts/gpu_check.py reports both): memory outside PyTorch's allocator (the
# CUDA context and its kernels), and the allocator's reserved memory over its peak of live tensors.
CUDA_CONTEXT = GIB // 2
RESERVED_OVER_ALLOCATED = 1.05
STEP_TOKENS = 491_520  # nanoGPT's GPT-2 step (12 x 1024 x 40): grad_accum reaches it from the largest batch
# (n_layer, n_embd, block_size, batch_size, checkpointing, vocab_size, bf16, compiled); about a second each on CPU
# eager, the compiled ones half a minute or more
MEMORY_PROBES = {
    "cpu": [(2, 128, 256, 8, 0, 50257, 0, 0), (6, 192, 256, 16, 1, 65, 0, 0), (2, 128, 256, 8, 1, 50257, 1, 0),
            (6, 192, 256, 16, 0, 65, 0, 0), (6, 192, 256, 16, 0, 65, 1, 0), (6, 192, 256, 16, 1, 65, 1, 0),
            (4, 128, 256, 8, 0, 65, 0, 1)],
    "cuda": [(12, 768, 1024, 16, 0, 50257, 1, 0), (12, 768, 1024, 16, 1, 50257, 1, 0),
             (12, 768, 1024, 12, 0, 50257, 1, 1)],  # compiled: gpu_check.py's GPT-2 run's graph, in inductor's cache
}


def training_memory(config: GPTConfig, batch_size: int, bf16: bool, checkpointing: bool = False) -> int:
    """Predicted peak bytes of live tensors in an AdamW step, fitted to CPU measurements (docs/gpu.md: each term)."""
    n, V = _parameters_and_rows(dataclasses.astuple(config))
    C, L = config.n_embd, config.n_layer
    layer = (36 if bf16 else 64) * C + 24 + (2 * C if config.dropout > 0 else 0)
    head = (14 if bf16 else 16) * V + (10 if bf16 else 15) * C
    recompute = layer + (12 if bf16 else 20) * C  # one block's activations and their gradients
    tokens = batch_size * config.block_size
    if checkpointing:
        activations = max(tokens * (L * 4 * C + max(head, recompute)), 4 * n + tokens * (4 * C + recompute))
    else:
        activations = max(tokens * (L * layer + head), 4 * n)
    casts = 2 * (12 * C * C * (1 if checkpointing else L) + V * C) if bf16 else 0
    return 12 * n + casts + activations


@functools.lru_cache(maxsize=64)
def _parameters_and_rows(shape: tuple) -> tuple[int, int]:
    """GPT(GPTConfig(*shape))'s parameter count and token-table rows, from a model on the meta device."""
    with torch.device("meta"):
        model = GPT(GPTConfig(*shape))
    return model.num_params(non_embedding=False), model.transformer.wte.num_embeddings


def largest_batch(config: GPTConfig, gpu_bytes: float, bf16: bool, checkpointing: bool) -> int:
    """The largest micro-batch (up to 4096) whose training fits on a GPU of `gpu_bytes`: the predicted tensors with
    the allocator's reserve, plus the CUDA context; 0 if not one."""
    budget = (gpu_bytes - CUDA_CONTEXT) / RESERVED_OVER_ALLOCATED
    return bisect.bisect_right(range(1, 4097), budget, key=lambda b: training_memory(config, b, bf16, checkpointing))


def bench_memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, (n_layer, n_head, n_embd) in GPT2_SHAPES.items():
        model = GPTConfig(vocab_size=50257, vocab_multiple=64, block_size=1024, n_layer=n_layer, n_head=n_head,
                          n_embd=n_embd, bias=False)  # as the gpt2 presets train it
        for gib in GPU_GIB:
            row = {"section": "memory: what fits (bf16, block 1024)", "model": name, "gpu_gib": gib}
            for label, ck in (("plain", False), ("checkpointed", True)):
                batch = largest_batch(model, gib * GIB, True, ck)
                accum = -(-STEP_TOKENS // (batch * 1024)) if batch else 0
                row[label] = f"batch_size={batch} grad_accum={accum}" if batch else "does not fit"
            rows.append(row)
    probes = MEMORY_PROBES.get(torch.device(args.device).type, [])[: args.memory_probes]
    return rows + [probe_row(probe, args.device) for probe in probes]


def probe_row(probe: tuple[int, ...], device: str, backend: str = "inductor") -> dict:
    """A probe's prediction against the peak bytes of an AdamW step, its weights and AdamW's state included: measured
    on the second step (the first makes AdamW's state, and compiles, whose own allocations are left out). On CUDA also
    the allocator's reserved peak over the allocated one."""
    n_layer, n_embd, block_size, batch_size, checkpointing, vocab, bf16, compiled = probe
    config = GPTConfig(vocab_size=vocab, vocab_multiple=64, block_size=block_size, n_layer=n_layer,
                       n_head=n_embd // 64, n_embd=n_embd, bias=False, activation="gelu_tanh")  # as the gpt2 presets
    device_type = torch.device(device).type
    gc.collect()
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    model.activation_checkpointing = bool(checkpointing)
    forward = torch.compile(model, backend=backend) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device_type == "cuda" or None)

    def step() -> None:
        """An AdamW step on random tokens, contiguous as the trainer hands them to a GPU (their strides are part of a
        compiled graph)."""
        block = torch.randint(vocab, (batch_size, block_size + 1), device=device)
        with torch.autocast(device_type, torch.bfloat16, enabled=bool(bf16)):
            _, loss = forward(block[:, :-1].contiguous(), block[:, 1:].contiguous())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    live = sum(t.numel() * t.element_size() for t in (*model.parameters(), *state))
    added, reserved = peak_bytes(step, device)
    measured, predicted = live + added, training_memory(config, batch_size, bool(bf16), bool(checkpointing))
    return {"section": f"memory: predicted against measured ({device_type})",
            "shape": f"{n_layer}x{n_embd}, vocab {vocab}, block {block_size}, batch {batch_size}",
            "dtype": "bfloat16" if bf16 else "float32", "checkpointing": bool(checkpointing),
            "compiled": bool(compiled), "measured_mib": measured / 2**20, "predicted_mib": predicted / 2**20,
            "predicted_over_measured": predicted / measured, "reserved_over_allocated": reserved / measured or "-"}


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "train": bench_train, "attention": bench_attention, "sampling": bench_sampling,
    "sampling-batch": bench_batched_sampling, "memory": bench_memory,
}


def print_table(rows: list[dict]) -> None:
    """One table per section, each column right-aligned to its widest cell."""
    for section in dict.fromkeys(row["section"] for row in rows):
        part = [row for row in rows if row["section"] == section]
        columns = list(dict.fromkeys(k for row in part for k in row))
        cells = [columns] + [[_cell(row.get(c, "")) for c in columns] for row in part]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        print("\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells), end="\n\n")


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)}; default: all")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each, the best kept")
    parser.add_argument("--experiment", default="shakespeare_char_cpu", help="train: the preset")
    parser.add_argument("--override", action="append", default=[], help="train: a Hydra override, repeatable")
    parser.add_argument("--train-iters", type=int, default=30, help="train: measured after as many warm-up ones")
    parser.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)  # tests: aot_eager
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="attention: T")
    parser.add_argument("--block-size", type=int, default=256, help="sampling and sampling-batch")
    parser.add_argument("--new-tokens", type=int, default=240, help="sampling and sampling-batch")
    parser.add_argument("--attn-window", type=int, help="sampling: also a model with this window in every layer")
    parser.add_argument("--num-samples", type=int, default=8, help="sampling-batch: samples in the batch")
    parser.add_argument("--memory-probes", type=int, default=10, help="memory: at most this many shapes measured")
    args = parser.parse_args()
    if set(args.sections) - set(SECTIONS):
        parser.error(f"unknown section {', '.join(sorted(set(args.sections) - set(SECTIONS)))}; choose from "
                     f"{', '.join(SECTIONS)}")
    rows = [row for name in (args.sections or SECTIONS) for row in SECTIONS[name](args)]
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
