"""Benchmarks (not tests): timings on this machine, printed as a table, optionally saved as JSON (--json).

    python bench.py                                              # every section
    python bench.py train --experiment shakespeare_char_cpu
    python bench.py sampling --block-size 256 --new-tokens 2000 --attn-window 64

train: train.py's loop against nanoGPT's (benchmarks/reference.py: its plain model on our tokens), eager and compiled
as nanoGPT runs it: tokens/s, ms/iter, MFU (`peak`: its source) and each loop's speed over the compiled reference's.
attention: flash, math and flash with a 256-token window, forward + backward of attention alone, in fresh processes.
sampling: model.generate with and without the KV cache; --attn-window adds a model whose cache rolls.
sampling-batch: sample.py's samples as one batch (also streamed), one at a time, and nanoGPT's sampling loop.
memory: training_memory's predicted peak: what fits on 24-141 GB GPUs, and the prediction against measured ones.
sampling and sampling-batch use the CPU preset's shape with random weights.
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.memory import bench_memory
from benchmarks.reference import PlainGPT, nanogpt_step
from benchmarks.shared import NANOGPT_SAMPLING, REPO, cpu_model, timed
from model import GPT, causal_mask, masked_attention
from model.attention import windowed_attention


def bench_train(args: argparse.Namespace) -> list[dict]:
    from hydra import compose, initialize_config_dir

    from common.config import typed_config
    from common.runtime import datasheet_peak, make_runtime
    from data.prepare import ensure_prepared
    from training.run import train
    from training.schema import TrainRunConfig, register_schemas

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
    model_config = config.model.gpt_config(data.meta["vocab_size"])
    t, m = config.train, model_config
    tokens_per_iter = t.batch_size * t.grad_accum * m.block_size
    seconds = {}
    for loop, backend in (("nanoGPT, eager", None), ("nanoGPT, compiled", args.compile_backend)):
        torch.manual_seed(0)
        model = PlainGPT(m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd).to(runtime.device)
        adamw = {"lr": t.learning_rate, "betas": (t.beta1, t.beta2), "weight_decay": t.weight_decay}
        step = nanogpt_step(model, runtime, data.train, t.batch_size, t.grad_accum, adamw, 1.0, backend)
        for _ in range(n):  # warm-up, and the compile
            step()
        seconds[loop] = timed(step, runtime.device, n) / n
    seconds["train.py"] = tokens_per_iter / ours["tokens_per_sec"]
    with torch.device("meta"):
        flops_per_token = GPT(model_config).flops_per_token()
    peak = datasheet_peak(runtime.device, runtime.dtype) if runtime.is_cuda else None
    source = "datasheet" if peak else f"measured {runtime.dtype_name} matmul"
    peak = peak or matmul_flops(runtime.device, runtime.dtype)
    return [
        {"section": "train", "experiment": args.experiment, "loop": loop, "tokens_per_sec": tokens_per_iter / s,
         "ms_per_iter": 1000 * s, "mfu": flops_per_token * tokens_per_iter / s / peak, "peak": source,
         "vs_compiled_nanogpt": seconds["nanoGPT, compiled"] / s}
        for loop, s in seconds.items()
    ]


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """A practical peak where no datasheet has one (CPUs, unknown GPUs): the best of five timed n x n matmuls."""
    n, times = (1024, 1) if device.type == "cpu" else (4096, 10)
    a = torch.ones(n, n, device=device, dtype=dtype)  # the values don't matter; the random state stays untouched
    a @ a  # warm-up
    return 2 * n**3 * times / min(timed(lambda: a @ a, device, times) for _ in range(5))


ATTN_SHAPE = (4, 6, 64)  # (batch, heads, head_dim): the baby GPU model's heads
ATTN_KINDS = (("flash", None), ("math", None), ("flash", 256))  # (attn_impl, window)


def bench_attention(args: argparse.Namespace) -> list[dict]:
    rows = []
    for length, (impl, window) in itertools.product(args.lengths, ATTN_KINDS):
        probe = [sys.executable, str(REPO / "bench.py"), "--device", args.device, "--repeats", str(args.repeats),
                 "--attention-probe", impl, str(length), str(window or 0)]
        result = subprocess.run(probe, capture_output=True, text=True, check=True)  # a fresh process: a clean peak
        rows.append({"section": "attention", "attn_impl": impl, "window": window or "-", "T": length,
                     **json.loads(result.stdout)})
    for row in rows:
        same_kind = [r for r in rows if (r["attn_impl"], r["window"]) == (row["attn_impl"], row["window"])]
        row["time_vs_shortest"] = row["seconds"] / min(same_kind, key=lambda r: r["T"])["seconds"]
    return rows


def attention_probe(impl: str, length: int, window: int | None, device: str, repeats: int) -> dict:
    """Forward + backward of causal (or sliding-window) attention alone; peak memory above the inputs, in MiB."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # as training runs on each
    q, k, v = (torch.randn(*ATTN_SHAPE[:2], length, ATTN_SHAPE[2], device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

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
    from common.runtime import make_runtime
    from data.tokenizers import CharTokenizer
    from inference.sampling import Sampler
    from model.gpt import Decoding

    model = cpu_model(args.block_size).to(args.device)
    sampler = Sampler(model, CharTokenizer([chr(32 + i) for i in range(65)]), make_runtime(args.device, "auto"))
    decoding = Decoding(**NANOGPT_SAMPLING)
    prompt = torch.randint(65, (8,)).tolist()
    n, new = args.num_samples, args.new_tokens
    ways: dict[str, Callable[[], object]] = {
        "nanoGPT's loop, one at a time": lambda: [_nanogpt_sample(model, prompt, new, args.device) for _ in range(n)],
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


@torch.no_grad()
def _nanogpt_sample(model: GPT, prompt: list[int], max_new_tokens: int, device: str) -> torch.Tensor:
    """nanoGPT's model.generate as written: every step runs the last block_size tokens, whole."""
    idx = torch.tensor([prompt], device=device)
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -model.config.block_size :]
        logits = model.logits(model.hidden(idx_cond)[:, [-1], :])[:, -1, :] / NANOGPT_SAMPLING["temperature"]
        v, _ = torch.topk(logits, min(NANOGPT_SAMPLING["top_k"], logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("Inf")
        idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
    return idx


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "train": bench_train, "attention": bench_attention, "sampling": bench_sampling,
    "sampling-batch": bench_batched_sampling, "memory": bench_memory,
}


def print_table(rows: list[dict]) -> None:
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
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.attention_probe:
        impl, length, window = args.attention_probe
        print(json.dumps(attention_probe(impl, int(length), int(window) or None, args.device, args.repeats)))
    else:
        rows = [row for name in (args.sections or SECTIONS) for row in SECTIONS[name](args)]
        print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
        print_table(rows)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
