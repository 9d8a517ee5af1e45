"""Compare runs: loss curves in one picture, and a summary table on stdout.

    python plot.py RUN_DIR [RUN_DIR ...] -o loss.png            # runs, or sweep directories holding runs
    python plot.py multirun/2026-11-29/10-00-00 --x time        # x axis: iter (default), time or tokens

The legend names each run by the config keys that differ between the runs; the best val loss is marked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from common.errors import UserError
from common.files import check_writable
from training.metrics import METRICS_NAME, read_records

IGNORED_KEYS = ("out_dir", "resume", "resume_with_changes")  # differ between runs without saying anything about them
KEYS_WIDTH = 60  # the table's "differing keys" column wraps at this width, the legend at twice it


def find_runs(paths: list[Path]) -> list[Path]:
    runs = []
    for path in paths:
        found = [path] if (path / METRICS_NAME).is_file() else sorted(p.parent for p in path.rglob(METRICS_NAME))
        if not found:
            fail(f"no metrics.jsonl in or under {path}; pass train.py run directories or a sweep directory")
        runs += found
    return runs


def fail(message: str) -> None:
    """A user's mistake: one line and status 2, as the other commands."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def picture_path(out: Path) -> Path:
    """Where the picture goes: -o's path, .png added when it has no extension (matplotlib's default, said here
    so the reported name is the real one); an extension matplotlib can't write, or a directory, is refused."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    if out.is_dir():
        fail(f"-o {out} is a directory; name a file such as {out / 'loss.png'}")
    if not out.suffix:
        out = out.with_suffix(".png")
    formats = Figure().canvas.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        fail(f"-o {out}: can't write {out.suffix} pictures; use one of {', '.join('.' + f for f in sorted(formats))}")
    if not out.parent.is_dir():
        fail(f"-o {out}: no directory {out.parent}; create it first")
    try:
        check_writable(out.parent, "-o", shown=f"-o {out}: {out.parent}")
    except UserError as err:
        fail(str(err))
    return out


def flat_config(run: Path) -> dict[str, Any]:
    config = OmegaConf.to_container(OmegaConf.load(run / "config.yaml")) if (run / "config.yaml").is_file() else {}

    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    return walk(config, "")


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    keys = sorted({k for c in configs for k in c} - set(IGNORED_KEYS))
    return [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]


def summarize(run: Path, config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    records, damaged = read_records(run)
    if damaged:
        print(f"warning: {run / METRICS_NAME}: left out {damaged} damaged line(s)", file=sys.stderr)
    evals = [r for r in records if "val_loss" in r]
    logs = [r for r in records if "tokens_per_sec" in r]
    finite = [r for r in evals if math.isfinite(r["val_loss"])]
    best = min(finite, key=lambda r: r["val_loss"]) if finite else None
    speeds = sorted(r["tokens_per_sec"] for r in logs)
    tokens_per_iter = (
        config.get("train.batch_size", 0) * config.get("train.grad_accum", 0) * config.get("model.block_size", 0)
    )
    return {
        "run": run,
        "label": ", ".join(f"{k}={config.get(k)}" for k in keys) or run.name,
        "records": records,
        "best_val": best["val_loss"] if best else None,
        "best_iter": best["iter"] if best else None,
        "iters": max((r["iter"] for r in records), default=0),
        "wall_s": max((r["elapsed_s"] for r in records if "elapsed_s" in r), default=None),
        "tokens_per_sec": speeds[len(speeds) // 2] if speeds else None,
        "tokens_per_iter": tokens_per_iter,
    }


def distinct_labels(summaries: list[dict[str, Any]]) -> None:
    """Runs whose differing keys are the same (repeats of one config) are told apart by their run's name."""
    counts = Counter(s["label"] for s in summaries)
    for s in summaries:
        if counts[s["label"]] > 1:
            s["label"] = f"{s['run'].name}: {s['label']}" if s["label"] != s["run"].name else s["label"]
    if len({s["label"] for s in summaries}) < len(summaries):  # same names too (runs/a/x and runs/b/x)
        for s in summaries:
            s["label"] = f"{s['run']}: {s['label']}"


def print_table(summaries: list[dict[str, Any]]) -> None:
    """One row per run; a long "differing keys" cell wraps onto the lines below it."""
    rows = [["run", "differing keys", "best val", "iters", "tokens/s", "wall time"]]
    for s in summaries:
        keys = textwrap.wrap(s["label"], KEYS_WIDTH, break_on_hyphens=False) or [""]
        rows.append(
            [
                str(s["run"]),
                keys[0],
                f"{s['best_val']:.4f}" if s["best_val"] is not None else "-",
                str(s["iters"]),
                f"{s['tokens_per_sec']:,.0f}" if s["tokens_per_sec"] else "-",
                f"{s['wall_s']:.1f} s" if s["wall_s"] is not None else "-",
            ]
        )
        rows += [["", more, "", "", "", ""] for more in keys[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def plot(summaries: list[dict[str, Any]], x_axis: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    def x_of(record: dict[str, Any], s: dict[str, Any]) -> float:
        if x_axis == "time":
            return record["elapsed_s"]
        if x_axis == "tokens":
            return record["iter"] * s["tokens_per_iter"]
        return record["iter"]

    fig, ax = plt.subplots(figsize=(9, 5 + 0.4 * len(summaries)), layout="constrained")
    for i, s in enumerate(summaries):
        color = f"C{i % 10}"
        train = [r for r in s["records"] if "lr" in r]
        evals = [r for r in s["records"] if "val_loss" in r]
        ax.plot([x_of(r, s) for r in train], [r["train_loss"] for r in train], color=color, alpha=0.35, lw=1)
        ax.plot(
            [x_of(r, s) for r in evals],
            [r["val_loss"] for r in evals],
            color=color,
            marker="o",
            ms=3,
            label=textwrap.fill(
                f"{s['label']} (best val {s['best_val']:.3f})" if s["best_val"] is not None else s["label"],
                2 * KEYS_WIDTH,
            ),
        )
        if s["best_val"] is not None:
            best = next(r for r in evals if r["val_loss"] == s["best_val"])
            ax.plot([x_of(best, s)], [best["val_loss"]], color=color, marker="*", ms=12, mec="black")
    ax.set_yscale("log")  # loss curves flatten out; a log scale keeps the late differences visible
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
    ax.set_xlabel({"iter": "iteration", "time": "wall time (s)", "tokens": "training tokens"}[x_axis])
    ax.set_ylabel("loss (faint: train, dots: val, star: best val)")
    ax.set_title(f"{len(summaries)} run{'s' if len(summaries) > 1 else ''}: loss against {x_axis}")
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside lower center", fontsize=7)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, or directories holding runs")
    parser.add_argument("-o", "--out", type=Path, default=Path("loss.png"))
    parser.add_argument("--x", choices=["iter", "time", "tokens"], default="iter", help="the x axis")
    args = parser.parse_args()
    out = picture_path(args.out)
    runs = find_runs(args.runs)
    configs = [flat_config(run) for run in runs]
    keys = differing_keys(configs)
    summaries = [summarize(run, config, keys) for run, config in zip(runs, configs, strict=True)]
    distinct_labels(summaries)
    print_table(summaries)
    try:
        plot(summaries, args.x, out)
    except OSError as err:  # a read-only directory, a full disk
        fail(f"-o {out}: can't write it ({err.strerror or err})")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
