"""Compare runs: their loss curves in one picture, a table on stdout and, for runs repeated over seeds, whether each
difference is bigger than seed noise.

    python plot.py RUN_DIR [RUN_DIR ...] -o loss.png            # runs, or sweep directories holding runs
    python plot.py multirun/2026-11-29/10-00-00 --x time        # x axis: iter (default), time or tokens
    python plot.py multirun/DATE/TIME --baseline model.qk_norm=true --json ab.json   # groups of seeds, A/B tests
    python plot.py RUN_DIR --heads                              # each head's scores (train.head_scores=true)

The legend names each run by the config keys that differ between the runs. Runs that differ only in NEUTRAL_KEYS (the
seed, ...) form a group: its mean curve with each evaluation's 95 % interval as bars and the runs' min-max as a band,
its metric's mean, std and Student-t 95 % interval, and Welch's t-test against the baseline; if no difference is
found, the seeds per arm that would find it. The val loss is compared at the last iteration every run evaluated, so an
arm that stopped at its target is compared with the others where they were at that point, not where they ended.
Without -o the picture goes into the deepest folder holding all those given. A run that can't be read is skipped with
one warning; a run without config.yaml is in no group.

--heads draws instead the head scores a run logged at each evaluation (train.head_scores=true): a panel per score, a
line per head labelled LAYER.HEAD, the losses on a second axis, and a mark where a head first reaches its FORMATION
threshold (previous_token >= 0.5, induction >= 0.3), printed too. Given several runs of one config (seeds), it ranks
each run's heads within their layer by their last score (a layer's heads are interchangeable, so head 2 of one seed's
run is no relation of head 2 of another's), draws each rank's mean score, and gives its formation iteration as the
mean ± its 95 % interval over the runs it formed in.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import stat
import statistics
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import yaml
from omegaconf._utils import get_yaml_loader  # the loader OmegaConf.load uses: 1e-3 is a number, as in a run
from scipy import stats

from common.config import fail, shown
from common.errors import DiskFull
from common.files import CONFIG_NAME, METRICS_NAME, read_records, write_atomically

IGNORED_KEYS = ("out_dir", "resume", "resume_with_changes")  # differ between runs without saying anything about them
KEYS_WIDTH = 60  # the table's "differing keys" column wraps at this width, the legend at twice it
# Keys that never change what is trained or measured: runs that differ only in these are replicates.
NEUTRAL_KEYS = ("seed", "out_dir", "resume", "resume_with_changes", "data.dir", "train.log_interval", "train.keep_best")
NEUTRAL_PREFIXES = ("wandb.",)
HIGHER_IS_BETTER = ("tokens_per_sec", "mfu", "hellaswag_acc")  # every other metric (losses, times): lower is better
ALPHA = 0.05  # a difference with p below this is called real
POWER = 0.8  # the chance of detecting an effect that the seeds-per-arm estimate asks for
MAX_SEEDS = 10_000
ABSENT = "<absent>"  # the value of a key some runs' configs lack
FORMATION = {"previous_token": 0.5, "induction": 0.3}  # --heads: a head has formed at its first evaluation over these
LOSS_STYLES = {"train_loss": {"color": "0.55", "lw": 0.8}, "val_loss": {"color": "black", "ls": ":"}}  # --heads


# --- the statistics: replicates grouped, their intervals, Welch's test against the baseline ---
@dataclass
class Group:
    config: dict[str, Any]  # the keys that differ between the groups, with this group's values
    runs: list[Path]
    values: list[float]  # the metric, one per run
    trained: dict[str, Any] = field(default_factory=dict, repr=False)  # the runs' whole training_config

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float | None:  # the sample standard deviation; None for one run, which has no spread
        return statistics.stdev(self.values) if self.n > 1 else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        half = half_width(self.values)
        return None if half is None else (self.mean - half, self.mean + half)

    @property
    def label(self) -> str:
        return " ".join(f"{key}={shown(value)}" for key, value in self.config.items()) or "all runs"

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "n": self.n, "runs": [str(run) for run in self.runs], "values": self.values,
                "mean": self.mean, "std": self.std, "ci95": None if self.ci95 is None else list(self.ci95)}


@dataclass
class Comparison:
    group: Group
    baseline: Group
    metric: str
    diff: float  # group's mean less the baseline's
    ci95: tuple[float, float]
    p_value: float  # Welch's two-sided t-test
    seeds_needed: int | None = None  # per arm, to detect |diff| at this spread (None: detected)

    @property
    def verdict(self) -> str:
        g, b = self.group.n, self.baseline.n
        at = f"{g}" if g == b else f"{g} and {b}"
        p = "p < 0.0001" if self.p_value < 1e-4 else f"p = {self.p_value:.2g}"
        diff, low, high = (_number(x, "+") for x in (self.diff, *self.ci95))
        head = (f"{self.group.label} vs {self.baseline.label}: {diff} {self.metric} [{low}, {high}], {p}, "
                f"{at} seeds{' each' * (g == b)}")
        if self.group.std == 0 and self.baseline.std == 0:  # every run of each group alike: no noise to test against
            return f"{head}: {'no difference at all' if self.diff == 0 else 'the runs of each group are identical'}"
        if self.p_value < ALPHA:
            better = (self.diff > 0) == self.metric.startswith(HIGHER_IS_BETTER)
            (low, high), (base_low, base_high) = self.group.ci95, self.baseline.ci95  # type: ignore[misc]
            # the test judges the difference, so it can be real while the groups' intervals overlap
            overlap = "" if low > base_high or high < base_low else (
                "; the groups' intervals overlap, but the verdict is the difference's interval, which excludes 0")
            return f"{head}: {'better' if better else 'worse'}{overlap}"
        if self.diff == 0:
            return f"{head}: no difference at all"
        effect = f"an effect of {_number(abs(self.diff))}"
        if self.seeds_needed is not None and self.seeds_needed <= min(g, b):
            return f"{head}: no difference detected, though {effect} is found 4 times in 5 at these seeds; run more"
        need = f"about {self.seeds_needed:,}" if self.seeds_needed else f"more than {MAX_SEEDS:,}"
        return f"{head}: no difference detected at {at} seeds; {effect} would need {need} seeds per arm at this spread"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group.config, "baseline": self.baseline.config, "diff": self.diff,
                "ci95": list(self.ci95), "p_value": self.p_value, "seeds_needed": self.seeds_needed,
                "verdict": self.verdict}


def half_width(values: list[float]) -> float | None:
    """The Student-t 95 % interval's half-width around the mean of `values`; None for one value, which has no spread."""
    if len(values) < 2:
        return None
    return float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def training_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run's flat config less the keys that don't change what it trains."""
    return {k: v for k, v in config.items() if k not in NEUTRAL_KEYS and not k.startswith(NEUTRAL_PREFIXES)}


def group_runs(runs: list[Path], configs: list[dict[str, Any]], values: list[float]) -> list[Group]:
    """Replicates together, in the order their first runs come, each named by the keys that differ between groups."""
    by_config: dict[str, Group] = {}
    for run, config, value in zip(runs, configs, values, strict=True):
        trained = training_config(config)
        group = by_config.setdefault(_key(trained), Group({}, [], [], trained))
        group.runs.append(run)
        group.values.append(value)
    groups = list(by_config.values())
    keys = sorted({k for g in groups for k in g.trained})
    keys = [k for k in keys if len({_key(g.trained.get(k, ABSENT)) for g in groups}) > 1]
    for g in groups:
        g.config = {k: g.trained.get(k, ABSENT) for k in keys}
    return groups


def compare(group: Group, baseline: Group, metric: str) -> Comparison:
    """Welch's t-test and the Welch-Satterthwaite interval of the difference; both groups need two runs."""
    diff = group.mean - baseline.mean
    va, vb = group.std**2 / group.n, baseline.std**2 / baseline.n  # type: ignore[operator]
    if va + vb == 0:  # no spread at all: equal means are the same, others differ for certain
        return Comparison(group, baseline, metric, diff, (diff, diff), 1.0 if diff == 0 else 0.0)
    df = (va + vb) ** 2 / (va**2 / (group.n - 1) + vb**2 / (baseline.n - 1))
    half = float(stats.t.ppf(0.975, df)) * math.sqrt(va + vb)
    p_value = float(stats.ttest_ind(group.values, baseline.values, equal_var=False).pvalue)
    comparison = Comparison(group, baseline, metric, diff, (diff - half, diff + half), p_value)
    if p_value >= ALPHA and diff != 0:
        comparison.seeds_needed = seeds_per_arm(diff, group.std, baseline.std)  # type: ignore[arg-type]
    return comparison


