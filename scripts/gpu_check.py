"""Every GPU check in one run of at most 8 minutes (BUDGET_S), for a short loan of an H200-class GPU: flash and
math attention agree (fp32 and bf16, full and windowed); the model compiles as one graph; a training step's peak
memory against bench.py's prediction; experiment=shakespeare and speedrun_gpu train to val <= 1.47; GPT-2 124M's
tokens/s and MFU. Exits 1 if a check fails.

    python scripts/gpu_check.py --text input.txt --out gpu_check.json     # on the GPU (--text: tiny Shakespeare)
    python scripts/gpu_check.py --dry-run --text input.txt                 # the same steps, tiny, on CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model import GPT, GPTConfig  # noqa: E402

TINY_MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]
# seconds each step may take on an H200 (the dry run on CPU is timed against the same table)
BUDGET_S = {"flash = math": 15, "compile": 60, "memory": 45, "shakespeare": 150, "speedrun_gpu": 90, "gpt2": 120}


def compiled_graphs(device: str, config: GPTConfig) -> dict:
    """torch.compile (inductor, fullgraph) of the model: graphs made over three training steps (1 expected)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        block = torch.randint(config.vocab_size, (4, config.block_size + 1), device=device)  # as get_batch cuts it
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            _, loss = compiled(block[:, :-1], block[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    graphs = counters["stats"]["unique_graphs"]
    return {"check": "compile: one graph, no recompiles", "ok": graphs == 1, "graphs": graphs}


def peak_memory(args: argparse.Namespace, workdir: Path) -> dict:
    """bench.py memory: the predicted peak against the measured one, without and with activation checkpointing."""
    rows, error = bench(args, workdir, "memory", "--memory-probes", "2")
    measured = [r for r in rows if r["section"].startswith("memory: predicted")]  # plain, then checkpointed
    ratios, mib = [r["predicted_over_measured"] for r in measured], [r["measured_mib"] for r in measured]
    return {"check": "memory: peak against the prediction", "ok": bool(ratios) and 0.85 <= ratios[0] <= 1.15,
            "measured_gib": mib[0] / 1024 if mib else None, "predicted_over_measured": ratios[0] if ratios else None,
            "checkpointed_predicted_over_measured": ratios[1] if len(ratios) > 1 else None,
            "checkpointing_saves": 1 - mib[1] / mib[0] if mib[1:] else None, "stderr_tail": error}


def bench(args: argparse.Namespace, workdir: Path, section: str, *options: str) -> tuple[list[dict], str]:
    """bench.py's rows of one section on the check's device, and the tail of its stderr if it failed."""
    out = workdir / f"{section}.json"
    device = "cpu" if args.dry_run else "cuda"
    command = [sys.executable, str(REPO / "bench.py"), section, "--device", device, *options, "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    return ([], result.stderr[-500:]) if result.returncode else (json.loads(out.read_text()), "")


def paths_agree(device: str, dtype: torch.dtype, config: GPTConfig, tolerance: float) -> dict:
    """Largest difference of logits and gradients between the paths, relative to the largest value."""
    torch.manual_seed(0)
    models = {impl: GPT(replace(config, attn_impl=impl)).to(device) for impl in ("flash", "math")}
    models["math"].load_state_dict(models["flash"].state_dict())
    idx = torch.randint(config.vocab_size, (4, config.block_size), device=device)
    results = {}
    for impl, model in models.items():
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            logits, loss = model(idx, idx)
        loss.backward()
        results[impl] = (logits.float(), torch.cat([p.grad.flatten() for p in model.parameters()]).float())
    rel = {name: ((results["flash"][i] - results["math"][i]).abs().max() / results["math"][i].abs().max()).item()
           for i, name in enumerate(("logits", "grads"))}
    dtype_name = str(dtype).removeprefix("torch.")
    window = "" if config.attn_window is None else f", window {config.attn_window}"
    return {"check": f"flash = math ({dtype_name}{window})", "ok": max(rel.values()) <= tolerance, **rel,
            "tolerance": tolerance}


def train_to_target(args: argparse.Namespace, workdir: Path, experiment: str) -> dict:
    target = 4.0 if args.dry_run else 1.47
    overrides = [f"experiment={experiment}", f"out_dir={workdir / experiment}", f"data.dir={workdir / 'data'}",
                 f"train.target_val_loss={target}", "model.attn_impl=flash"]
    if args.text:
        overrides.append(f"data.input={args.text}")
    if args.dry_run:
        overrides += [*TINY_MODEL, "device=cpu", "train.batch_size=8", "train.max_iters=40", "train.eval_interval=10",
                      "train.eval_iters=4", "train.warmup_iters=5"]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], capture_output=True, text=True)
    metrics = workdir / experiment / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    reached = [r for r in records if "time_to_target_s" in r]
    evals = [r for r in records if "val_loss" in r]
    return {"check": f"{experiment} to val <= {target}", "ok": result.returncode == 0 and bool(reached),
            "time_to_target_s": reached[0]["time_to_target_s"] if reached else None,
            "val_loss": evals[-1]["val_loss"] if evals else None, "iters": evals[-1]["iter"] if evals else None,
            "wall_s": time.perf_counter() - start, "stderr_tail": result.stderr[-500:] if result.returncode else ""}


def gpt2_throughput(args: argparse.Namespace, workdir: Path) -> dict:
    text = [f"data.input={args.text}"] if args.text else []
    if args.dry_run:
        overrides = [*TINY_MODEL, "data=shakespeare_char", f"data.dir={workdir / 'data'}", "train.batch_size=4",
                     "train.grad_accum=1", *text]
    else:  # tiny Shakespeare in GPT-2's BPE, not the preset's FineWeb-Edu: throughput doesn't depend on the text
        overrides = ["data=shakespeare", f"data.dir={workdir / 'data_bpe'}", "train.grad_accum=4", *text]
    iters = "3" if args.dry_run else "10"
    options = [option for override in overrides for option in ("--override", override)]
    rows, error = bench(args, workdir, "train", "--experiment", "gpt2", "--train-iters", iters, *options)
    ours = next((r for r in rows if r["loop"] == "train.py"), {})
    return {"check": "GPT-2 124M throughput" + (" (tiny stand-in)" if args.dry_run else ""), "ok": bool(ours),
            "tokens_per_sec": ours.get("tokens_per_sec"), "mfu": ours.get("mfu"), "peak": ours.get("peak"),
            "stderr_tail": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: checks that the script works")
    parser.add_argument("--text", type=Path, help="tiny Shakespeare's input.txt")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; use --dry-run to check the script on CPU")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 comparison means fp32
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    config = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)
    if args.dry_run:
        config = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)
    # A window that is no multiple of FlexAttention's 128-token blocks, over all but the last layer.
    windowed = replace(config, attn_window=5 if args.dry_run else 100, pos_emb="rope")
    # The dry run compiles tests/test_compile.py's windowed GPT-2 block, whose graphs inductor's cache then holds
    tiny_windowed = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=32, attn_window=16,
                              window_pattern="SL")
    compiled_shape = tiny_windowed if args.dry_run else windowed
    steps = [
        ("flash = math", lambda: paths_agree(device, torch.float32, config, tolerance=1e-4)),
        ("flash = math", lambda: paths_agree(device, torch.bfloat16, config, tolerance=5e-2)),
        ("flash = math", lambda: paths_agree(device, torch.float32, windowed, tolerance=1e-4)),
        ("flash = math", lambda: paths_agree(device, torch.bfloat16, windowed, tolerance=5e-2)),
        ("compile", lambda: compiled_graphs(device, compiled_shape)),
        ("memory", lambda: peak_memory(args, workdir)),
        ("shakespeare", lambda: train_to_target(args, workdir, "shakespeare")),  # nanoGPT's baby GPT
        ("speedrun_gpu", lambda: train_to_target(args, workdir, "speedrun_gpu")),  # the goal: <= 60 s
        ("gpt2", lambda: gpt2_throughput(args, workdir)),
    ]
    results = []
    for budget, run in steps:
        began = time.perf_counter()
        result = run()
        result["took_s"] = time.perf_counter() - began
        result["budget_s"] = BUDGET_S[budget] / len([b for b, _ in steps if b == budget])
        results.append(result)
        details = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
                            if k not in ("check", "ok", "took_s", "budget_s") and v not in (None, ""))
        over = " OVER BUDGET" if result["took_s"] > result["budget_s"] else ""
        print(f"{'PASS' if result['ok'] else 'FAIL'}  {result['check']}: {details} "
              f"[{result['took_s']:.0f} s of {result['budget_s']:.0f} s{over}]", flush=True)
    total = sum(r["took_s"] for r in results)
    print(f"total {total:.0f} s of {sum(BUDGET_S.values())} s")
    shutil.rmtree(workdir, ignore_errors=True)  # throwaway runs and token files
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
