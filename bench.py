"""Benchmarks (not tests): timings on this machine, printed as a table, optionally saved as JSON (--json).

    python bench.py                                              # every section
    python bench.py train --experiment shakespeare_char_cpu
    python bench.py sampling --block-size 256 --new-tokens 2000 --attn-window 64
    python bench.py serve --serve-clients 1 16 --serve-requests 20

train: train.py's loop against a plain eager nanoGPT-style loop: tokens/s, ms/iter and MFU (`peak`: its source).
attention: flash, math and flash with a 256-token window, forward + backward of attention alone, in fresh processes.
sampling: model.generate with and without the KV cache; --attn-window adds a model whose cache rolls.
sampling-batch: sample.py's samples as one batch (also streamed), one at a time, and nanoGPT's sampling loop.
serve: serve.py under --serve-clients streaming clients, against sample.py's one sample and the engine alone.
muon: Newton-Schulz, ours (float32, bfloat16) against torch.optim.Muon's: time, and how near U V^T each gets.
memory: training_memory's predicted peak: what fits on 24-141 GB GPUs, and the prediction against a measured one.
sampling, sampling-batch and serve use the CPU preset's shape with random weights.
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
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.memory import bench_memory, memory_probe
from benchmarks.serve import bench_serve
from benchmarks.shared import NANOGPT_SAMPLING, REPO, cpu_model, timed
from model import GPT, causal_mask, masked_attention
from model.attention import windowed_attention

if TYPE_CHECKING:  # imported where used: most sections need no inference code
    pass



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
    t = config.train
    tokens_per_iter = t.batch_size * t.grad_accum * model_config.block_size
    torch.manual_seed(0)
    model = GPT(model_config).to(runtime.device)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.beta1, t.beta2), fused=runtime.is_cuda)
    train_bin, block = data.train.paths[0], model_config.block_size

    def nanogpt_step() -> None:
        """nanoGPT's train.py loop as written, eager: its batch assembly, AdamW and clipping."""
        for _ in range(t.grad_accum):
            tokens = np.memmap(train_bin, dtype=np.uint16, mode="r")
            ix = torch.randint(len(tokens) - block, (t.batch_size,))
            x, y = (torch.stack([torch.from_numpy(tokens[i + s : i + s + block].astype(np.int64)) for i in ix])
                    for s in (0, 1))
            with runtime.autocast():
                _, loss = model(x.to(runtime.device), y.to(runtime.device))
            (loss / t.grad_accum).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(n):
        nanogpt_step()
    reference = n * tokens_per_iter / timed(nanogpt_step, runtime.device, n)
    peak = datasheet_peak(runtime.device, runtime.dtype) if runtime.is_cuda else None
    source = "datasheet" if peak else f"measured {runtime.dtype_name} matmul"
    peak = peak or matmul_flops(runtime.device, runtime.dtype)
    return [
        {"section": "train", "experiment": args.experiment, "loop": loop, "tokens_per_sec": tps,
         "ms_per_iter": 1000 * tokens_per_iter / tps, "mfu": model.flops_per_token() * tps / peak, "peak": source,
         "speedup": tps / reference}
        for loop, tps in (("nanogpt-style eager", reference), ("train.py", ours["tokens_per_sec"]))
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
        logits = model.lm_head(model.hidden(idx_cond)[:, [-1], :])[:, -1, :] / NANOGPT_SAMPLING["temperature"]
        v, _ = torch.topk(logits, min(NANOGPT_SAMPLING["top_k"], logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("Inf")
        idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
    return idx


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
        ways["torch.optim.Muon's (bfloat16)"] = lambda g: torch_newton_schulz(g, NS_COEFFICIENTS, DEFAULT_NS_STEPS, EPS)
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
            run = functools.partial(fn, grad)
            seconds[way] = min(timed(run, args.device, calls) for _ in range(args.repeats))
            singular = torch.linalg.svdvals(out)
            ours = outputs["ours, float32"]
            rows.append({"section": "muon: Newton-Schulz", "shape": shape, "way": way,
                         "ms": 1000 * seconds[way] / calls, "sv_min": singular.min().item(),
                         "sv_max": singular.max().item(), "err_vs_uvt": ((out - exact).norm() / exact.norm()).item(),
                         "diff_vs_ours_fp32": ((out - ours).norm() / ours.norm()).item(),
                         "speedup": seconds["ours, float32"] / seconds[way]})
    return rows


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "train": bench_train, "attention": bench_attention, "sampling": bench_sampling,
    "sampling-batch": bench_batched_sampling, "serve": bench_serve, "muon": bench_muon, "memory": bench_memory,
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
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="attention: T")
    parser.add_argument("--block-size", type=int, default=256, help="sampling and sampling-batch")
    parser.add_argument("--new-tokens", type=int, default=240, help="sampling and sampling-batch")
    parser.add_argument("--attn-window", type=int, help="sampling: also a model with this window in every layer")
    parser.add_argument("--num-samples", type=int, default=8, help="sampling-batch: samples in the batch")
    parser.add_argument("--serve-clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--serve-requests", type=int, default=4, help="serve: requests each client sends in a row")
    # the baby model's c_attn, attention c_proj, c_fc, MLP c_proj (out x in); then GPT-2 124M's
    muon_shapes = ["384x128", "128x128", "512x128", "128x512", "2304x768", "768x768", "3072x768", "768x3072"]
    parser.add_argument("--muon-shapes", nargs="+", default=muon_shapes, metavar="ROWSxCOLS")
    parser.add_argument("--memory-probes", type=int, default=10, help="memory: at most this many shapes measured")
    parser.add_argument("--attention-probe", nargs=3, metavar=("IMPL", "T", "W"), help=argparse.SUPPRESS)
    parser.add_argument("--memory-probe", type=int, nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.memory_probe:
        print(json.dumps(memory_probe(args.device, tuple(args.memory_probe))))
    elif args.attention_probe:
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