def seeds_per_arm(diff: float, sd_a: float, sd_b: float, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """The fewest runs per arm (both alike) for which Welch's two-sided test at `alpha` detects a true `diff` between
    arms of these standard deviations with probability `power` (noncentral t, Welch's df); None past MAX_SEEDS."""
    va, vb = sd_a**2, sd_b**2

    def reached(n: int) -> bool:
        df = (va + vb) ** 2 * (n - 1) / (va**2 + vb**2)
        shift = abs(diff) / math.sqrt((va + vb) / n)
        critical = stats.t.ppf(1 - alpha / 2, df)
        return stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift) >= power

    high = 2
    while not reached(high):  # doubling first: the noncentral t gives NaN far past the answer for large effects
        if high >= MAX_SEEDS:
            return None
        high = min(2 * high, MAX_SEEDS)
    low = max(2, high // 2)
    return low + bisect.bisect_left(range(low, high), True, key=reached)  # the first n that reaches the power


def find_baseline(groups: list[Group], wanted: list[str]) -> Group:
    """The one group whose config holds every KEY=VALUE of `wanted`, a value read as Hydra reads one (1e-3 matches
    0.001); else a ValueError."""
    pairs = []
    for item in wanted:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--baseline {item}: write it as KEY=VALUE, e.g. --baseline model.qk_norm=true")
        if key not in training_config({key: None}):
            raise ValueError(f"--baseline {item}: runs that differ only in {key} are replicates of one group")
        if not any(key in group.trained for group in groups):
            raise ValueError(f"--baseline {item}: no run has the key {key}")
        try:
            pairs.append((key, yaml.load(text, Loader=get_yaml_loader())))
        except yaml.YAMLError:
            pairs.append((key, text))
    matches = [g for g in groups if all(key in g.trained and _equal(g.trained[key], v) for key, v in pairs)]
    if len(matches) != 1:
        asked, among = " ".join(wanted), "; ".join(g.label for g in matches or groups)
        raise ValueError(f"--baseline {asked} matches no group; the groups: {among}" if not matches else
                         f"--baseline {asked} matches {len(matches)} groups ({among}); add KEY=VALUE to pick one")
    return matches[0]


def _equal(held: Any, wanted: Any) -> bool:
    if _is_number(held) and _is_number(wanted):
        return math.isclose(held, wanted, rel_tol=1e-9)
    if isinstance(held, str) or isinstance(wanted, str):  # a text key's value that reads as a number: data.name=2024
        return str(held) == str(wanted)
    return _key(held) == _key(wanted)


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _number(x: float, sign: str = "") -> str:
    return f"{x:{sign},.0f}" if abs(x) >= 100 else f"{x:{sign}.3g}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def run_value(records: list[dict[str, Any]], metric: str) -> float | None:
    """A run's metric: best_val_loss the lowest finite val_loss, tokens_per_sec the median, else the last (or None)."""
    key = "val_loss" if metric == "best_val_loss" else metric
    values = [r[key] for r in records if _is_number(r.get(key))]
    finite = [v for v in values if math.isfinite(v)]
    if metric == "best_val_loss":
        return min(finite, default=None)
    if metric == "tokens_per_sec":
        return statistics.median(finite) if finite else None
    return values[-1] if values else None


# --- reading a run as train.py wrote it, or refusing it as damaged ---
MAX_BYTES = {METRICS_NAME: 1 << 30, CONFIG_NAME: 1 << 20}  # far past a run's files (~200 B a log line), short of RAM
TOKEN_KEYS = ("train.batch_size", "train.grad_accum", "model.block_size")  # --x tokens multiplies these
FILE_KINDS = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device",
              stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


class Damaged(Exception):
    """A run plot.py can't read; the message names the file and the problem."""


Loaded = tuple[Path, dict[str, Any], list[dict[str, Any]], int]  # a run, its config, records and damaged lines


def load_run(run: Path, needed: tuple[str, ...] = ()) -> Loaded:
    """The run's flat config (key.sub: value, with the settings resolved at start), records and cut-short line count;
    Damaged if a file is unlike what train.py writes. needed: keys every log and eval line must hold."""
    path = run / METRICS_NAME
    regular_file(path)
    records, damaged = read_records(run)
    for r in records:
        wanted = (("train_loss",) if "lr" in r else ()) + (needed if "lr" in r or "val_loss" in r else ())
        missing = [key for key in wanted if key not in r]
        if missing:
            raise Damaged(f"{path}: the line of iter {r['iter']} has no {missing[0]}")
        for key, value in r.items():
            if key not in ("settings", "heads") and not _is_number(value):
                raise Damaged(f"{path}: the line of iter {r['iter']} has {key}={value!r}, not a number")

    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    settings = [r["settings"] for r in records if isinstance(r.get("settings"), dict)]
    config = {**walk(read_config(run / CONFIG_NAME), ""), **(settings[-1] if settings else {})}
    for key in TOKEN_KEYS:
        if key in config and (not isinstance(config[key], int) or isinstance(config[key], bool)):
            raise Damaged(f"{run / CONFIG_NAME}: {key}={config[key]!r}, not a whole number")
    return run, config, records, damaged


def read_config(path: Path) -> dict[str, Any]:
    """config.yaml's mapping; {} when the run has none."""
    if not os.path.lexists(path):
        return {}
    regular_file(path)
    try:
        text = path.read_bytes().decode("utf-8")
        config = yaml.load(text, Loader=_NoAliasLoader)
    except UnicodeDecodeError as err:
        raise Damaged(f"{path}: not UTF-8 text (byte {err.start} is {err.object[err.start]:#x})") from None
    except yaml.YAMLError as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None) or "unreadable"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise Damaged(f"{path}: not YAML ({where}{problem})") from None
    except RecursionError:
        raise Damaged(f"{path}: nested too deep for a config") from None
    if not isinstance(config, dict):
        raise Damaged(f"{path}: not a mapping of keys (a {type(config).__name__})")
    return config


