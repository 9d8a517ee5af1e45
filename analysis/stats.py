"""For plot.py: is a config difference bigger than seed noise? Runs differing only in NEUTRAL_KEYS form a group (mean,
std, Student-t 95 % interval) compared with a baseline by Welch's t-test; if undetected, the seeds per arm it needs."""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf._utils import get_yaml_loader  # the loader OmegaConf.load uses: 1e-3 is a number, as in a run
from scipy import stats

from training.trainer import METRICS_NAME, read_records

# Keys that never change what is trained or measured: runs that differ only in these are replicates.
NEUTRAL_KEYS = ("seed", "out_dir", "resume", "resume_with_changes", "data.dir", "train.log_interval", "train.keep_best")
NEUTRAL_PREFIXES = ("wandb.",)
HIGHER_IS_BETTER = ("tokens_per_sec", "mfu", "hellaswag_acc")  # every other metric (losses, times): lower is better
ALPHA = 0.05  # a difference with p below this is called real
POWER = 0.8  # the chance of detecting an effect that the seeds-per-arm estimate asks for
MAX_SEEDS = 10_000
ABSENT = "<absent>"  # the value of a key some runs' configs lack


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
    def std(self) -> float | None:
        """The sample standard deviation; None for one run, which has no spread."""
        return statistics.stdev(self.values) if self.n > 1 else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        if self.std is None:
            return None
        half = float(stats.t.ppf(0.975, self.n - 1)) * self.std / math.sqrt(self.n)
        return (self.mean - half, self.mean + half)

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
        seeds = f"{at} seeds each" if g == b else f"{at} seeds"
        head = (f"{self.group.label} vs {self.baseline.label}: {_signed(self.diff)} {self.metric} "
                f"[{_signed(self.ci95[0])}, {_signed(self.ci95[1])}], {_p(self.p_value)}, {seeds}")
        if self.group.std == 0 and self.baseline.std == 0:  # every run of each group alike: no noise to test against
            return f"{head}: {'no difference at all' if self.diff == 0 else 'the runs of each group are identical'}"
        if self.p_value < ALPHA:
            better = (self.diff > 0) == self.metric.startswith(HIGHER_IS_BETTER)
            return f"{head}: {'better' if better else 'worse'}{self._overlap}"
        if self.diff == 0:
            return f"{head}: no difference at all"
        effect = f"an effect of {_number(abs(self.diff))}"
        if self.seeds_needed is not None and self.seeds_needed <= min(g, b):
            return f"{head}: no difference detected, though {effect} is found 4 times in 5 at these seeds; run more"
        need = f"about {self.seeds_needed:,}" if self.seeds_needed else f"more than {MAX_SEEDS:,}"
        return f"{head}: no difference detected at {at} seeds; {effect} would need {need} seeds per arm at this spread"

    @property
    def _overlap(self) -> str:
        """Why a difference can be real while the groups' intervals overlap: the test judges the difference."""
        (low, high), (base_low, base_high) = self.group.ci95, self.baseline.ci95  # type: ignore[misc]
        if low > base_high or high < base_low:
            return ""
        return "; the groups' intervals overlap, but the verdict is the difference's interval, which excludes 0"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group.config, "baseline": self.baseline.config, "diff": self.diff,
                "ci95": list(self.ci95), "p_value": self.p_value, "seeds_needed": self.seeds_needed,
                "verdict": self.verdict}


def training_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run's flat config less the keys that don't change what it trains."""
    return {k: v for k, v in config.items() if k not in NEUTRAL_KEYS and not k.startswith(NEUTRAL_PREFIXES)}


def group_runs(runs: list[Path], configs: list[dict[str, Any]], values: list[float]) -> list[Group]:
    """Replicates together, in the order their first runs come."""
    by_config: dict[str, tuple[dict[str, Any], list[Path], list[float]]] = {}
    for run, config, value in zip(runs, configs, values, strict=True):
        trained = training_config(config)
        entry = by_config.setdefault(json.dumps(trained, sort_keys=True, default=str), (trained, [], []))
        entry[1].append(run)
        entry[2].append(value)
    configs_seen = [trained for trained, _, _ in by_config.values()]
    keys = sorted({k for c in configs_seen for k in c})
    keys = [k for k in keys if len({_key(c.get(k, ABSENT)) for c in configs_seen}) > 1]
    return [Group({k: c.get(k, ABSENT) for k in keys}, runs, vals, c) for c, runs, vals in by_config.values()]


def compare(group: Group, baseline: Group, metric: str) -> Comparison:
    """Welch's t-test and the Welch-Satterthwaite interval of the difference; both groups need two runs."""
    a, b = group.values, baseline.values
    diff = group.mean - baseline.mean
    va, vb = group.std**2 / group.n, baseline.std**2 / baseline.n  # type: ignore[operator]
    if va + vb == 0:  # no spread at all: equal means are the same, others differ for certain
        return Comparison(group, baseline, metric, diff, (diff, diff), 1.0 if diff == 0 else 0.0)
    df = (va + vb) ** 2 / (va**2 / (group.n - 1) + vb**2 / (baseline.n - 1))
    half = float(stats.t.ppf(0.975, df)) * math.sqrt(va + vb)
    p_value = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
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
    while low < high:  # the first n that reaches the power
        mid = (low + high) // 2
        low, high = (low, mid) if reached(mid) else (mid + 1, high)
    return low


