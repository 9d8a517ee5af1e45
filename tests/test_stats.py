"""Seeds as replicates: plot.py's groups, intervals and Welch tests (analysis/stats.py), on real small runs and on
hand-made run directories."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from pytest import CaptureFixture
from scipy import stats as scipy_stats
from test_experiments import TINY, plot_ok, plot_refused

import plot
from analysis.stats import Group, compare, find_baseline, group_runs, run_value, seeds_per_arm
from conftest import REPO, compose_config
from training.run import train


@pytest.fixture(scope="module")
def seed_sweeps(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Path:
    """Two sweeps of real runs: lr 1e-4 and 3e-3 (30x) over seeds 1-3 in a/sweep; and lr 1e-4 again over seeds 4-6
    with a key set that changes nothing computed (train.peak_tflops only scales the MFU) in b/sweep. In-process, as
    a sweep lays its jobs out (test_experiments runs Hydra's): two train.py starts cost more than the nine runs."""
    tmp = tmp_path_factory.mktemp("seeds")
    longer = ["train.max_iters=30", "train.eval_interval=30", "train.eval_iters=8"]  # clear of the early noise
    jobs = {"a": [(lr, 10.0, seed) for lr in ("1e-4", "3e-3") for seed in (1, 2, 3)],
            "b": [("1e-4", 6.0, seed) for seed in (4, 5, 6)]}
    for name, settings in jobs.items():
        for job, (lr, peak, seed) in enumerate(settings):
            keys = [f"train.learning_rate={lr}", f"train.peak_tflops={peak}", f"seed={seed}"]
            out = f"out_dir={tmp / name / 'sweep' / str(job)}"
            train(compose_config([*TINY, f"data.input={corpus_path}", f"data.dir={tmp / 'data'}", out, *longer, *keys]))
    return tmp


def test_a_30x_learning_rate_is_found_and_a_key_that_changes_nothing_is_not(
    seed_sweeps: Path, capsys: CaptureFixture[str]
) -> None:
    out = seed_sweeps / "ab.json"
    args = [str(seed_sweeps / "a" / "sweep"), str(seed_sweeps / "b" / "sweep"), "-o", str(seed_sweeps / "ab.png")]
    baseline = ["--baseline", "train.learning_rate=1e-4", "train.peak_tflops=10.0"]
    stdout, _ = plot_ok(capsys, *args, *baseline, "--json", str(out))
    document = json.loads(out.read_text())
    assert document["metric"] == "val_loss"
    groups = document["groups"]
    assert [g["config"] for g in groups] == [  # baseline first, each named by the keys that differ between groups
        {"train.learning_rate": 1e-4, "train.peak_tflops": 10.0},
        {"train.learning_rate": 3e-3, "train.peak_tflops": 10.0},
        {"train.learning_rate": 1e-4, "train.peak_tflops": 6.0},
    ]
    assert [g["n"] for g in groups] == [3, 3, 3]
    for g in groups:  # each run's own final val loss, and the group's statistics from them
        finals = [_final_val(Path(run)) for run in g["runs"]]
        assert g["values"] == finals and g["mean"] == pytest.approx(sum(finals) / 3)
        assert g["ci95"][0] < g["mean"] < g["ci95"][1]
    strong, null = document["comparisons"]
    assert strong["group"] == groups[1]["config"] and strong["baseline"] == groups[0]["config"]
    assert strong["p_value"] < 0.01 and strong["diff"] < 0 and strong["ci95"][1] < 0  # the CI excludes 0
    assert strong["verdict"].startswith("train.learning_rate=0.003 train.peak_tflops=10.0 vs ")
    assert strong["verdict"].endswith(", 3 seeds each: better")
    assert null["p_value"] >= 0.05 and null["ci95"][0] < 0 < null["ci95"][1]
    assert "no difference detected at 3 seeds; an effect of" in null["verdict"]
    assert f"about {null['seeds_needed']:,} seeds per arm" in null["verdict"] and null["seeds_needed"] > 3
    assert strong["verdict"] in stdout and null["verdict"] in stdout
    assert (seed_sweeps / "ab.png").is_file()


def test_each_run_records_what_it_resolved_at_start(seed_sweeps: Path) -> None:
    """train.dtype=auto and train.compile=null are resolved at start: metrics.jsonl says to what, once."""
    run = seed_sweeps / "a" / "sweep" / "0"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    settings = [r for r in records if "settings" in r]
    assert len(settings) == 1 and settings[0]["iter"] == 0
    assert settings[0]["settings"]["device"] == "cpu" and settings[0]["settings"]["train.compile"] is False
    assert settings[0]["settings"]["train.dtype"] in ("float32", "bfloat16") and settings[0]["settings"]["threads"] >= 1


def _final_val(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if "val_loss" in r][-1]


def _fake_run(path: Path, config: dict, val_losses: list[float], settings: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    records = [{"iter": 0, "settings": settings}] if settings else []
    records += [{"iter": 5 * i, "train_loss": v, "val_loss": v, "elapsed_s": 1.0 + i} for i, v in enumerate(val_losses)]
    records.append({"iter": 10, "train_loss": 1.0, "lr": 1e-3, "elapsed_s": 3.0, "tokens_per_sec": 100.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _values_sweep(tmp_path: Path, arms: dict[str, tuple[dict, list[float]]]) -> Path:
    """One run per final val loss of each arm, seeds 1, 2, ..."""
    for name, (config, finals) in arms.items():
        for seed, final in enumerate(finals, 1):
            _fake_run(tmp_path / "sweep" / f"{name}_{seed}", {**config, "seed": seed, "out_dir": name}, [3.0, final])
    return tmp_path / "sweep"


def _plot(capsys: CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[str, str]:
    """plot.py in-process, its picture in tmp_path: stdout and stderr."""
    return plot_ok(capsys, *args, "-o", str(tmp_path / "loss.png"))


def test_welch_difference_interval_and_p_value_follow_the_formulas() -> None:
    a = Group({"k": 1}, [Path("a1"), Path("a2"), Path("a3"), Path("a4")], [1.0, 1.2, 0.9, 1.1])
    b = Group({"k": 2}, [Path("b1"), Path("b2"), Path("b3")], [1.5, 1.9, 1.6])
    comparison = compare(b, a, "val_loss")
    va, vb = 0.0166667 / 4, 0.0433333 / 3  # the sample variances over n
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 2)
    t = (5.0 / 3 - 1.05) / math.sqrt(va + vb)
    assert comparison.diff == pytest.approx(5.0 / 3 - 1.05)
    assert comparison.p_value == pytest.approx(2 * scipy_stats.t.sf(t, df), rel=1e-4)
    half = scipy_stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert comparison.ci95 == pytest.approx((comparison.diff - half, comparison.diff + half), rel=1e-4)
    assert a.std == pytest.approx(math.sqrt(0.0166667), rel=1e-5)
    assert a.ci95 == pytest.approx((1.05 - 3.182446 * a.std / 2, 1.05 + 3.182446 * a.std / 2), rel=1e-5)
    assert a.ci95[1] > b.ci95[0]  # the groups' intervals overlap, yet the difference's excludes 0: a real difference
    assert comparison.verdict.endswith("p = 0.018, 3 and 4 seeds: worse; the groups' intervals overlap, but the "
                                       "verdict is the difference's interval, which excludes 0")


def test_seeds_per_arm_is_the_noncentral_t_power_calculation() -> None:
    """The textbook figures for a two-sided two-sample t-test at alpha 0.05 and power 0.8 (equal spreads); unequal
    spreads have Welch's fewer degrees of freedom, so they need at least as many."""
    assert seeds_per_arm(1.0, 1.0, 1.0) == 17
    assert seeds_per_arm(0.5, 1.0, 1.0) == 64
    assert seeds_per_arm(-2.0, 1.0, 1.0) == 6
    assert seeds_per_arm(1e-3, 1.0, 1.0) is None  # past 10,000 seeds per arm
    assert seeds_per_arm(1.0, 0.2, math.sqrt(2 - 0.04)) >= 17


def test_one_run_has_no_interval_and_no_spread_is_certain() -> None:
    single = Group({}, [Path("x")], [1.0])
    assert single.std is None and single.ci95 is None
    same = compare(Group({}, [Path("a"), Path("b")], [2.0, 2.0]), Group({}, [Path("c"), Path("d")], [2.0, 2.0]), "m")
    assert same.p_value == 1.0 and same.diff == 0 and same.verdict.endswith("no difference at all")
    apart = compare(Group({}, [Path("a"), Path("b")], [3.0, 3.0]), Group({}, [Path("c"), Path("d")], [2.0, 2.0]), "m")
    assert apart.p_value == 0.0 and apart.verdict.endswith(": the runs of each group are identical")


def test_groups_form_on_the_training_config_and_what_the_runs_resolved(tmp_path: Path) -> None:
    """Seeds, out_dir, wandb and logging keys don't split a group; a dtype=auto that resolved differently does,
    as does every other key (a multirun over two keys gives four groups)."""
    runs, configs = [], []
    for i, (lr, layers, dtype) in enumerate(
        [(1e-3, 1, "float32"), (1e-3, 1, "float32"), (3e-3, 1, "float32"), (1e-3, 2, "float32"), (3e-3, 2, "x")]
        + [(1e-3, 1, "bfloat16")]
    ):
        runs.append(Path(f"run{i}"))
        configs.append(
            {"seed": i, "out_dir": f"d{i}", "wandb.run_name": f"r{i}", "train.log_interval": i + 1}
            | {"train.learning_rate": lr, "model.n_layer": layers, "train.dtype": dtype}
        )
    groups = group_runs(runs, configs, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert [(g.config, g.values) for g in groups] == [
        ({"model.n_layer": 1, "train.dtype": "float32", "train.learning_rate": 1e-3}, [1.0, 2.0]),
        ({"model.n_layer": 1, "train.dtype": "float32", "train.learning_rate": 3e-3}, [3.0]),
        ({"model.n_layer": 2, "train.dtype": "float32", "train.learning_rate": 1e-3}, [4.0]),
        ({"model.n_layer": 2, "train.dtype": "x", "train.learning_rate": 3e-3}, [5.0]),
        ({"model.n_layer": 1, "train.dtype": "bfloat16", "train.learning_rate": 1e-3}, [6.0]),
    ]
    assert groups[0].runs == [Path("run0"), Path("run1")]
    assert groups[0].label == "model.n_layer=1 train.dtype=float32 train.learning_rate=0.001"


def test_plot_py_groups_on_the_recorded_precision_not_the_typed_auto(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    for seed, dtype in enumerate(["float32", "float32", "bfloat16", "bfloat16"]):
        settings = {"device": "cpu", "train.dtype": dtype, "train.compile": False, "threads": 2}
        _fake_run(tmp_path / "sweep" / str(seed), {"seed": seed, "train": {"dtype": "auto"}}, [3.0, 2 + seed], settings)
    stdout, _ = _plot(capsys, tmp_path, str(tmp_path / "sweep"))
    assert re.search(r"^train.dtype=float32 \(baseline\) +2 ", stdout, re.M)
    assert re.search(r"^train.dtype=bfloat16 +2 ", stdout, re.M)
    assert "train.dtype=bfloat16 vs train.dtype=float32: +2 val_loss" in stdout


def test_baseline_values_match_as_the_config_holds_them() -> None:
    configs = [
        {"train.learning_rate": 0.001, "model.qk_norm": True},
        {"train.learning_rate": 0.003, "model.qk_norm": True},
    ]
    configs += [{"train.learning_rate": 0.001, "model.qk_norm": False}]
    groups = group_runs([Path("a"), Path("b"), Path("c")], configs, [1.0, 2.0, 3.0])
    assert find_baseline(groups, ["train.learning_rate=1e-3", "model.qk_norm=false"]) is groups[2]
    assert find_baseline(groups, ["train.learning_rate=3E-3"]) is groups[1]
    with pytest.raises(ValueError, match=r"matches 2 groups .*; add KEY=VALUE to pick one"):
        find_baseline(groups, ["model.qk_norm=true"])
    with pytest.raises(ValueError, match="matches no group; the groups: "):
        find_baseline(groups, ["train.learning_rate=0.01"])
    with pytest.raises(ValueError, match="no run has the key train.lr"):
        find_baseline(groups, ["train.lr=0.01"])
    with pytest.raises(ValueError, match="differ only in seed are replicates"):
        find_baseline(groups, ["seed=1"])
    with pytest.raises(ValueError, match="write it as KEY=VALUE"):
        find_baseline(groups, ["model.qk_norm"])


def test_run_value_picks_each_metric() -> None:
    records = [
        {"iter": 0, "val_loss": 3.0, "elapsed_s": 1.0},
        {"iter": 5, "lr": 1.0, "train_loss": 2.0, "tokens_per_sec": 10.0},
        {"iter": 5, "lr": 1.0, "train_loss": 2.0, "tokens_per_sec": 30.0},
        {"iter": 5, "lr": 1.0, "train_loss": 2.0, "tokens_per_sec": 20.0},
        {"iter": 10, "val_loss": 2.0, "time_to_target_s": 7.5},
        {"iter": 15, "val_loss": 2.5},
        {"iter": 20, "val_loss": math.nan},
    ]
    assert math.isnan(run_value(records, "val_loss"))  # the last evaluation: a run that diverged there
    assert run_value(records[:-1], "val_loss") == 2.5
    assert run_value(records, "best_val_loss") == 2.0
    assert run_value(records, "tokens_per_sec") == 20.0  # the median
    assert run_value(records, "time_to_target_s") == 7.5
    assert run_value(records, "hellaswag_acc") is None


def test_plot_py_refuses_what_it_cannot_test_in_one_line(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1]), "b": ({"k": 2}, [1.2, 1.3])})
    for args, message in [
        (["--baseline", "k=3"], "error: --baseline k=3 matches no group; the groups: k=1; k=2"),
        (["--baseline", "j=3"], "error: --baseline j=3: no run has the key j"),
        (["--metric", "time_to_target_s"], "error: --metric time_to_target_s: 4 of 4 runs recorded none ("),
        (["--json", str(tmp_path / "missing" / "x.json")], "error: --json "),
    ]:
        stderr = plot_refused(capsys, str(sweep_dir), *args, "-o", str(tmp_path / "loss.png"))
        assert stderr.startswith(message), stderr
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def test_plot_py_warns_for_groups_of_one_and_compares_the_rest(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    arms = {"a": ({"k": 1}, [1.0, 1.1, 1.05]), "b": ({"k": 2}, [1.5, 1.6, 1.55]), "c": ({"k": 3}, [1.0])}
    out = tmp_path / "ab.json"
    stdout, stderr = _plot(capsys, tmp_path, str(_values_sweep(tmp_path, arms)), "--json", str(out))
    assert "warning: k=3 has one run: no interval and no test; repeat it over seeds" in stderr
    assert re.search(r"^k=3 +1 +1.0000 +- +- \(one run\)$", stdout, re.M)
    document = json.loads(out.read_text())
    assert set(document) == {"metric", "groups", "comparisons"}
    assert [g["ci95"] is None for g in document["groups"]] == [False, False, True]
    assert document["groups"][2]["std"] is None
    (comparison,) = document["comparisons"]  # k=3 can't be tested
    assert {"group", "baseline", "diff", "ci95", "p_value", "verdict"} <= set(comparison)
    assert comparison["group"] == {"k": 2} and comparison["baseline"] == {"k": 1}
    assert comparison["diff"] == pytest.approx(0.5) and comparison["p_value"] < 0.01


def test_plot_py_without_replicates_prints_no_statistics(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    """Runs that all differ are compared run by run, as before; with repeats a group picture is drawn."""
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0]), "b": ({"k": 2}, [1.2])})
    stdout, stderr = _plot(capsys, tmp_path, str(sweep_dir))
    assert "95% CI" not in stdout and "warning" not in stderr
    single, _ = _plot(capsys, tmp_path, str(sweep_dir / "a_1"), "--metric", "best_val_loss")  # asked: one group
    assert re.search(r"^all runs +1 +1.0000 ", single, re.M)


@pytest.mark.filterwarnings("error:No artists with labels")  # a legend is drawn only when something has a label
def test_plot_py_draws_identical_replicates_and_groups_sharing_no_evaluation(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """Reruns of one seed are bit-identical on a CPU: three equal values once made a negative error bar."""
    _values_sweep(tmp_path / "same", {"a": ({"k": 1}, [1.6, 1.6, 1.6]), "b": ({"k": 2}, [1.7, 1.7, 1.7])})
    stdout, _ = _plot(capsys, tmp_path, str(tmp_path / "same" / "sweep"))
    assert "k=2 vs k=1: +0.1 val_loss [+0.1, +0.1], p < 0.0001, 3 seeds each: the runs of each group are identical" in (
        stdout
    )
    apart = tmp_path / "apart"
    _fake_run(apart / "r1", {"k": 1, "seed": 1}, [3.0, 2.0])
    run2 = _fake_run(apart / "r2", {"k": 1, "seed": 2}, [3.0, 2.1])
    lines = (run2 / "metrics.jsonl").read_text().replace('"iter": 0,', '"iter": 1,').replace('"iter": 5,', '"iter": 6,')
    (run2 / "metrics.jsonl").write_text(lines)
    _, stderr = _plot(capsys, tmp_path, str(apart), "--json", str(tmp_path / "apart.json"))
    assert "warning: the runs of all runs share no evaluation's iteration: not drawn" in stderr


def test_plot_py_baseline_pairs_before_the_runs_lists_and_absent_keys(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """`--baseline K=V DIR`: DIR is a run directory; a list matches as its label writes it; a key that older runs
    lack is a value of its own, not null."""
    for i, (config, final) in enumerate([({"w": [1, 2]}, 1.0), ({"w": [1, 2]}, 1.1), ({"w": [3]}, 2.0)]):
        _fake_run(tmp_path / "sweep" / f"r{i}", {**config, "seed": i}, [3.0, final])
    _fake_run(tmp_path / "sweep" / "r3", {"w": [3], "seed": 3}, [3.0, 2.2])
    _fake_run(tmp_path / "old" / "r4", {"seed": 4}, [3.0, 2.5])
    stdout, _ = _plot(capsys, tmp_path, "--baseline", "w=[1,2]", str(tmp_path / "sweep"), str(tmp_path / "old"))
    assert re.search(r"^w=\[1,2\] \(baseline\) +2 ", stdout, re.M)
    assert re.search(r"^w=<absent> +1 ", stdout, re.M) and "w=[3] vs w=[1,2]: +1.05 val_loss" in stdout


def test_plot_py_refuses_a_diverged_final_evaluation_when_asked(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1]), "b": ({"k": 2}, [1.2, math.nan])})
    stderr = plot_refused(capsys, str(sweep_dir), "--baseline", "k=1", "-o", str(tmp_path / "loss.png"))
    assert stderr.startswith("error: --metric val_loss: 1 run(s) ended with NaN or inf (") and "Traceback" not in stderr
    stdout, stderr = _plot(capsys, tmp_path, str(sweep_dir))  # not asked: the curves, a warning, no statistics
    assert "no statistics" in stderr and "95% CI" not in stdout
    _plot(capsys, tmp_path, str(sweep_dir), "--metric", "best_val_loss")  # status 0: compared on the best