class _NoAliasLoader(get_yaml_loader()):  # type: ignore[misc]
    """Refuses aliases, which train.py never writes: nested ones repeat a node exponentially ("billion laughs")."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"an alias, *{event.anchor}, which train.py never writes",
                                              event.start_mark)
        return super().compose_node(parent, index)


def regular_file(path: Path) -> None:
    """Damaged unless `path` (or a link's target) is a regular file within MAX_BYTES: a FIFO or /dev/zero never ends."""
    info = os.stat(path)  # follows links, as the read would
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in FILE_KINDS.items() if test(info.st_mode)), "a special file")
        raise Damaged(f"{path}: {kind}{' behind a link' if path.is_symlink() else ''}, not a regular file")
    if info.st_size > MAX_BYTES[path.name]:
        raise Damaged(f"{path}: {info.st_size:,} bytes, more than a run's {path.name} holds "
                      f"({MAX_BYTES[path.name]:,} at most)")


# --- the command: the table, the statistics and the picture ---
def check_output(path: Path, option: str) -> None:
    """Before any work: a file in an existing directory, and not a FIFO or a device, which is someone's channel.
    Outputs are written beside the path and renamed over it, so a link there is replaced, not written through."""
    if path.is_dir():
        example = path / ("loss.png" if option == "-o" else "ab.json")
        fail(f"{option} {path} is a directory; name a file such as {example}")
    if not path.parent.is_dir():
        fail(f"{option} {path}: no directory {path.parent}; create it first")
    with contextlib.suppress(OSError):  # none yet, or a dangling link: the rename makes it
        if not stat.S_ISREG(os.stat(path).st_mode):
            fail(f"{option} {path}: not a regular file (a FIFO, a device); name a file")


