"""Seeds as replicates: plot.py's groups, intervals and Welch tests, on real small runs and on hand-made run
directories; and plot.py refusing runs it can't read."""

import json
import math
import os
import re
import signal
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from pytest import CaptureFixture
from scipy import stats as scipy_stats
from test_experiments import TINY, plot_ok, plot_refused

import plot
from conftest import compose_config
from plot import Group, compare, find_baseline, group_runs, run_value, seeds_per_arm
from train import train


@pytest.fixture(scope="module")
def seed_sweeps(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Path:
    """lr 1e-4 and 3e-3 (30x) over seeds 1-3 in a/sweep; lr 1e-4 over seeds 4-6 in b/sweep with a key that changes
    nothing computed (train.peak_tflops only scales the MFU). In-process, laid out as a sweep lays out its jobs."""
    tmp = tmp_path_factory.mktemp("seeds")
    jobs = {"a": [(lr, 10.0, seed) for lr in ("1e-4", "3e-3") for seed in (1, 2, 3)],
            "b": [("1e-4", 6.0, seed) for seed in (4, 5, 6)]}
    for name, settings in jobs.items():
        for job, (lr, peak, seed) in enumerate(settings):
            keys = [f"train.learning_rate={lr}", f"train.peak_tflops={peak}", f"seed={seed}", "train.max_iters=30",
                    "train.eval_interval=30", "train.eval_iters=8", f"out_dir={tmp / name / 'sweep' / str(job)}"]
            train(compose_config([*TINY, f"data.input={corpus_path}", f"data.dir={tmp / 'data'}", *keys]))
    return tmp


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_30x_learning_rate_is_found_and_a_key_that_changes_nothing_is_not(
    seed_sweeps: Path, capsys: CaptureFixture[str]
) -> None:
    out = seed_sweeps / "ab.json"
    args = [str(seed_sweeps / "a" / "sweep"), str(seed_sweeps / "b" / "sweep"), "-o", str(seed_sweeps / "ab.png")]
    baseline = ["--baseline", "train.learning_rate=1e-4", "train.peak_tflops=10.0"]
    stdout, _ = plot_ok(capsys, *args, *baseline, "--json", str(out))
    document = json.loads(out.read_text())
    groups = document["groups"]
    assert document["metric"] == "val_loss" and [g["config"] for g in groups] == [  # baseline first
        {"train.learning_rate": 1e-4, "train.peak_tflops": 10.0},
        {"train.learning_rate": 3e-3, "train.peak_tflops": 10.0},
        {"train.learning_rate": 1e-4, "train.peak_tflops": 6.0},
    ]
    for g in groups:  # each run's own final val loss, and the group's statistics from them
        finals = [[r["val_loss"] for r in _records(Path(run)) if "val_loss" in r][-1] for run in g["runs"]]
        assert g["n"] == 3 and g["values"] == finals and g["mean"] == pytest.approx(sum(finals) / 3)
        assert g["ci95"][0] < g["mean"] < g["ci95"][1]
    strong, null = document["comparisons"]
    assert strong["group"] == groups[1]["config"] and strong["baseline"] == groups[0]["config"]
    assert strong["p_value"] < 0.01 and strong["diff"] < 0 and strong["ci95"][1] < 0  # the CI excludes 0
    assert strong["verdict"].startswith("train.learning_rate=0.003 train.peak_tflops=10.0 vs ")
    assert strong["verdict"].endswith(", 3 seeds each: better")
    assert null["p_value"] >= 0.05 and null["ci95"][0] < 0 < null["ci95"][1]
    assert "no difference detected at 3 seeds; an effect of" in null["verdict"]
    assert f"about {null['seeds_needed']:,} seeds per arm" in null["verdict"] and null["seeds_needed"] > 3
    assert strong["verdict"] in stdout and null["verdict"] in stdout and (seed_sweeps / "ab.png").is_file()


def _write_run(path: Path, config: dict, records: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _fake_run(path: Path, config: dict, val_losses: list[float], settings: dict | None = None) -> Path:
    records = [{"iter": 0, "settings": settings}] if settings else []
    records += [{"iter": 5 * i, "train_loss": v, "val_loss": v, "elapsed_s": 1.0 + i} for i, v in enumerate(val_losses)]
    records.append({"iter": 10, "train_loss": 1.0, "lr": 1e-3, "elapsed_s": 3.0, "tokens_per_sec": 100.0})
    return _write_run(path, config, records)


def _values_sweep(tmp_path: Path, arms: dict[str, tuple[dict, list[float]]]) -> Path:
    """One run per final val loss of each arm, seeds 1, 2, ..."""
    for name, (config, finals) in arms.items():
        for seed, final in enumerate(finals, 1):
            _fake_run(tmp_path / "sweep" / f"{name}_{seed}", {**config, "seed": seed, "out_dir": name}, [3.0, final])
    return tmp_path / "sweep"


def _plot(capsys: CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[str, str]:
    """plot.py in-process, its picture in tmp_path: stdout and stderr."""
    return plot_ok(capsys, *args, "-o", str(tmp_path / "loss.png"))


def test_welch_difference_interval_p_value_and_seeds_per_arm_follow_the_formulas() -> None:
    a = Group({"k": 1}, [Path("a1"), Path("a2"), Path("a3"), Path("a4")], [1.0, 1.2, 0.9, 1.1])
    b = Group({"k": 2}, [Path("b1"), Path("b2"), Path("b3")], [1.5, 1.9, 1.6])
    comparison = compare(b, a, "val_loss")
    va, vb = 0.0166667 / 4, 0.0433333 / 3  # the sample variances over n
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 2)
    assert comparison.diff == pytest.approx(5.0 / 3 - 1.05)
    assert comparison.p_value == pytest.approx(2 * scipy_stats.t.sf(comparison.diff / math.sqrt(va + vb), df), rel=1e-4)
    half = scipy_stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert comparison.ci95 == pytest.approx((comparison.diff - half, comparison.diff + half), rel=1e-4)
    assert a.std == pytest.approx(math.sqrt(0.0166667), rel=1e-5)
    assert a.ci95 == pytest.approx((1.05 - 3.182446 * a.std / 2, 1.05 + 3.182446 * a.std / 2), rel=1e-5)
    assert a.ci95[1] > b.ci95[0]  # the groups' intervals overlap, yet the difference's excludes 0: a real difference
    assert comparison.verdict.endswith("p = 0.018, 3 and 4 seeds: worse; the groups' intervals overlap, but the "
                                       "verdict is the difference's interval, which excludes 0")
    single = Group({}, [Path("x")], [1.0])  # one run: no interval
    assert single.std is None and single.ci95 is None
    same = compare(Group({}, [Path("a"), Path("b")], [2.0, 2.0]), Group({}, [Path("c"), Path("d")], [2.0, 2.0]), "m")
    assert same.p_value == 1.0 and same.diff == 0 and same.verdict.endswith("no difference at all")  # no spread at all
    apart = compare(Group({}, [Path("a"), Path("b")], [3.0, 3.0]), Group({}, [Path("c"), Path("d")], [2.0, 2.0]), "m")
    assert apart.p_value == 0.0 and apart.verdict.endswith(": the runs of each group are identical")
    # seeds per arm: the textbook figures for a two-sided two-sample t-test at alpha 0.05 and power 0.8 (equal
    # spreads); unequal spreads have Welch's fewer degrees of freedom, so they need at least as many
    assert [seeds_per_arm(d, 1.0, 1.0) for d in (1.0, 0.5, -2.0, 1e-3)] == [17, 64, 6, None]  # None: past 10,000
    assert seeds_per_arm(1.0, 0.2, math.sqrt(2 - 0.04)) >= 17


def test_groups_form_on_the_training_config_and_baselines_match_as_the_config_holds_them() -> None:
    """Seeds, out_dir, wandb and logging keys don't split a group; a dtype=auto that resolved differently does, as
    does every other key (a multirun over two keys gives four groups)."""
    settings = [(1e-3, 1, "float32"), (1e-3, 1, "float32"), (3e-3, 1, "float32"), (1e-3, 2, "float32"),
                (3e-3, 2, "x"), (1e-3, 1, "bfloat16")]
    configs = [{"seed": i, "out_dir": f"d{i}", "wandb.run_name": f"r{i}", "train.log_interval": i + 1,
                "train.learning_rate": lr, "model.n_layer": layers, "train.dtype": dtype}
               for i, (lr, layers, dtype) in enumerate(settings)]
    groups = group_runs([Path(f"run{i}") for i in range(6)], configs, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert [(g.config, g.values) for g in groups] == [
        ({"model.n_layer": 1, "train.dtype": "float32", "train.learning_rate": 1e-3}, [1.0, 2.0]),
        ({"model.n_layer": 1, "train.dtype": "float32", "train.learning_rate": 3e-3}, [3.0]),
        ({"model.n_layer": 2, "train.dtype": "float32", "train.learning_rate": 1e-3}, [4.0]),
        ({"model.n_layer": 2, "train.dtype": "x", "train.learning_rate": 3e-3}, [5.0]),
        ({"model.n_layer": 1, "train.dtype": "bfloat16", "train.learning_rate": 1e-3}, [6.0]),
    ]
    assert groups[0].runs == [Path("run0"), Path("run1")]
    assert groups[0].label == "model.n_layer=1 train.dtype=float32 train.learning_rate=0.001"
    configs = [{"train.learning_rate": lr, "model.qk_norm": qk} for lr, qk in ((0.001, True), (0.003, True),
                                                                               (0.001, False))]
    groups = group_runs([Path("a"), Path("b"), Path("c")], configs, [1.0, 2.0, 3.0])
    assert find_baseline(groups, ["train.learning_rate=1e-3", "model.qk_norm=false"]) is groups[2]
    assert find_baseline(groups, ["train.learning_rate=3E-3"]) is groups[1]
    named = group_runs([Path("a"), Path("b")], [{"data.name": "2024"}, {"data.name": "x"}], [1.0, 2.0])
    assert find_baseline(named, ["data.name=2024"]) is named[0]  # a text value that reads as a number
    for wanted, message in [(["model.qk_norm=true"], r"matches 2 groups .*; add KEY=VALUE to pick one"),
                            (["train.learning_rate=0.01"], "matches no group; the groups: "),
                            (["train.lr=0.01"], "no run has the key train.lr"),
                            (["seed=1"], "differ only in seed are replicates"),
                            (["model.qk_norm"], "write it as KEY=VALUE")]:
        with pytest.raises(ValueError, match=message):
            find_baseline(groups, wanted)


def test_run_value_picks_each_metric() -> None:
    records = [
        {"iter": 0, "val_loss": 3.0, "elapsed_s": 1.0},
        *({"iter": 5, "lr": 1.0, "train_loss": 2.0, "tokens_per_sec": speed} for speed in (10.0, 30.0, 20.0)),
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


@pytest.mark.parametrize(("arms", "args", "message"), [
    ({}, ["--baseline", "k=3"], "error: --baseline k=3 matches no group; the groups: k=1; k=2"),
    ({}, ["--metric", "time_to_target_s"], "error: --metric time_to_target_s: 4 of 4 runs ("),
    ({}, ["--json", "missing/x.json"], "error: --json "),
    ({"b": ({"k": 2}, [1.2, math.nan])}, ["--baseline", "k=1"],
     "error: --metric val_loss: 1 run(s) have NaN or inf ("),
])
def test_plot_py_refuses_what_it_cannot_test_in_one_line(
    tmp_path: Path, capsys: CaptureFixture[str], arms: dict, args: list[str], message: str
) -> None:
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1]), "b": ({"k": 2}, [1.2, 1.3]), **arms})
    args = [str(tmp_path / arg) if arg.endswith(".json") else arg for arg in args]
    stderr = plot_refused(capsys, str(sweep_dir), *args, "-o", str(tmp_path / "loss.png"))
    assert stderr.startswith(message) and len(stderr.strip().splitlines()) == 1, stderr
    if arms:  # not asked for statistics: the curves, a warning, no statistics; or compared on the best val loss
        stdout, stderr = _plot(capsys, tmp_path, str(sweep_dir))
        assert "no statistics" in stderr and "95% CI" not in stdout
        _plot(capsys, tmp_path, str(sweep_dir), "--metric", "best_val_loss")


