"""Sweeps with Hydra's basic sweeper, and plot.py comparing their runs."""

import json
import subprocess
from pathlib import Path

import hydra._internal.logging_config
import matplotlib
import matplotlib.image
import matplotlib.pyplot as plt
import pytest
from omegaconf import OmegaConf

import plot
from conftest import refused, run_in_process

TINY = ["model.n_embd=32", "model.n_head=2", "model.block_size=32", "train.batch_size=8", "train.max_iters=10",
        "train.eval_interval=5", "train.eval_iters=2", "train.log_interval=5"]


def sweep(tmp_path: Path, corpus: Path, *params: str) -> subprocess.CompletedProcess:
    """`python train.py -m ...` in this process, its jobs one after another, without Hydra's logging set-up."""
    where = [f"data.input={corpus}", f"data.dir={tmp_path / 'data'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    args = ["-m", *TINY, *where, *params]  # params last, so they win over TINY's
    with pytest.MonkeyPatch.context() as patch:  # what every configure_log of Hydra's calls to set logging up
        patch.setattr(hydra._internal.logging_config, "configure_logging", lambda config: None)
        return run_in_process("train.py", args, cwd=tmp_path)


def plot_ok(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    """`python plot.py ARGS` in this process: its stdout and stderr."""
    capsys.readouterr()
    plot.main(list(args))
    assert matplotlib.get_backend().lower() == "agg" and not plt.get_fignums()  # no window, no figure left open
    return capsys.readouterr()


def plot_refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`python plot.py ARGS` in this process, refused with status 2: its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        plot.main(list(args))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    return err


@pytest.fixture(scope="module")
def two_run_sweep(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Path:
    """configs/experiment/lr_sweep.yaml's grid: a sweep written in a config, at two learning rates."""
    tmp = tmp_path_factory.mktemp("sweep")
    result = sweep(tmp, corpus_path, "experiment=lr_sweep", "device=cpu")
    assert result.returncode == 0, result.stderr
    return tmp / "sweep"


def test_a_value_out_of_range_stops_a_sweep_before_its_first_job_and_a_failing_job_is_named_and_fails_it(
    tmp_path: Path, corpus_path: Path
) -> None:
    """Keys that fail together (a head count that doesn't divide the width) show in the job that combines them."""
    result = sweep(tmp_path, corpus_path, "model.n_layer=1,0")
    assert refused(result) == "error: model.n_layer=0 must be >= 1"
    assert not (tmp_path / "sweep").exists()
    result = sweep(tmp_path, corpus_path, "model.n_head=2,3")
    assert result.returncode == 2
    assert result.stderr.startswith("error: job 1 (model.n_embd=32 model.n_head=3 ")
    assert "model.n_embd=32 is not divisible by n_head=3" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "sweep" / "0" / "ckpt.pt").is_file()


@pytest.mark.parametrize("x_axis", ["iter", "time", "tokens"])
def test_a_sweep_writes_one_complete_run_per_job_and_plot_py_draws_it_with_a_summary(
    two_run_sweep: Path, tmp_path: Path, x_axis: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not (two_run_sweep.parent / "outputs").exists()
    out = tmp_path / "loss.png"
    stdout, _ = plot_ok(capsys, str(two_run_sweep), "-o", str(out), "--x", x_axis)
    header, *rows = stdout.strip().splitlines()
    assert header.split()[:3] == ["run", "differing", "keys"] and len(rows) == 2
    assert "train.learning_rate=0.001" in rows[0] and "train.learning_rate=0.003" in rows[1]
    for row, job, rate in zip(rows, ("0", "1"), (1e-3, 3e-3), strict=True):
        run = two_run_sweep / job
        assert (run / "ckpt.pt").is_file() and OmegaConf.load(run / "config.yaml").train.learning_rate == rate
        evals = [record for record in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                 if "val_loss" in record]
        assert [r["iter"] for r in evals] == [0, 5, 10]
        assert f"{min(r['val_loss'] for r in evals):.4f}" in row and " 10 " in row
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 500


def test_plot_py_names_the_file_it_writes_and_refuses_what_it_cant(
    two_run_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """-o without an extension gets .png, and says so; an unknown extension, a directory, a missing directory or a
    folder with no run is one line and status 2, before any work."""
    _, stderr = plot_ok(capsys, str(two_run_sweep), "-o", str(tmp_path / "curves"))
    assert stderr.strip().endswith(f"wrote {tmp_path / 'curves.png'}") and (tmp_path / "curves.png").is_file()
    for runs, out, message in [
        (two_run_sweep, tmp_path / "curves.xyz", "can't write .xyz pictures; use one of"),
        (two_run_sweep, tmp_path, "is a directory; name a file such as"),
        (two_run_sweep, tmp_path / "missing" / "loss.png", "no directory"),
        (tmp_path, tmp_path / "loss.png", "error: no metrics.jsonl in or under"),
    ]:
        stderr = plot_refused(capsys, str(runs), "-o", str(out))
        assert message in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


def test_plot_py_tells_repeats_apart_wraps_long_keys_and_reports_wall_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs of one config once shared a label; a sweep over many keys made the table wider than a screen; a NaN
    evaluation was taken for the best."""
    long_keys = {f"key_number_{i}": i for i in range(12)}
    repeat = {"seed": 1, **dict.fromkeys(long_keys, -1)}
    for name, config in (("seed_a", repeat), ("seed_b", repeat), ("wide", {"seed": 2, **long_keys})):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
        records = [
            {"iter": 0, "train_loss": 4.0, "val_loss": float("nan"), "elapsed_s": 1.0},
            {"iter": 5, "train_loss": 3.0, "lr": 1e-3, "elapsed_s": 2.0, "tokens_per_sec": 100.0},
            {"iter": 10, "train_loss": 2.5, "val_loss": 2.75, "elapsed_s": 12.5},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    stdout, _ = plot_ok(capsys, str(tmp_path), "-o", str(tmp_path / "loss.png"))
    runs_table, statistics = stdout.split("\n\n", 1)  # seed_a and seed_b: a group of two, tested after
    header, *rows = runs_table.splitlines()
    assert header.split()[-2:] == ["wall", "time"]
    assert statistics.splitlines()[0].split()[:2] == ["group", "n"]
    labelled = {row.split()[0]: row for row in rows if row.strip() and not row.startswith(" ")}
    assert set(labelled) == {str(tmp_path / n) for n in ("seed_a", "seed_b", "wide")}
    assert "seed_a: key_number_0=-1" in labelled[str(tmp_path / "seed_a")]  # distinct from seed_b's
    assert "seed_b: key_number_0=-1" in labelled[str(tmp_path / "seed_b")]
    assert all("2.7500" in row and row.rstrip().endswith("12.5 s") for row in labelled.values())
    assert len(rows) > 3 and max(len(row) for row in rows) < 200  # the wide one wrapped onto more lines