def picture_path(out: Path) -> Path:
    """-o's path, .png added when it has no extension, in a format matplotlib writes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    special = out.exists() and not out.is_file()  # a directory, /dev/null: refused as named, not written beside
    out = out if out.suffix or special else out.with_suffix(".png")
    check_output(out, "-o")
    formats = Figure().canvas.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        fail(f"-o {out}: can't write {out.suffix} pictures; use one of {', '.join('.' + f for f in sorted(formats))}")
    return out


def load_runs(paths: list[Path], needed: tuple[str, ...]) -> list[Loaded]:
    """The runs in or under `paths`: one warning for each that can't be read, one line and status 2 if none can."""
    loaded, problems = [], []
    for path in paths:
        runs = [path] if (path / METRICS_NAME).is_file() else sorted(p.parent for p in path.rglob(METRICS_NAME))
        if not runs:
            fail(f"no metrics.jsonl in or under {path}; pass train.py run directories or a sweep directory")
        for run in runs:
            try:
                loaded.append(load_run(run, needed))
            except Damaged as err:
                problems.append(str(err))
            except OSError as err:  # no permission, or gone since the listing
                problems.append(f"{err.filename or run}: can't read it ({err.strerror or err})")
    if not loaded:
        fail(f"{problems[0]}; nothing left to plot" if len(problems) == 1 else
             f"all {len(problems)} runs are damaged, the first: {problems[0]}; fix or leave them out")
    for run, _, _, damaged in loaded:
        if damaged:
            print(f"warning: {run / METRICS_NAME}: left out {damaged} damaged line(s)", file=sys.stderr)
    for problem in problems:
        print(f"warning: {problem}; run skipped", file=sys.stderr)
    return loaded


def summaries_of(loaded: list[Loaded]) -> list[dict[str, Any]]:
    """A row per run, labelled by the keys that differ between the runs that have them, or else by its name or path."""
    configs = [config for _, config, _, _ in loaded]
    keys = sorted({k for c in configs for k in c} - set(IGNORED_KEYS))
    keys = [k for k in keys if len({json.dumps(c[k], default=str) for c in configs if k in c}) > 1]
    summaries = []
    for run, config, records, _ in loaded:
        summaries.append({
            "run": run, "records": records, "label": ", ".join(f"{k}={shown(config[k])}" for k in keys if k in config),
            "best_val": run_value(records, "best_val_loss"), "iters": max((r["iter"] for r in records), default=0),
            "wall_s": max((r["elapsed_s"] for r in records if "elapsed_s" in r), default=None),
            "tokens_per_sec": run_value(records, "tokens_per_sec"),
            "tokens_per_iter": math.prod(config.get(k, 0) for k in TOKEN_KEYS),
        })
    counts = Counter(s["label"] for s in summaries)
    for s in summaries:
        if not s["label"]:
            s["label"] = s["run"].name
        elif counts[s["label"]] > 1:
            s["label"] = f"{s['run'].name}: {s['label']}"
    if len({s["label"] for s in summaries}) < len(summaries):  # the same names too (runs/a/x and runs/b/x)
        for s in summaries:
            s["label"] = f"{s['run']}: {s['label']}"
    return summaries


