"""Compare runs: loss curves in one picture, a summary table on stdout and, for runs repeated over seeds, whether
each difference is bigger than seed noise.

    python plot.py RUN_DIR [RUN_DIR ...] -o loss.png            # runs, or sweep directories holding runs
    python plot.py multirun/2026-11-29/10-00-00                 # the picture: multirun/2026-11-29/10-00-00/loss.png
    python plot.py multirun/2026-11-29/10-00-00 --x time        # x axis: iter (default), time or tokens
    python plot.py multirun/DATE/TIME --baseline model.qk_norm=true --json ab.json   # groups of seeds, A/B tests

The legend names each run by the config keys that differ between the runs; the best val loss is marked. Runs that
differ only by seed form a group (analysis/stats.py): its mean curve with the runs' min-max band, its metric's mean
and 95 % interval, and each group against the baseline by Welch's t-test. Without -o, the picture goes into the folder
given (several: the deepest folder holding them all). A run plot.py can't read (a value that isn't a number, a log
line without its loss, a config.yaml that isn't YAML or holds an alias, a metrics.jsonl that isn't a regular file)
is skipped with one warning; a run without config.yaml is in no group.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import statistics
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

from analysis.stats import Comparison, Damaged, Group, Loaded, compare, find_baseline, group_runs, load_run, run_value
from common.cli import fail
from common.errors import DiskFull
from common.runtime import write_atomically, write_text_atomically
from training.trainer import METRICS_NAME

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


def sweep_folder(paths: list[Path]) -> Path:
    """Where the picture goes without -o: the folder given, or the deepest one holding all those given."""
    return paths[0] if len(paths) == 1 else Path(os.path.commonpath([p.absolute() for p in paths]))


def picture_path(out: Path) -> Path:
    """-o's path, .png added when it has no extension, checked before any work."""
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
    replaceable(out, "-o")
    return out


def replaceable(path: Path, option: str) -> None:
    """Refuse an output that exists and isn't a regular file (nor a link to one): a FIFO or a device is someone's
    channel, not a file to replace. Outputs are written beside the path and renamed over it: a link is replaced."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # none yet, or a dangling link: the rename makes it
    if not stat.S_ISREG(mode):
        fail(f"{option} {path}: not a regular file{' behind a link' if path.is_symlink() else ''} (a FIFO, a device); "
             "name a file")


def load_runs(runs: list[Path], needed: tuple[str, ...]) -> list[Loaded]:
    """The runs that can be read; one warning for each that can't, or one line and status 2 if none can."""
    loaded, problems = [], []
    for run in runs:
        try:
            loaded.append(load_run(run, needed))
        except Damaged as err:
            problems.append(str(err))
    if not loaded:
        fail(f"{problems[0]}; nothing left to plot" if len(problems) == 1 else
             f"all {len(problems)} runs are damaged, the first: {problems[0]}; fix or leave them out")
    for run, _, _, damaged in loaded:
        if damaged:
            print(f"warning: {run / METRICS_NAME}: left out {damaged} damaged line(s)", file=sys.stderr)
    for problem in problems:
        print(f"warning: {problem}; run skipped", file=sys.stderr)
    return loaded


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The keys whose values differ between the runs that have them: a run without config.yaml lacks every key."""
    keys = sorted({k for c in configs for k in c} - set(IGNORED_KEYS))
    return [k for k in keys if len({json.dumps(c[k], default=str) for c in configs if k in c}) > 1]


def summarize(run: Path, config: dict[str, Any], records: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    finite = [r["val_loss"] for r in records if "val_loss" in r and math.isfinite(r["val_loss"])]
    speeds = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
    batch, accum, block = (config.get(k, 0) for k in ("train.batch_size", "train.grad_accum", "model.block_size"))
    return {
        "run": run,
        "label": ", ".join(f"{k}={config[k]}" for k in keys if k in config) or run.name,
        "records": records,
        "best_val": min(finite, default=None),
        "iters": max((r["iter"] for r in records), default=0),
        "wall_s": max((r["elapsed_s"] for r in records if "elapsed_s" in r), default=None),
        "tokens_per_sec": statistics.median_high(speeds) if speeds else None,
        "tokens_per_iter": batch * accum * block,
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
        rows.append([str(s["run"]), keys[0], f"{s['best_val']:.4f}" if s["best_val"] is not None else "-",
                     str(s["iters"]), f"{s['tokens_per_sec']:,.0f}" if s["tokens_per_sec"] else "-",
                     f"{s['wall_s']:.1f} s" if s["wall_s"] is not None else "-"])
        rows += [["", more, "", "", "", ""] for more in keys[1:]]
    print_rows(rows)


def print_rows(rows: list[list[str]]) -> None:
    """Columns left-aligned to their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def replicate_groups(runs: list[Path], configs: list[dict[str, Any]], records: list[list[dict[str, Any]]],
                     args: argparse.Namespace) -> list[Group] | None:
    """The replicate groups, baseline first; None when no run has a replicate and no statistics were asked for. A run
    without config.yaml is in none: what it trained is unknown, so it can't be called a replicate of anything."""
    asked = bool(args.baseline or args.json or args.metric != "val_loss")
    bare = [run for run in runs if not (run / "config.yaml").is_file()]
    kept = [i for i, run in enumerate(runs) if run not in bare]
    runs, configs, records = [runs[i] for i in kept], [configs[i] for i in kept], [records[i] for i in kept]
    values = [run_value(r, args.metric) for r in records]
    groups = group_runs(runs, configs, values)  # type: ignore[arg-type]  # checked next, if they matter
    if not asked and all(g.n == 1 for g in groups):
        return None
    if bare:
        print(f"warning: {len(bare)} run(s) without config.yaml ({bare[0]}): left out of the groups", file=sys.stderr)
    if not groups:
        fail(f"none of the {len(bare)} runs has a config.yaml, so none can be grouped; pass runs that train.py wrote")
    problem = _unusable(runs, values, args.metric)
    if problem:
        if asked:
            fail(problem)
        print(f"warning: {problem}; no statistics", file=sys.stderr)
        return None
    try:
        baseline = find_baseline(groups, args.baseline) if args.baseline else groups[0]
    except ValueError as err:
        fail(str(err))
    for g in groups:
        if g.n == 1:
            print(f"warning: {g.label} has one run: no interval and no test; repeat it over seeds", file=sys.stderr)
    if baseline.n == 1 and len(groups) > 1:
        print(f"warning: the baseline {baseline.label} has one run, so no group is compared with it", file=sys.stderr)
    return [baseline, *(g for g in groups if g is not baseline)]


