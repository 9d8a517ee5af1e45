"""Benchmarks (not tests): timings on this machine as a table, and as JSON with --json. Sections (default: all):

train           train.py's loop against nanoGPT's (PlainGPT and nanogpt_step below: its model and loop on our tokens),
                eager and compiled: tokens/s, ms/iter, MFU (`peak`: its source), speed over the compiled reference's
attention       flash, math and flash with a 256-token window: forward + backward of attention alone, fresh processes
sampling        model.generate with and without the KV cache; --attn-window adds a model whose cache rolls
sampling-batch  sample.py's samples as one batch (also streamed), one at a time, and nanoGPT's sampling loop
memory          training_memory's prediction: what fits on 24-141 GB GPUs, and the prediction against measurements

    python bench.py train --experiment shakespeare_char_cpu
    python bench.py sampling --block-size 256 --new-tokens 2000 --attn-window 64   # the CPU preset's shape, random
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn

from benchmarks.memory import bench_memory
from common.config import typed_config
from common.runtime import Runtime, datasheet_peak, make_runtime, synchronize
from data.prepare import TokenFiles, ensure_prepared
from data.tokenizers import CharTokenizer
from inference.sampling import Sampler
from model import GPT, GPTConfig, causal_mask, masked_attention
from model.attention import windowed_attention
from model.gpt import Decoding
from training.run import train
from training.schema import OptimConfig, TrainRunConfig, register_schemas

REPO = Path(__file__).resolve().parent
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


def nanogpt_step(model: PlainGPT, runtime: Runtime, tokens: TokenFiles, t: OptimConfig,
                 backend: str | None) -> Callable[[], None]:
    """One iteration of nanoGPT's train.py loop at the run's batch size, grad_accum and AdamW settings: the model
    compiled by torch.compile's `backend` (None: eager), the next batch drawn while the device runs the forward,
    fused AdamW where the device has it, clipping at 1.0."""
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


def bench_train(args: argparse.Namespace) -> list[dict]:
    register_schemas()
    n = args.train_iters
    overrides = [f"experiment={args.experiment}", f"device={args.device}", *args.override, f"train.max_iters={2 * n}",
                 f"train.log_interval={n}", f"train.eval_interval={10 * n}", "train.eval_iters=1",
                 "train.target_val_loss=null"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = typed_config(compose(config_name="config", overrides=overrides), TrainRunConfig)
    config.out_dir = tempfile.mkdtemp(prefix="bench-")
    try:  # the first n iterations warm up (and compile), the second n are measured; a throwaway run
        train(config)
        ours = [json.loads(line) for line in (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()][-2]
    finally:
        shutil.rmtree(config.out_dir, ignore_errors=True)

    runtime = make_runtime(config.device, config.train.dtype)  # the run's precision, for the reference too
    data = ensure_prepared(config.data)
    t, m = config.train, config.model.gpt_config(data.meta["vocab_size"])
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
    rows = []
    for length, (impl, window) in itertools.product(args.lengths, (("flash", 0), ("math", 0), ("flash", 256))):
        probe = [sys.executable, str(REPO / "bench.py"), "--device", args.device, "--repeats", str(args.repeats),
                 "--attention-probe", impl, str(length), str(window)]
        result = subprocess.run(probe, capture_output=True, text=True, check=True)  # a fresh process: a clean peak
        rows.append({"section": "attention", "attn_impl": impl, "window": window or "-", "T": length,
                     **json.loads(result.stdout)})
    for row in rows:
        shortest = min((r for r in rows if (r["attn_impl"], r["window"]) == (row["attn_impl"], row["window"])),
                       key=lambda r: r["T"])
        row["time_vs_shortest"] = row["seconds"] / shortest["seconds"]
    return rows


def attention_probe(impl: str, length: int, window: int | None, device: str, repeats: int) -> dict:
    """Forward + backward of causal (or sliding-window) attention alone, in the baby GPU model's heads (batch 4, 6
    heads of 64); peak memory above the inputs, in MiB."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # as training runs on each
    q, k, v = (torch.randn(4, 6, length, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def run() -> None:
        if impl == "math":
            out, _ = masked_attention(q, k, v, causal_mask(length, length, device, window))
        elif window:
            out = windowed_attention(q, k, v, window)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run()
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": min(timed(run, device) for _ in range(repeats)), "peak_mib": (peak - base) / 2**20}


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
    parser.add_argument("--attention-probe", nargs=3, metavar=("IMPL", "T", "W"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if set(args.sections) - set(SECTIONS):
        parser.error(f"unknown section {', '.join(sorted(set(args.sections) - set(SECTIONS)))}; choose from "
                     f"{', '.join(SECTIONS)}")
    if args.attention_probe:
        impl, length, window = args.attention_probe
        print(json.dumps(attention_probe(impl, int(length), int(window) or None, args.device, args.repeats)))
        return
    rows = [row for name in (args.sections or SECTIONS) for row in SECTIONS[name](args)]
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