def print_rows(rows: list[list[str]]) -> None:
    """Columns left-aligned to their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def print_table(summaries: list[dict[str, Any]]) -> None:
    """One row per run; a long "differing keys" cell wraps onto the lines below it."""
    rows = [["run", "differing keys", "best val", "iters", "tokens/s", "wall time"]]
    for s in summaries:
        keys = textwrap.wrap(s["label"], KEYS_WIDTH, break_on_hyphens=False) or [""]
        rows.append([str(s["run"]), keys[0], "-" if s["best_val"] is None else f"{s['best_val']:.4f}",
                     str(s["iters"]), f"{s['tokens_per_sec']:,.0f}" if s["tokens_per_sec"] else "-",
                     "-" if s["wall_s"] is None else f"{s['wall_s']:.1f} s"])
        rows += [["", more, "", "", "", ""] for more in keys[1:]]
    print_rows(rows)


def measured(runs: list[Path], records: list[list[dict[str, Any]]], metric: str) -> tuple[list[Any], int | None, str]:
    """Each run's value of `metric`, the iteration val_loss is read at, and why the runs can't be compared ("" if they
    can). val_loss is read at the last iteration every run evaluated: an arm that stopped at its target is compared
    with the others where they were then, not where they ended."""
    values = [run_value(r, metric) for r in records]
    missing = [run for run, value in zip(runs, values, strict=True) if value is None]
    if missing:
        which = f"{len(missing)} of {len(runs)} runs ({missing[0]}{', ...' if len(missing) > 1 else ''})"
        if metric == "time_to_target_s":
            return values, None, (f"--metric time_to_target_s: {which} never reached a train.target_val_loss; "
                                  "leave out --metric to compare val_loss at the last iteration every run evaluated")
        return values, None, (f"--metric {metric}: {which} recorded none; pass runs that all recorded it, "
                              "or another --metric")
    at = None
    if metric == "val_loss" and runs:
        evaluated = [{r["iter"]: r["val_loss"] for r in rs if "val_loss" in r} for rs in records]
        shared = set.intersection(*(set(e) for e in evaluated))
        if not shared:
            return values, None, ("--metric val_loss: the runs share no evaluated iteration; evaluate them at the "
                                  "same ones (train.eval_interval, train.eval_from), or compare --metric best_val_loss")
        at = max(shared)
        values = [e[at] for e in evaluated]
    diverged = [run for run, value in zip(runs, values, strict=True) if not math.isfinite(value)]
    if diverged:
        return values, at, (f"--metric {metric}: {len(diverged)} run(s) have NaN or inf ({diverged[0]}: diverged); "
                            "leave them out, or compare --metric best_val_loss")
    return values, at, ""


def replicate_groups(loaded: list[Loaded], args: argparse.Namespace) -> tuple[list[Group], str] | None:
    """The replicate groups, baseline first, and what their values are (val_loss at iter N); None when no run has a
    replicate and no statistics were asked for. A run without config.yaml is in none: what it trained is unknown, so
    it is no replicate of anything."""
    asked = bool(args.baseline or args.json or args.metric != "val_loss")
    kept = [(run, config, records) for run, config, records, _ in loaded if (run / CONFIG_NAME).is_file()]
    runs, configs, records = ([item[i] for item in kept] for i in range(3))
    values, at, problem = measured(runs, records, args.metric)
    groups = group_runs(runs, configs, values)
    if not asked and all(g.n == 1 for g in groups):
        return None
    bare = [run for run, _, _, _ in loaded if run not in runs]
    if bare:
        print(f"warning: {len(bare)} run(s) without config.yaml ({bare[0]}): left out of the groups", file=sys.stderr)
    if not groups:
        fail(f"none of the {len(bare)} runs has a config.yaml, so none can be grouped; pass runs that train.py wrote")
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
    ends = [max((r["iter"] for r in rs), default=0) for rs in records]
    if min(ends) < max(ends) and args.metric != "time_to_target_s":  # reaching the target sooner is the point there
        stopped = sum(any("time_to_target_s" in r for r in rs) for rs in records)
        why = f"; {stopped} of {len(runs)} stopped at their train.target_val_loss" if stopped else ""
        footing = (f"val_loss is compared at iter {at}, the last iteration every run evaluated" if at is not None else
                   f"each run's {args.metric} comes from its own length; without --metric, val_loss is compared at "
                   "the last iteration every run evaluated")
        if stopped == len(runs):
            footing += "; all reached their target: --metric time_to_target_s compares how soon"
        print(f"warning: the runs differ in length ({min(ends)} to {max(ends)} iterations{why}): {footing}",
              file=sys.stderr)
    measure = args.metric if at is None else f"{args.metric} at iter {at}"
    return [baseline, *(g for g in groups if g is not baseline)], measure


def print_statistics(groups: list[Group], comparisons: list[Comparison], metric: str) -> None:
    """The groups' table (baseline first), then one verdict per comparison with the baseline."""
    rows = [["group", "n", f"mean {metric}", "std", "95% CI of the mean"]]
    for i, g in enumerate(groups):
        rows.append([g.label + (" (baseline)" if i == 0 and len(groups) > 1 else ""), str(g.n), _value(g.mean),
                     "-" if g.std is None else _value(g.std),
                     "- (one run)" if g.ci95 is None else f"[{_value(g.ci95[0])}, {_value(g.ci95[1])}]"])
    print()
    print_rows(rows)
    if comparisons:
        print("\n" + "\n".join(c.verdict for c in comparisons))