def _unusable(runs: list[Path], values: list[float | None], metric: str) -> str | None:
    """Why the runs' values can't be compared, if they can't: some recorded none, or ended diverged."""
    missing = [run for run, value in zip(runs, values, strict=True) if value is None]
    if missing:
        more = ", ..." if len(missing) > 1 else ""
        return (f"--metric {metric}: {len(missing)} of {len(runs)} runs recorded none ({missing[0]}{more}); pass runs "
                "that all recorded it, or another --metric")
    diverged = [run for run, value in zip(runs, values, strict=True) if not math.isfinite(value)]  # type: ignore[arg-type]
    if diverged:
        return (f"--metric {metric}: {len(diverged)} run(s) ended with NaN or inf ({diverged[0]}: diverged); leave "
                "them out, or compare --metric best_val_loss")
    return None


def print_statistics(groups: list[Group], comparisons: list[Comparison], metric: str) -> None:
    """The groups' table (baseline first), then one verdict per comparison with the baseline."""
    rows = [["group", "n", f"{metric} mean", "std", "95% CI of the mean"]]
    for i, g in enumerate(groups):
        rows.append([g.label + (" (baseline)" if i == 0 and len(groups) > 1 else ""), str(g.n), _value(g.mean),
                     "-" if g.std is None else _value(g.std),
                     "- (one run)" if g.ci95 is None else f"[{_value(g.ci95[0])}, {_value(g.ci95[1])}]"])
    print()
    print_rows(rows)
    if comparisons:
        print()
    for c in comparisons:
        print(c.verdict)


def write_json(path: Path, metric: str, groups: list[Group], comparisons: list[Comparison]) -> None:
    document = {"metric": metric, "groups": [g.to_dict() for g in groups],
                "comparisons": [c.to_dict() for c in comparisons]}
    try:
        write_text_atomically(path, json.dumps(document, indent=1) + "\n")
    except DiskFull as err:
        fail(str(err))
    except OSError as err:
        fail(f"--json {path}: can't write it ({err.strerror or err})")


def _value(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4f}"