def test_plot_py_warns_for_groups_of_one_and_compares_the_rest_and_without_replicates_prints_no_statistics(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """Runs that all differ are compared run by run; asked for a metric, even one run is a group."""
    arms = {"a": ({"k": 1}, [1.0, 1.1, 1.05]), "b": ({"k": 2}, [1.5, 1.6, 1.55]), "c": ({"k": 3}, [1.0])}
    out = tmp_path / "ab.json"
    stdout, stderr = _plot(capsys, tmp_path, str(_values_sweep(tmp_path / "some", arms)), "--json", str(out))
    assert "warning: k=3 has one run: no interval and no test; repeat it over seeds" in stderr
    assert re.search(r"^k=3 +1 +1.0000 +- +- \(one run\)$", stdout, re.M)
    document = json.loads(out.read_text())
    assert [g["ci95"] is None for g in document["groups"]] == [False, False, True]
    assert document["groups"][2]["std"] is None
    (comparison,) = document["comparisons"]  # k=3 can't be tested
    assert comparison["group"] == {"k": 2} and comparison["baseline"] == {"k": 1}
    assert comparison["diff"] == pytest.approx(0.5) and comparison["p_value"] < 0.01 and "verdict" in comparison
    sweep_dir = _values_sweep(tmp_path / "none", {"a": ({"k": 1}, [1.0]), "b": ({"k": 2}, [1.2])})
    stdout, stderr = _plot(capsys, tmp_path, str(sweep_dir))
    assert "95% CI" not in stdout and "warning" not in stderr
    single, _ = _plot(capsys, tmp_path, str(sweep_dir / "a_1"), "--metric", "best_val_loss")
    assert re.search(r"^all runs +1 +1.0000 ", single, re.M)


def _target_sweep(sweep_dir: Path, arms: dict[str, tuple[bool, dict[int, list[float]], int | None]]) -> Path:
    """Runs as speedrun_cpu writes them, one per seed: {name: (qk_norm, {iter: val loss per seed}, the iteration
    that reached the target or None)}; a run ends at its last evaluation."""
    for name, (qk_norm, evals, target_at) in arms.items():
        for seed in range(len(next(iter(evals.values())))):
            records = [{"iter": it, "train_loss": v[seed], "val_loss": v[seed], "elapsed_s": it / 10,
                        **({"time_to_target_s": it / 10} if it == target_at else {})} for it, v in evals.items()]
            _write_run(sweep_dir / f"{name}_{seed + 1}", {"model": {"qk_norm": qk_norm}, "seed": seed + 1}, records)
    return sweep_dir


def test_arms_of_different_lengths_are_compared_at_the_last_iteration_all_evaluated_and_the_bars_are_the_legends(
    tmp_path: Path, capsys: CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """QK-norm stops at its target at 225; without it the runs go on to 250 and end lower than QK-norm did at 225.
    Each run's last val loss would find no difference; at 225, where both arms were, QK-norm off is worse. The legend's
    ± is the 95 % interval, and so is the bar drawn at 225."""
    drawn = []
    figure = plot.figure
    monkeypatch.setattr(plot, "figure", lambda *args: drawn.append(figure(*args)) or drawn[-1])
    sweep_dir = _target_sweep(tmp_path / "sweep", {"on": (True, {225: [1.870, 1.882]}, 225),
                                                   "off": (False, {225: [1.960, 1.975], 250: [1.860, 1.866]}, None)})
    out, baseline = tmp_path / "ab.json", ["--baseline", "model.qk_norm=true"]
    stdout, stderr = _plot(capsys, tmp_path, str(sweep_dir), *baseline, "--json", str(out))
    assert ("warning: the runs differ in length (225 to 250 iterations; 2 of 4 stopped at their train.target_val_loss"
            "): val_loss is compared at iter 225, the last iteration every run evaluated") in stderr
    assert re.search(r"^group +n +mean val_loss at iter 225 ", stdout, re.M)
    document = json.loads(out.read_text())
    assert document["metric"] == "val_loss" and document["measure"] == "val_loss at iter 225"
    assert [g["values"] for g in document["groups"]] == [[1.870, 1.882], [1.960, 1.975]]
    (comparison,) = document["comparisons"]
    assert comparison["diff"] == pytest.approx(0.0915) and comparison["p_value"] < 0.05
    assert comparison["verdict"].startswith("model.qk_norm=false vs model.qk_norm=true: +0.0915 val_loss at iter 225 [")
    assert ", 2 seeds each: worse" in comparison["verdict"] and comparison["verdict"] in stdout
    last = compare(Group({}, [Path("a"), Path("b")], [1.860, 1.866]), Group({}, [Path("c"), Path("d")], [1.870, 1.882]),
                   "val_loss")
    assert last.p_value > 0.05  # each run's last val loss: no difference detected
    (fig,) = drawn  # the baseline's bar at 225 spans the legend's interval: mean ± t(0.975, 1) sd / sqrt(2)
    half = scipy_stats.t.ppf(0.975, 1) * statistics.stdev([1.870, 1.882]) / math.sqrt(2)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[0] == f"model.qk_norm=true (baseline): n=2, 1.8760 ± {half:.4f}"
    (bar,) = fig.axes[0].containers[0].lines[2][0].get_segments()
    assert bar[:, 0].tolist() == [225, 225] and bar[:, 1].tolist() == pytest.approx([1.876 - half, 1.876 + half])
    stderr = plot_refused(capsys, str(sweep_dir), "--metric", "time_to_target_s")
    assert stderr == (f"error: --metric time_to_target_s: 2 of 4 runs ({sweep_dir / 'off_1'}, ...) never reached a "
                      "train.target_val_loss; leave out --metric to compare val_loss at the last iteration every run "
                      "evaluated\n")
    _, stderr = _plot(capsys, tmp_path, str(sweep_dir), *baseline, "--metric", "best_val_loss")
    assert stderr.startswith("warning: the runs differ in length (225 to 250 iterations; 2 of 4 stopped at their "
                             "train.target_val_loss): each run's best_val_loss comes from its own length; without "
                             "--metric, val_loss is compared at the last iteration every run evaluated\n")
    both = _target_sweep(tmp_path / "both", {"on": (True, {200: [1.90, 1.91], 225: [1.88, 1.885]}, 225),
                                             "off": (False, {200: [1.88, 1.885]}, 200)})
    _, stderr = _plot(capsys, tmp_path, str(both))
    assert ("val_loss is compared at iter 200, the last iteration every run evaluated; all reached their target: "
            "--metric time_to_target_s compares how soon") in stderr
    stdout, stderr = _plot(capsys, tmp_path, str(both), "--metric", "time_to_target_s")
    assert "differ in length" not in stderr and "model.qk_norm=true vs model.qk_norm=false: +2.5 time_to_target_s" in (
        stdout)


@pytest.mark.filterwarnings("error:No artists with labels")  # a legend is drawn only when something has a label
def test_plot_py_draws_identical_replicates_and_groups_sharing_no_evaluation(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """Reruns of one seed are bit-identical on a CPU: three equal values once made a negative error bar."""
    _values_sweep(tmp_path / "same", {"a": ({"k": 1}, [1.6, 1.6, 1.6]), "b": ({"k": 2}, [1.7, 1.7, 1.7])})
    stdout, _ = _plot(capsys, tmp_path, str(tmp_path / "same" / "sweep"))
    assert ("k=2 vs k=1: +0.1 val_loss at iter 5 [+0.1, +0.1], p < 0.0001, 3 seeds each: the runs of each group are "
            "identical") in stdout
    _fake_run(tmp_path / "apart" / "r1", {"k": 1, "seed": 1}, [3.0, 2.0])
    run2 = _fake_run(tmp_path / "apart" / "r2", {"k": 1, "seed": 2}, [3.0, 2.1])
    lines = (run2 / "metrics.jsonl").read_text().replace('"iter": 0,', '"iter": 1,').replace('"iter": 5,', '"iter": 6,')
    (run2 / "metrics.jsonl").write_text(lines)
    stderr = plot_refused(capsys, str(tmp_path / "apart"), "--json", str(tmp_path / "apart.json"))
    assert stderr.startswith("error: --metric val_loss: the runs share no evaluated iteration; evaluate them at ")
    _, stderr = _plot(capsys, tmp_path, str(tmp_path / "apart"), "--metric", "best_val_loss", "--json",
                      str(tmp_path / "apart.json"))
    assert "warning: the runs of all runs share no evaluation's iteration: not drawn" in stderr


def test_plot_py_baseline_pairs_before_the_runs_lists_absent_keys_and_the_recorded_precision(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """`--baseline K=V DIR`: DIR is a run directory; a list matches as its label writes it; a key that older runs
    lack is a value of its own, not null. Runs group on the precision they recorded, not the typed auto."""
    for i, (config, final) in enumerate([({"w": [1, 2]}, 1.0), ({"w": [1, 2]}, 1.1), ({"w": [3]}, 2.0),
                                         ({"w": [3]}, 2.2)]):
        _fake_run(tmp_path / "sweep" / f"r{i}", {**config, "seed": i}, [3.0, final])
    _fake_run(tmp_path / "old" / "r4", {"seed": 4}, [3.0, 2.5])
    stdout, _ = _plot(capsys, tmp_path, "--baseline", "w=[1,2]", str(tmp_path / "sweep"), str(tmp_path / "old"))
    assert re.search(r"^w=\[1,2\] \(baseline\) +2 ", stdout, re.M)
    assert re.search(r"^w=<absent> +1 ", stdout, re.M) and "w=[3] vs w=[1,2]: +1.05 val_loss" in stdout
    for seed, dtype in enumerate(["float32", "float32", "bfloat16", "bfloat16"]):
        settings = {"device": "cpu", "train.dtype": dtype, "train.compile": False, "threads": 2}
        _fake_run(tmp_path / "auto" / str(seed), {"seed": seed, "train": {"dtype": "auto"}}, [3.0, 2 + seed], settings)
    stdout, _ = _plot(capsys, tmp_path, str(tmp_path / "auto"))
    assert re.search(r"^train.dtype=float32 \(baseline\) +2 ", stdout, re.M)
    assert re.search(r"^train.dtype=bfloat16 +2 ", stdout, re.M)
    assert "train.dtype=bfloat16 vs train.dtype=float32: +2 val_loss" in stdout


def _damage(sweep_dir: Path) -> dict[str, str]:
    """One run of each kind of damaged or unreadable file plot.py must skip, and its warning: {run: problem}."""
    problems = {
        "string_loss": ('"val_loss": "2.0"', "metrics.jsonl: the line of iter 5 has val_loss='2.0', not a number"),
        "no_train_loss": ('{"iter": 15, "lr": 1e-3}', "metrics.jsonl: the line of iter 15 has no train_loss"),
        "bad_utf8": (b"k: caf\xe9\n", "config.yaml: not UTF-8 text (byte 6 is 0xe9)"),
        "not_yaml": ("k: [1, 2\n", "config.yaml: not YAML ("),
        "alias_bomb": ("a: &a [1, 1, 1]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n",  # each level 3x: 9 levels, 3.5 GB
                       "config.yaml: not YAML (line 2, column 8: an alias, *a, which train.py never writes)"),
        "too_deep": ("k: " + "[" * 100_000 + "\n", "config.yaml: nested too deep for a config"),
    }
    for seed, (run, (damage, _)) in enumerate(problems.items()):
        path = _fake_run(sweep_dir / run, {"k": 9, "seed": seed}, [3.0, 2.0])
        metrics = path / "metrics.jsonl"
        if run == "string_loss":
            metrics.write_text(metrics.read_text().replace('"val_loss": 2.0', damage))
        elif run == "no_train_loss":
            metrics.write_text(metrics.read_text() + damage + "\n")
        else:
            (path / "config.yaml").write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    (sweep_dir / "fifo").mkdir()  # a read of either would block or never end: within_60_s fails the test instead
    os.mkfifo(sweep_dir / "fifo" / "metrics.jsonl")
    (sweep_dir / "zero").mkdir()
    (sweep_dir / "zero" / "metrics.jsonl").symlink_to("/dev/zero")
    return {run: problem for run, (_, problem) in problems.items()} | {
        "fifo": "metrics.jsonl: a FIFO, not a regular file",
        "zero": "metrics.jsonl: a character device behind a link, not a regular file"}


def _skipped(stderr: str, sweep_dir: Path, problems: dict[str, str]) -> None:
    """One warning per damaged run, naming it and its problem."""
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == len(problems) and "Traceback" not in stderr
    for run, problem in problems.items():
        (line,) = [w for w in warnings if w.startswith(f"warning: {sweep_dir / run}/")]
        assert problem in line and line.endswith("; run skipped"), line


@pytest.fixture
def within_60_s() -> Iterator[None]:
    """A read that blocks (a FIFO) in this process fails the test after 60 s, rather than hang the suite."""

    def ring(signum: int, frame: object) -> None:
        raise TimeoutError("plot.py still running after 60 s: a read blocked")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_plot_py_skips_each_damaged_run_with_one_warning_and_refuses_when_all_are(
    tmp_path: Path, capsys: CaptureFixture[str], within_60_s: None
) -> None:
    problems = _damage(tmp_path / "bad")
    good = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1])})
    stdout, stderr = plot_ok(capsys, str(good), str(tmp_path / "bad"))
    _skipped(stderr, tmp_path / "bad", problems)
    table = stdout.split("\n\n")[0]
    assert str(good / "a_1") in table and str(good / "a_2") in table and str(tmp_path / "bad") not in table
    assert (tmp_path / "loss.png").is_file()
    (line,) = plot_refused(capsys, str(tmp_path / "bad")).splitlines()
    assert line.startswith(f"error: all {len(problems)} runs are damaged, the first: {tmp_path / 'bad'}/")
    fifo = tmp_path / "bad" / "fifo"
    alone = plot_refused(capsys, str(fifo))
    assert alone == f"error: {fifo / 'metrics.jsonl'}: a FIFO, not a regular file; nothing left to plot\n"