def _value(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4f}"


def save(path: Path, option: str, write: Callable[[BinaryIO], object]) -> None:
    """Written beside `path` and renamed over it; a full disk or a read-only directory is one line."""
    try:
        write_atomically(path, write)
    except DiskFull as err:
        fail(str(err))
    except OSError as err:
        fail(f"{option} {path}: can't write it ({err.strerror or err})")
    print(f"wrote {path}", file=sys.stderr)


def figure(summaries: list[dict[str, Any]], x_axis: str, groups: list[Group] | None, metric: str) -> Any:
    """Every run's curves, or each group's mean curves with 95 % interval bars and its runs' min-max band, on a Figure
    outside pyplot."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    def x_of(record: dict[str, Any], s: dict[str, Any]) -> float:
        if x_axis == "time":
            return record["elapsed_s"]
        return record["iter"] * (s["tokens_per_iter"] if x_axis == "tokens" else 1)

    fig = Figure(figsize=(9, 5 + 0.4 * len(groups or summaries)), layout="constrained")
    ax = fig.subplots()
    legend_title = None
    if groups:
        _draw_groups(ax, groups, {s["run"]: s for s in summaries}, x_of)
        title = f"{len(groups)} group{'s' * (len(groups) > 1)}, {sum(g.n for g in groups)} runs in all"
        legend_title = (f"each group: n runs, {metric}: mean ± 95% CI half-width\n"  # as the table's 95% CI of the mean
                        "bars: each evaluation's 95% CI of the mean; bands: the runs' min-max")
        ax.set_ylabel("loss: each group's mean\n(faint: train, dots: val)")
    else:
        for i, s in enumerate(summaries):
            train = [r for r in s["records"] if "lr" in r]
            evals = [r for r in s["records"] if "val_loss" in r]
            ax.plot([x_of(r, s) for r in train], [r["train_loss"] for r in train], color=f"C{i % 10}", alpha=0.35, lw=1)
            label = s["label"] if s["best_val"] is None else f"{s['label']} (best val {s['best_val']:.3f})"
            ax.plot([x_of(r, s) for r in evals], [r["val_loss"] for r in evals], color=f"C{i % 10}", marker="o", ms=3,
                    label=textwrap.fill(label, 2 * KEYS_WIDTH))
            if s["best_val"] is not None:
                best = next(r for r in evals if r["val_loss"] == s["best_val"])
                ax.plot([x_of(best, s)], [best["val_loss"]], color=f"C{i % 10}", marker="*", ms=12, mec="black")
        title = f"{len(summaries)} run{'s' * (len(summaries) > 1)}"
        ax.set_ylabel("loss (faint: train, dots: val, star: best val)")
    if ax.has_data():
        ax.set_yscale("log")  # loss curves flatten out; a log scale keeps the late differences visible
        low, high = ax.get_ylim()
        ticks = FormatStrFormatter(f"%.{1 if high > 1.5 * low else 2 if high > 1.05 * low else 3}f")  # read apart
        ax.yaxis.set_major_formatter(ticks)
        ax.yaxis.set_minor_formatter(ticks)
    ax.set_xlabel({"iter": "iteration", "time": "wall time (s)", "tokens": "training tokens"}[x_axis])
    ax.set_title(f"{title}: loss against {x_axis}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none when no group could be drawn
        fig.legend(loc="outside lower center", fontsize=7, title=legend_title, title_fontsize=7)
    return fig


def _draw_groups(ax: Any, groups: list[Group], by_run: dict[Path, dict[str, Any]], x_of: Callable) -> None:
    """Faint: mean train loss; dots: mean val loss with its 95 % interval as bars; bands: the runs' min-max; at the
    iterations the group's runs share. The bar at the compared iteration is the legend's interval."""
    for i, g in enumerate(groups):
        runs, curves = [by_run[run] for run in g.runs], {}
        for key, kind in (("lr", "train_loss"), ("val_loss", "val_loss")):  # at the iterations all runs share
            by_iter = [{r["iter"]: r for r in s["records"] if key in r and math.isfinite(r[kind])} for s in runs]
            iters = sorted(set.intersection(*(set(b) for b in by_iter)))
            xs = [statistics.fmean(x_of(b[it], s) for b, s in zip(by_iter, runs, strict=True)) for it in iters]
            curves[kind] = xs, [[b[it][kind] for b in by_iter] for it in iters]
        if not curves["val_loss"][0]:
            print(f"warning: the runs of {g.label} share no evaluation's iteration: not drawn", file=sys.stderr)
            continue
        half = half_width(g.values)
        interval = "" if half is None else f" ± {_value(half)}"
        baseline = " (baseline)" if i == 0 and len(groups) > 1 else ""
        label = textwrap.fill(f"{g.label}{baseline}: n={g.n}, {_value(g.mean)}{interval}", 2 * KEYS_WIDTH)
        for kind, (xs, ys) in curves.items():
            low, high = np.array([min(y) for y in ys]), np.array([max(y) for y in ys])
            mean = np.clip([statistics.fmean(y) for y in ys], low, high)  # rounding can leave the band
            if kind == "train_loss":
                ax.plot(xs, mean, color=f"C{i % 10}", alpha=0.35, lw=1)
            else:
                half = [half_width(y) or 0.0 for y in ys]
                ax.errorbar(xs, mean, yerr=half, color=f"C{i % 10}", marker="o", ms=3, capsize=3, label=label)
            ax.fill_between(xs, low, high, color=f"C{i % 10}", alpha=0.1 if kind == "train_loss" else 0.2, lw=0)


def compare_losses(loaded: list[Loaded], args: argparse.Namespace) -> Any:
    """The runs' table and, for replicates, the groups' statistics (and --json) on stdout; the loss picture."""
    summaries = summaries_of(loaded)
    print_table(summaries)
    groups, measure = replicate_groups(loaded, args) or (None, args.metric)
    if groups is not None:
        baseline, *others = groups
        comparisons = [compare(g, baseline, measure) for g in others if g.n > 1 and baseline.n > 1]
        print_statistics(groups, comparisons, measure)
        if args.json is not None:
            document = {"metric": args.metric, "measure": measure, "groups": [g.to_dict() for g in groups],
                        "comparisons": [c.to_dict() for c in comparisons]}
            save(args.json, "--json", lambda f: f.write(json.dumps(document, indent=1).encode() + b"\n"))
    return figure(summaries, args.x, groups if groups and any(g.n > 1 for g in groups) else None, measure)


# --- head scores over training: --heads ---
def heads_figure(loaded: list[Loaded]) -> Any:
    """A panel per score: each head's score at the evaluations the runs share (several runs: each rank's mean), the
    mean losses on a second axis, and each head's formation (FORMATION) as the mean iteration ± its 95 % interval,
    also printed."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    runs, configs, records = ([item[i] for item in loaded] for i in range(3))
    groups = group_runs(runs, configs, [0.0] * len(runs))
    if len(groups) > 1:
        fail(f"--heads averages runs of one config over seeds; these differ in {', '.join(groups[0].config)}")
    logged = [{r["iter"]: r["heads"] for r in rs if isinstance(r.get("heads"), dict)} for rs in records]
    bare = [run for run, heads in zip(runs, logged, strict=True) if not heads]
    if bare:
        fail(f"{bare[0] / METRICS_NAME} has no head scores; train the run with train.head_scores=true")
    shapes = {np.shape(next(iter(heads.values()))["previous_token"]) for heads in logged}
    if len(shapes) > 1:
        fail(f"--heads averages runs of one model's shape; these have layers x heads {' and '.join(map(str, shapes))}")
    iters = sorted(set.intersection(*(set(heads) for heads in logged)))
    names = list(logged[0][iters[0]]) if iters else []
    if not names:
        fail("the runs share no evaluation with head scores; pass runs evaluated at the same iterations")
    # (runs, evaluations, n_layer, n_head) per score; a null (undefined) score is NaN
    scores = {name: np.array([[heads[it][name] for it in iters] for heads in logged], dtype=float) for name in names}
    n_layer, n_head = scores[names[0]].shape[2:]
    labels = [[f"{layer}.{head}" for head in range(n_head)] for layer in range(n_layer)]
    if len(runs) > 1:  # a layer's heads are interchangeable, so a head index names no head across seeds: each run's
        # heads are ranked within their layer by their last score, and ranks averaged (1.#1: layer 1's top head)
        for name, s in scores.items():
            order = np.argsort(-np.nan_to_num(s[:, -1], nan=-np.inf), axis=-1, kind="stable")  # (runs, L, H)
            scores[name] = np.take_along_axis(s, order[:, None], axis=-1)
        labels = [[f"{layer}.#{rank + 1}" for rank in range(n_head)] for layer in range(n_layer)]
    palette = colormaps["tab20" if n_layer * n_head > 10 else "tab10"]
    colour = lambda i: palette(i % palette.N)  # noqa: E731 (past 20 heads, colours repeat)
    losses = {}  # the runs' mean train and val loss at the iterations they share, drawn in every panel
    for kind in LOSS_STYLES:
        by_iter = [{r["iter"]: r[kind] for r in rs if kind in r and ("lr" in r) == (kind == "train_loss")}
                   for rs in records]
        xs = sorted(set.intersection(*(set(b) for b in by_iter)))
        losses[kind] = xs, [statistics.fmean(b[x] for b in by_iter) for x in xs]
    fig = Figure(figsize=(10, 1.2 + 2.2 * len(names)), layout="constrained")
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    formed_rows = [["score", "head", "formed in", "at iteration (mean ± 95% CI half-width)"]]
    for ax, name in zip(axes, names, strict=True):
        mean = scores[name].mean(0)
        for layer, head in np.ndindex(n_layer, n_head):
            ax.plot(iters, mean[:, layer, head], color=colour(layer * n_head + head), lw=1.2, label=labels[layer][head],
                    marker="o" if len(iters) == 1 else None)
        ax.set_ylabel(name.replace("_", " "))
        ax.grid(True, alpha=0.3)
        if name in FORMATION:
            formed_rows += _formation(ax, np.array(iters), scores[name], name, colour, labels)
        twin = ax.twinx()
        for kind, (xs, ys) in losses.items():
            twin.plot(xs, ys, label=kind.replace("_", " "), **LOSS_STYLES[kind])
        twin.set_ylabel("loss")
    axes[-1].set_xlabel("iteration")
    many = f"{len(runs)} runs' mean" if len(runs) > 1 else f"{runs[0]}"
    axes[0].set_title(f"head scores over training, {many}; marks: formation (first evaluation over the dashed line)")
    handles = axes[0].get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside right upper", fontsize=7, title="layer.head" if len(runs) == 1 else
               "layer.#rank in the layer\nby the last score", title_fontsize=7)
    print_rows(formed_rows)
    return fig