def plot(summaries: list[dict[str, Any]], x_axis: str, out: Path, groups: list[Group] | None, metric: str) -> None:
    """The picture, written beside `out` and renamed over it: a link at `out` is replaced, not written through."""
    fig = figure(summaries, x_axis, groups, metric)
    # a PNG carries its title and legend as text, for whoever reads the file without looking (and the tests)
    texts = [t.get_text() for legend in fig.legends for t in [legend.get_title(), *legend.get_texts()]]
    described = "\n".join(text for text in texts if text)
    metadata = {"Title": fig.axes[0].get_title(), "Description": described} if out.suffix.lower() == ".png" else None
    write_atomically(out, lambda f: fig.savefig(f, format=out.suffix[1:].lower(), dpi=110, metadata=metadata))


def figure(summaries: list[dict[str, Any]], x_axis: str, groups: list[Group] | None, metric: str) -> Any:
    """Every run's curves; for groups of replicates, each group's mean val curve with its runs' min-max band. A
    Figure outside pyplot: nothing to close, however main() ends."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    def x_of(record: dict[str, Any], s: dict[str, Any]) -> float:
        if x_axis == "time":
            return record["elapsed_s"]
        if x_axis == "tokens":
            return record["iter"] * s["tokens_per_iter"]
        return record["iter"]

    lines = len(groups) if groups else len(summaries)
    fig = Figure(figsize=(9, 5 + 0.4 * lines), layout="constrained")
    ax = fig.subplots()
    legend_title = None
    if groups:
        _draw_groups(ax, groups, {s["run"]: s for s in summaries}, x_of, metric)
        title = f"{len(groups)} group{'s' if len(groups) > 1 else ''}, {sum(g.n for g in groups)} runs in all"
        legend_title = f"each group: n runs, {metric}: mean ± 95% CI half-width"  # as the table's 95% CI of the mean
        ax.set_ylabel("loss: each group's mean\n(faint: train, dots: val; bands: its runs' min-max)")
    else:
        _draw_runs(ax, summaries, x_of)
        title = f"{len(summaries)} run{'s' if len(summaries) > 1 else ''}"
        ax.set_ylabel("loss (faint: train, dots: val, star: best val)")
    if ax.has_data():
        ax.set_yscale("log")  # loss curves flatten out; a log scale keeps the late differences visible
        low, high = ax.get_ylim()
        digits = 1 if high > 1.5 * low else 2 if high > 1.05 * low else 3  # ticks that read apart
        ax.yaxis.set_major_formatter(FormatStrFormatter(f"%.{digits}f"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter(f"%.{digits}f"))
    ax.set_xlabel({"iter": "iteration", "time": "wall time (s)", "tokens": "training tokens"}[x_axis])
    ax.set_title(f"{title}: loss against {x_axis}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none when no group could be drawn
        fig.legend(loc="outside lower center", fontsize=7, title=legend_title, title_fontsize=7)
    return fig


def _draw_runs(ax: Any, summaries: list[dict[str, Any]], x_of: Any) -> None:
    for i, s in enumerate(summaries):
        color = f"C{i % 10}"
        train = [r for r in s["records"] if "lr" in r]
        evals = [r for r in s["records"] if "val_loss" in r]
        ax.plot([x_of(r, s) for r in train], [r["train_loss"] for r in train], color=color, alpha=0.35, lw=1)
        label = f"{s['label']} (best val {s['best_val']:.3f})" if s["best_val"] is not None else s["label"]
        ax.plot([x_of(r, s) for r in evals], [r["val_loss"] for r in evals], color=color, marker="o", ms=3,
                label=textwrap.fill(label, 2 * KEYS_WIDTH))
        if s["best_val"] is not None:
            best = next(r for r in evals if r["val_loss"] == s["best_val"])
            ax.plot([x_of(best, s)], [best["val_loss"]], color=color, marker="*", ms=12, mec="black")


def _draw_groups(ax: Any, groups: list[Group], by_run: dict[Path, dict[str, Any]], x_of: Any, metric: str) -> None:
    """Faint: mean train loss; dots: mean val loss with the runs' min-max as band and bar, at shared iterations."""
    for i, g in enumerate(groups):
        color = f"C{i % 10}"
        runs = [by_run[run] for run in g.runs]
        interval = "" if g.ci95 is None else f" ± {_value((g.ci95[1] - g.ci95[0]) / 2)}"
        baseline = " (baseline)" if i == 0 and len(groups) > 1 else ""
        label = textwrap.fill(f"{g.label}{baseline}: n={g.n}, {metric} {_value(g.mean)}{interval}", 2 * KEYS_WIDTH)
        if not _across_runs(runs, "val_loss", "val_loss", x_of)[0]:
            print(f"warning: the runs of {g.label} share no evaluation's iteration: not drawn", file=sys.stderr)
            continue
        for key, kind in (("lr", "train_loss"), ("val_loss", "val_loss")):
            xs, ys = _across_runs(runs, key, kind, x_of)
            low, high = [min(y) for y in ys], [max(y) for y in ys]
            mean = [min(max(statistics.fmean(y), lo), hi) for y, lo, hi in zip(ys, low, high, strict=True)]
            if kind == "train_loss":
                ax.plot(xs, mean, color=color, alpha=0.35, lw=1)
                ax.fill_between(xs, low, high, color=color, alpha=0.1, lw=0)
                continue
            bars = [[m - lo for m, lo in zip(mean, low, strict=True)], [h - m for m, h in zip(mean, high, strict=True)]]
            ax.errorbar(xs, mean, yerr=bars, color=color, marker="o", ms=3, capsize=3, label=label)
            ax.fill_between(xs, low, high, color=color, alpha=0.2, lw=0)