def _damage(sweep_dir: Path) -> dict[str, str]:
    """One run of each kind of damaged regular file plot.py must skip, and what its warning says: {run: problem}."""
    string_loss = _fake_run(sweep_dir / "string_loss", {"k": 9, "seed": 1}, [3.0, 2.0])
    text = (string_loss / "metrics.jsonl").read_text().replace('"val_loss": 2.0', '"val_loss": "2.0"')
    (string_loss / "metrics.jsonl").write_text(text)
    no_train_loss = _fake_run(sweep_dir / "no_train_loss", {"k": 9, "seed": 2}, [3.0])
    with (no_train_loss / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"iter": 15, "lr": 1e-3, "elapsed_s": 4.0}) + "\n")
    bad_utf8 = _fake_run(sweep_dir / "bad_utf8", {"k": 9, "seed": 3}, [3.0])
    (bad_utf8 / "config.yaml").write_bytes(b"k: caf\xe9\n")
    not_yaml = _fake_run(sweep_dir / "not_yaml", {"k": 9, "seed": 4}, [3.0])
    (not_yaml / "config.yaml").write_text("k: [1, 2\n")
    alias_bomb = _fake_run(sweep_dir / "alias_bomb", {"k": 9, "seed": 5}, [3.0])  # each level 3x: 9 levels, 3.5 GB
    (alias_bomb / "config.yaml").write_text("a: &a [1, 1, 1]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n")
    too_deep = _fake_run(sweep_dir / "too_deep", {"k": 9, "seed": 6}, [3.0])
    (too_deep / "config.yaml").write_text("k: " + "[" * 100_000 + "\n")
    return {
        "string_loss": "metrics.jsonl: the line of iter 5 has val_loss='2.0', not a number",
        "no_train_loss": "metrics.jsonl: the line of iter 15 has no train_loss",
        "bad_utf8": "config.yaml: not UTF-8 text (byte 6 is 0xe9)",
        "not_yaml": "config.yaml: not YAML (",
        "alias_bomb": "config.yaml: not YAML (line 2, column 8: an alias, *a, which train.py never writes)",
        "too_deep": "config.yaml: nested too deep for a config",
    }


