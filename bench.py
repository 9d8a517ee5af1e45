"""Benchmarks (not tests): timings on this machine, printed as a table, optionally saved as JSON.

    python bench.py                      # every section
    python bench.py sampling --json out.json

sampling: tokens/s of model.generate with and without the KV cache, on both attention paths, for a
random-weight GPT (4 layers, width 128, block 256 by default) writing 240 tokens after an 8-token prompt.
Speed doesn't depend on the weights. Each figure is the best of --repeats runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from model import ATTN_IMPLS, GPT, GPTConfig


def bench_sampling(args: argparse.Namespace) -> list[dict]:
    rows = []
    for impl in ATTN_IMPLS:
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=65,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            attn_impl=impl,
        )
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
                    "kv_cache": use_cache,
                    "new_tokens": args.new_tokens,
                    "seconds": s,
                    "tokens_per_sec": args.new_tokens / s,
                    "speedup": seconds[False] / s,
                }
            )
    return rows


def _timed(fn: Callable[[], object], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {"sampling": bench_sampling}


def print_table(rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if value < 1000 else f"{value:,.0f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", choices=[*SECTIONS, []], help="default: all")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=240)
    args = parser.parse_args()
    rows = [row for name in (args.sections or SECTIONS) for row in SECTIONS[name](args)]
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