def _across_runs(runs: list[dict[str, Any]], key: str, value: str, x_of: Any) -> tuple[list[float], list[list[float]]]:
    """The records holding `key` at the iterations all runs share: the mean x and each run's value."""
    by_iter = [{r["iter"]: r for r in s["records"] if key in r and math.isfinite(r[value])} for s in runs]
    iters = sorted(set.intersection(*(set(b) for b in by_iter)))
    xs = [statistics.fmean(x_of(b[it], s) for b, s in zip(by_iter, runs, strict=True)) for it in iters]
    return xs, [[b[it][value] for b in by_iter] for it in iters]


def main(argv: list[str] | None = None) -> None:
    """The command: argv as the command line holds it (default: sys.argv's), so tests can call it in-process."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories, or directories holding runs")
    parser.add_argument("-o", "--out", type=Path, help="the picture (default: loss.png in the folder given, or the "
                        "deepest folder holding all those given)")
    parser.add_argument("--x", choices=["iter", "time", "tokens"], default="iter", help="the x axis")
    parser.add_argument("--metric", default="val_loss",
                        help="what the groups compare: val_loss (the last evaluation's), best_val_loss, "
                        "time_to_target_s, tokens_per_sec (the median log line's), or any other key of metrics.jsonl "
                        "(its last value)")
    parser.add_argument("--baseline", nargs="+", action="extend", metavar="KEY=VALUE",
                        help="the group the others are compared with (default: the first group)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the groups and comparisons as JSON")
    args = parser.parse_args(argv)
    if args.baseline:  # `--baseline K=V RUN_DIR`: a run directory after the pairs is a run directory
        args.runs += [Path(item) for item in args.baseline if "=" not in item]
        args.baseline = [item for item in args.baseline if "=" in item] or None
    if not args.runs:
        fail("no run directory given; pass train.py run directories or a sweep directory")
    found = find_runs(args.runs)
    out = picture_path(args.out or sweep_folder(args.runs) / "loss.png")
    if args.json is not None:
        if args.json.is_dir() or not args.json.parent.is_dir():
            fail(f"--json {args.json}: name a file in an existing directory")
        replaceable(args.json, "--json")
    loaded = load_runs(found, ("elapsed_s",) if args.x == "time" else ())
    runs, configs, records = ([item[i] for item in loaded] for i in range(3))
    keys = differing_keys(configs)
    summaries = [summarize(run, c, r, keys) for run, c, r in zip(runs, configs, records, strict=True)]
    distinct_labels(summaries)
    print_table(summaries)
    groups = replicate_groups(runs, configs, records, args)
    if groups is not None:
        baseline, *others = groups
        comparisons = [compare(g, baseline, args.metric) for g in others if g.n > 1 and baseline.n > 1]
        print_statistics(groups, comparisons, args.metric)
        if args.json is not None:
            write_json(args.json, args.metric, groups, comparisons)
            print(f"wrote {args.json}", file=sys.stderr)
    try:
        plot(summaries, args.x, out, groups if groups and any(g.n > 1 for g in groups) else None, args.metric)
    except DiskFull as err:
        fail(str(err))
    except OSError as err:  # a read-only directory
        fail(f"-o {out}: can't write it ({err.strerror or err})")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