def find_baseline(groups: list[Group], wanted: list[str]) -> Group:
    """The one group whose config holds every KEY=VALUE of `wanted` (1e-3 matches 0.001); else a ValueError."""
    pairs = []
    for item in wanted:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--baseline {item}: write it as KEY=VALUE, e.g. --baseline model.qk_norm=true")
        if key not in training_config({key: None}):
            raise ValueError(f"--baseline {item}: runs that differ only in {key} are replicates of one group")
        if not any(key in group.trained for group in groups):
            raise ValueError(f"--baseline {item}: no run has the key {key}")
        pairs.append((key, parse_value(value)))
    matches = [g for g in groups if all(key in g.trained and _equal(g.trained[key], v) for key, v in pairs)]
    asked = " ".join(wanted)
    if not matches:
        raise ValueError(f"--baseline {asked} matches no group; the groups: {'; '.join(g.label for g in groups)}")
    if len(matches) > 1:
        raise ValueError(f"--baseline {asked} matches {len(matches)} groups ({'; '.join(g.label for g in matches)}); "
                         "add KEY=VALUE to pick one")
    return matches[0]


def parse_value(text: str) -> Any:
    """A command-line value as Hydra reads one: true, false, null, a number, or text."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.startswith(("[", "{")):  # a list or mapping, as the label writes it: [1,2]
        with contextlib.suppress(yaml.YAMLError):
            return yaml.safe_load(text)
    return text


def shown(value: Any) -> str:
    """A value as the command line writes it: true, null, 0.001."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _equal(held: Any, wanted: Any) -> bool:
    if isinstance(held, bool) or isinstance(wanted, bool) or held is None or wanted is None:
        return held is wanted or held == wanted and type(held) is type(wanted)
    if isinstance(held, int | float) and isinstance(wanted, int | float):
        return math.isclose(held, wanted, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(held, list | dict) or isinstance(wanted, list | dict):
        return _key(held) == _key(wanted)
    return str(held) == str(wanted)


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _signed(x: float) -> str:
    return ("+" if x > 0 else "") + _number(x)


def _p(p: float) -> str:
    return "p < 0.0001" if p < 1e-4 else f"p = {p:.2g}"


def run_value(records: list[dict[str, Any]], metric: str) -> float | None:
    """A run's metric: best_val_loss the lowest finite val_loss, tokens_per_sec the median, else the last (or None)."""
    if metric == "best_val_loss":
        values = [r["val_loss"] for r in records if _finite(r.get("val_loss"))]
        return min(values) if values else None
    if metric == "tokens_per_sec":
        values = [r[metric] for r in records if _finite(r.get(metric))]
        return statistics.median(values) if values else None
    values = [r[metric] for r in records if _is_number(r.get(metric))]
    return values[-1] if values else None


def _finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- reading a run as train.py wrote it, or refusing it as damaged ---

MAX_BYTES = {METRICS_NAME: 1 << 30, "config.yaml": 1 << 20}  # far past a run's files (~200 B a log line), short of RAM
TOKEN_KEYS = ("train.batch_size", "train.grad_accum", "model.block_size")  # --x tokens multiplies these
FILE_KINDS = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device",
              stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


class Damaged(Exception):
    """A run plot.py can't read; the message names the file and the problem."""


Loaded = tuple[Path, dict[str, Any], list[dict[str, Any]], int]  # a run, its config, records and damaged lines


def load_run(run: Path, needed: tuple[str, ...] = ()) -> Loaded:
    """The run's flat config (key.sub: value, with the settings resolved at start), records and cut-short line count;
    Damaged if a file is unreadable or unlike what train.py writes. needed: keys every log and eval line must hold."""
    path = run / METRICS_NAME
    regular_file(path)
    try:
        records, damaged = read_records(run)
    except OSError as err:
        raise Damaged(f"{path}: can't read it ({err.strerror or err})") from None
    for r in records:
        wanted = (("train_loss",) if "lr" in r else ()) + (needed if "lr" in r or "val_loss" in r else ())
        missing = [key for key in wanted if key not in r]
        if missing:
            raise Damaged(f"{path}: the line of iter {r['iter']} has no {missing[0]}")
        for key, value in r.items():
            if key != "settings" and not _is_number(value):
                raise Damaged(f"{path}: the line of iter {r['iter']} has {key}={value!r}, not a number")

    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    settings = [r["settings"] for r in records if isinstance(r.get("settings"), dict)]
    config = {**walk(read_config(run / "config.yaml"), ""), **(settings[-1] if settings else {})}
    for key in TOKEN_KEYS:
        if key in config and (not isinstance(config[key], int) or isinstance(config[key], bool)):
            raise Damaged(f"{run / 'config.yaml'}: {key}={config[key]!r}, not a whole number")
    return run, config, records, damaged


def read_config(path: Path) -> dict[str, Any]:
    """config.yaml's mapping; {} when the run has none."""
    if not os.path.lexists(path):
        return {}
    regular_file(path)
    try:
        text = path.read_bytes().decode("utf-8")
        config = yaml.load(text, Loader=_NoAliasLoader)
    except OSError as err:
        raise Damaged(f"{path}: can't read it ({err.strerror or err})") from None
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
    try:
        info = os.stat(path)  # follows links, as the read would
    except OSError as err:
        raise Damaged(f"{path}: can't read it ({err.strerror or err})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in FILE_KINDS.items() if test(info.st_mode)), "a special file")
        raise Damaged(f"{path}: {kind}{' behind a link' if path.is_symlink() else ''}, not a regular file")
    if info.st_size > MAX_BYTES[path.name]:
        raise Damaged(f"{path}: {info.st_size:,} bytes, more than a run's {path.name} holds "
                      f"({MAX_BYTES[path.name]:,} at most)")