def _formation(ax: Any, iters: np.ndarray, scores: np.ndarray, name: str, colour: Callable,
               labels: list[list[str]]) -> list[list[str]]:
    """Each head's formation, its first evaluation at or over FORMATION[name] in each run: marked on `ax` at the mean
    over the runs it formed in, ± the 95 % interval; returned as table rows."""
    threshold, n_runs = FORMATION[name], len(scores)
    over = scores >= threshold  # (runs, evaluations, n_layer, n_head)
    at = np.where(over.any(1), iters[over.argmax(1)], np.nan)
    ax.axhline(threshold, color="0.4", ls="--", lw=0.8)
    rows = []
    for layer, head in np.ndindex(at.shape[1:]):
        values = [float(v) for v in at[:, layer, head] if not math.isnan(v)]
        if values:
            half = half_width(values)
            ax.errorbar(statistics.fmean(values), threshold, xerr=half, color=colour(layer * at.shape[2] + head),
                        marker="o", mec="black", ms=6, capsize=3, zorder=3)
            shown_at = f"{statistics.fmean(values):,.0f}" + ("" if half is None else f" ± {half:,.0f}")
            if iters[0] > 0 and over[:, 0, layer, head].any():  # over when scoring began (turned on at a resume)
                shown_at = f"<= {shown_at}"
            rows.append([f"{name} >= {threshold}", labels[layer][head], f"{len(values)}/{n_runs} runs", shown_at])
    return rows or [[f"{name} >= {threshold}", "none", f"0/{n_runs} runs", "-"]]