def test_plot_py_replaces_links_at_its_outputs_and_refuses_fifos_there(
    tmp_path: Path, capsys: CaptureFixture[str], within_60_s: None
) -> None:
    """A link at -o or --json is replaced by the new file, the file it pointed to left as it was; a FIFO there is
    refused before anything opens it."""
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1]), "b": ({"k": 2}, [1.5, 1.6])})
    kept = tmp_path / "kept.txt"
    kept.write_text("someone's file\n")
    picture, document = tmp_path / "loss.png", tmp_path / "ab.json"
    picture.symlink_to(kept)
    document.symlink_to(kept)
    plot_ok(capsys, str(sweep_dir / "a_1"), str(sweep_dir / "b_1"), "-o", str(picture), "--json", str(document))
    assert kept.read_text() == "someone's file\n"
    assert not picture.is_symlink() and picture.read_bytes().startswith(b"\x89PNG")
    assert not document.is_symlink() and json.loads(document.read_text())["metric"] == "val_loss"
    fifo, pipe = tmp_path / "fifo.png", tmp_path / "pipe"  # pipe: as /dev/null, once written as /dev/null.png
    os.mkfifo(fifo)
    os.mkfifo(pipe)
    for args in (["-o", str(fifo)], ["-o", str(picture), "--json", str(fifo)], ["-o", str(pipe)]):
        stderr = plot_refused(capsys, str(sweep_dir / "a_1"), *args)
        assert stderr == f"error: {args[-2]} {args[-1]}: not a regular file (a FIFO, a device); name a file\n"
    assert not pipe.with_suffix(".png").exists()