def _skipped(stderr: str, sweep_dir: Path, problems: dict[str, str]) -> None:
    """One warning per damaged run, naming it and its problem."""
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == len(problems) and "Traceback" not in stderr
    for run, problem in problems.items():
        (line,) = [w for w in warnings if w.startswith(f"warning: {sweep_dir / run}/")]
        assert problem in line and line.endswith("; run skipped"), line


def test_plot_py_skips_each_damaged_run_with_one_warning_and_plots_the_rest(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1])})
    problems = _damage(sweep_dir)
    stdout, stderr = plot_ok(capsys, str(sweep_dir))
    _skipped(stderr, sweep_dir, problems)
    table = stdout.split("\n\n")[0]
    assert str(sweep_dir / "a_1") in table and str(sweep_dir / "a_2") in table
    assert not any(str(sweep_dir / run) in table for run in problems)
    assert (sweep_dir / "loss.png").is_file()


def test_plot_py_with_every_run_damaged_is_one_line_and_status_2(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    problems = _damage(tmp_path / "sweep")
    stderr = plot_refused(capsys, str(tmp_path / "sweep"))
    (line,) = stderr.splitlines()
    assert line.startswith(f"error: all {len(problems)} runs are damaged, the first: {tmp_path / 'sweep'}/")
    assert "Traceback" not in stderr


@contextlib.contextmanager
def _within(seconds: int) -> Iterator[None]:
    """A read that blocks (a FIFO) in this process fails the test when the alarm rings, rather than hanging it."""

    def ring(signum: int, frame: object) -> None:
        raise TimeoutError(f"plot.py still running after {seconds} s: a read blocked")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_plot_py_command_skips_a_fifo_and_a_device_behind_a_link_and_refuses_a_fifo_alone(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """The command end to end, in a subprocess (plot.py's one): a read that would block (a FIFO) or never end
    (/dev/zero) fails this test by its timeout rather than hanging the suite; a run that can't be read alone is one
    line, status 2 (in this process, under an alarm)."""
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1])})
    (sweep_dir / "fifo").mkdir()
    os.mkfifo(sweep_dir / "fifo" / "metrics.jsonl")
    (sweep_dir / "zero").mkdir()
    (sweep_dir / "zero" / "metrics.jsonl").symlink_to("/dev/zero")
    problems = {
        "fifo": "metrics.jsonl: a FIFO, not a regular file",
        "zero": "metrics.jsonl: a character device behind a link, not a regular file",
    }
    result = subprocess.run([sys.executable, str(REPO / "plot.py"), str(sweep_dir)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    _skipped(result.stderr, sweep_dir, problems)
    table = result.stdout.split("\n\n")[0]
    assert str(sweep_dir / "a_1") in table and not any(str(sweep_dir / run) in table for run in problems)
    with _within(60):
        alone = plot_refused(capsys, str(sweep_dir / "fifo"))
    assert alone == f"error: {sweep_dir / 'fifo' / 'metrics.jsonl'}: a FIFO, not a regular file; nothing left to plot\n"


def test_plot_py_writes_its_picture_into_the_sweep_folder_titled_with_groups_and_runs(
    tmp_path: Path, capsys: CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not into the current directory; the title counts groups and runs; the legend says what ± is."""
    from PIL import Image

    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1, 1.2]), "b": ({"k": 2}, [1.5, 1.6, 1.7])})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    _, stderr = plot_ok(capsys, str(sweep_dir))
    assert stderr.strip().endswith(f"wrote {sweep_dir / 'loss.png'}") and not list(elsewhere.iterdir())
    with Image.open(sweep_dir / "loss.png") as image:
        text = image.text
    assert text["Title"] == "2 groups, 6 runs in all: loss against iter"
    legend = text["Description"].splitlines()
    assert legend[0] == "each group: n runs, val_loss: mean ± 95% CI half-width"
    half = (scipy_stats.t.ppf(0.975, 2) * 0.1 / math.sqrt(3))  # the table's interval, [mean - half, mean + half]
    assert legend[1] == f"k=1 (baseline): n=3, val_loss 1.1000 ± {half:.4f}"
    _, two = plot_ok(capsys, str(sweep_dir / "a_1"), str(sweep_dir / "b_1"))  # several: the folder holding them
    assert two.strip().endswith(f"wrote {sweep_dir / 'loss.png'}")


def test_plot_py_replaces_a_link_at_its_outputs_and_refuses_a_fifo(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    """A link at -o or --json is replaced by the new file, the file it pointed to left as it was; a FIFO there is
    refused in one line before anything opens it (the alarm fails the test, rather than hang it, if one did)."""
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1]), "b": ({"k": 2}, [1.5, 1.6])})
    kept = tmp_path / "kept.txt"
    kept.write_text("someone's file\n")
    picture, document = tmp_path / "loss.png", tmp_path / "ab.json"
    picture.symlink_to(kept)
    document.symlink_to(kept)
    plot_ok(capsys, str(sweep_dir), "-o", str(picture), "--json", str(document))
    assert kept.read_text() == "someone's file\n"
    assert not picture.is_symlink() and picture.read_bytes().startswith(b"\x89PNG")
    assert not document.is_symlink() and json.loads(document.read_text())["metric"] == "val_loss"
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    with _within(60):
        for args in (["-o", str(fifo)], ["-o", str(picture), "--json", str(fifo)]):
            stderr = plot_refused(capsys, str(sweep_dir), *args)
            option = args[-2]
            assert stderr == f"error: {option} {fifo}: not a regular file (a FIFO, a device); name a file\n"


def test_plot_py_leaves_out_a_metrics_line_nested_too_deep_with_one_warning(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """100,000 brackets are past Python's recursion limit for json.loads: one damaged line, not a traceback."""
    run = _fake_run(tmp_path / "run", {"k": 1}, [3.0, 2.0])
    with (run / "metrics.jsonl").open("a") as f:
        f.write("[" * 100_000 + "\n")
    stdout, stderr = _plot(capsys, tmp_path, str(run))
    assert stderr.splitlines()[0] == f"warning: {run / 'metrics.jsonl'}: left out 1 damaged line(s)"
    assert len([line for line in stderr.splitlines() if line.startswith("warning")]) == 1
    assert re.search(rf"^{run} +run +2.0000 ", stdout, re.M)


def test_a_run_without_config_yaml_shows_no_keys_and_joins_no_group(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """What a run without config.yaml trained is unknown: its row names no key (the others, only keys that differ
    between runs that have them) and it is no replicate of anything."""
    many = {f"model.key{i}": i for i in range(50)}
    sweep_dir = _values_sweep(tmp_path, {"a": (many, [1.0, 1.1, 1.2])})
    (sweep_dir / "a_3" / "config.yaml").unlink()
    stdout, stderr = _plot(capsys, tmp_path, str(sweep_dir))
    table, groups = stdout.split("\n\n")
    assert "None" not in stdout and "<absent>" not in stdout and "model.key" not in stdout
    assert [line.split()[:2] for line in table.splitlines()[1:]] == [
        [str(sweep_dir / "a_1"), "seed=1"], [str(sweep_dir / "a_2"), "seed=2"], [str(sweep_dir / "a_3"), "a_3"]]
    assert f"warning: 1 run(s) without config.yaml ({sweep_dir / 'a_3'}): left out of the groups" in stderr
    assert re.search(r"^all runs +2 +1.0500 ", groups, re.M)


def test_plot_py_keeps_the_y_label_inside_its_picture(
    tmp_path: Path, capsys: CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups' y label is the longest: it once ran past the top and bottom of the picture."""
    drawn = []
    figure = plot.figure
    monkeypatch.setattr(plot, "figure", lambda *args: drawn.append(figure(*args)) or drawn[-1])
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1]), "b": ({"k": 2}, [1.5, 1.6])})
    _plot(capsys, tmp_path, str(sweep_dir))
    (fig,) = drawn
    fig.draw_without_rendering()  # the layout, as savefig ran it
    label, inside = fig.axes[0].yaxis.label.get_window_extent(), fig.bbox
    assert "each group's mean" in fig.axes[0].get_ylabel()
    assert inside.x0 <= label.x0 and label.x1 <= inside.x1 and inside.y0 <= label.y0 and label.y1 <= inside.y1