def main(argv: list[str] | None = None) -> None:
    """The command: argv as the command line holds it (default: sys.argv's), so tests can call it in-process."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories, or directories holding runs")
    parser.add_argument("-o", "--out", type=Path, help="the picture (default: loss.png in the deepest folder holding "
                        "all those given)")
    parser.add_argument("--x", choices=["iter", "time", "tokens"], default="iter", help="the x axis")
    parser.add_argument("--metric", default="val_loss", help="what the groups compare: val_loss (at the last "
                        "iteration every run evaluated), best_val_loss, time_to_target_s, tokens_per_sec (the median "
                        "log line's), or any other key of metrics.jsonl (its last value)")
    parser.add_argument("--baseline", nargs="+", action="extend", metavar="KEY=VALUE",
                        help="the group the others are compared with (default: the first group)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the groups and comparisons as JSON")
    parser.add_argument("--heads", action="store_true", help="draw each head's scores over training instead "
                        "(runs trained with train.head_scores=true; default picture: heads.png)")
    args = parser.parse_args(argv)
    if args.baseline:  # `--baseline K=V RUN_DIR`: a run directory after the pairs is a run directory
        args.runs += [Path(item) for item in args.baseline if "=" not in item]
        args.baseline = [item for item in args.baseline if "=" in item] or None
    if not args.runs:
        fail("no run directory given; pass train.py run directories or a sweep directory")
    if args.heads and (args.baseline or args.json or args.x != "iter" or args.metric != "val_loss"):
        fail("--heads draws head scores against iterations: leave out --x, --metric, --baseline and --json")
    name = "heads.png" if args.heads else "loss.png"
    out = picture_path(args.out or Path(os.path.commonpath([p.absolute() for p in args.runs])) / name)
    if args.json is not None:
        check_output(args.json, "--json")
    loaded = load_runs(args.runs, ("elapsed_s",) if args.x == "time" else ())
    fig = heads_figure(loaded) if args.heads else compare_losses(loaded, args)
    # a PNG carries its title and legend as text, for whoever reads the file without looking (and the tests)
    legend = "\n".join(t.get_text() for lg in fig.legends for t in [lg.get_title(), *lg.get_texts()] if t.get_text())
    metadata = {"Title": fig.axes[0].get_title(), "Description": legend} if out.suffix.lower() == ".png" else None
    save(out, "-o", lambda f: fig.savefig(f, format=out.suffix[1:].lower(), dpi=110, metadata=metadata))


if __name__ == "__main__":
    main()