def test_plot_py_writes_its_picture_into_the_sweep_folder_titled_with_groups_and_runs(
    tmp_path: Path, capsys: CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not into the current directory; the title counts groups and runs; the legend says what ± is and what the bars
    and bands are; the groups' y label, the longest, stays inside the picture (it once ran past its top and bottom)."""
    from PIL import Image

    drawn = []
    figure = plot.figure
    monkeypatch.setattr(plot, "figure", lambda *args: drawn.append(figure(*args)) or drawn[-1])
    sweep_dir = _values_sweep(tmp_path, {"a": ({"k": 1}, [1.0, 1.1, 1.2]), "b": ({"k": 2}, [1.5, 1.6, 1.7])})
    monkeypatch.chdir(tmp_path / "sweep" / "a_1")
    _, stderr = plot_ok(capsys, str(sweep_dir))
    assert stderr.strip().endswith(f"wrote {sweep_dir / 'loss.png'}") and not (sweep_dir / "a_1" / "loss.png").exists()
    with Image.open(sweep_dir / "loss.png") as image:
        text = image.text
    assert text["Title"] == "2 groups, 6 runs in all: loss against iter"
    legend = text["Description"].splitlines()
    assert legend[:2] == ["each group: n runs, val_loss at iter 5: mean ± 95% CI half-width",
                          "bars: each evaluation's 95% CI of the mean; bands: the runs' min-max"]
    assert legend[2].startswith("k=1 (baseline): n=3, 1.1000 ± ")  # the interval itself: the different-lengths test
    (fig,) = drawn
    fig.draw_without_rendering()  # the layout, as savefig ran it
    label, inside = fig.axes[0].yaxis.label.get_window_extent(), fig.bbox
    assert "each group's mean" in fig.axes[0].get_ylabel()
    assert inside.x0 <= label.x0 and label.x1 <= inside.x1 and inside.y0 <= label.y0 and label.y1 <= inside.y1
    _, two = plot_ok(capsys, str(sweep_dir / "a_1"), str(sweep_dir / "b_1"))  # several: the folder holding them
    assert two.strip().endswith(f"wrote {sweep_dir / 'loss.png'}")


def test_plot_py_leaves_out_a_metrics_line_nested_too_deep_and_a_run_without_config_yaml_joins_no_group(
    tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    """100,000 brackets are past Python's recursion limit for json.loads: one damaged line, not a traceback. What a
    run without config.yaml trained is unknown: its row names no key (the others, only keys that differ between runs
    that have them) and it is no replicate of anything."""
    many = {f"model.key{i}": i for i in range(50)}
    sweep_dir = _values_sweep(tmp_path, {"a": (many, [1.0, 1.1, 1.2])})
    (sweep_dir / "a_3" / "config.yaml").unlink()
    with (sweep_dir / "a_3" / "metrics.jsonl").open("a") as f:
        f.write("[" * 100_000 + "\n")
    stdout, stderr = _plot(capsys, tmp_path, str(sweep_dir))
    table, groups = stdout.split("\n\n")
    assert "None" not in stdout and "<absent>" not in stdout and "model.key" not in stdout
    assert [line.split()[:3] for line in table.splitlines()[1:]] == [
        [str(sweep_dir / "a_1"), "seed=1", "1.0000"], [str(sweep_dir / "a_2"), "seed=2", "1.1000"],
        [str(sweep_dir / "a_3"), "a_3", "1.2000"]]
    assert stderr.splitlines()[:2] == [f"warning: {sweep_dir / 'a_3' / 'metrics.jsonl'}: left out 1 damaged line(s)",
                                       f"warning: 1 run(s) without config.yaml ({sweep_dir / 'a_3'}): left out of "
                                       "the groups"]
    assert re.search(r"^all runs +2 +1.0500 ", groups, re.M)
