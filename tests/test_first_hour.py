"""A newcomer's traps: resume continues the run it names, the schedule follows max_iters, prepared data is reused
offline."""

from __future__ import annotations

import json
import logging
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from common.cli import check_overrides
from common.config import run_hydra, typed_config
from common.errors import ConfigError, DataError
from conftest import (
    CONFIGS,
    compose_config,
    run_in_process,
    start_script,
    tiny_run_overrides,
    train_py,
    user_error,
    wait_for_text,
)
from data.prepare import KNOWN_TEXTS, DataConfig, ensure_prepared
from inference.sampling import SampleConfig
from model.gpt import CKPT_NAME, load_checkpoint
from training.resume import resume_argument, resumed_config
from training.run import train
from training.schema import CONFIG_GROUPS, TrainRunConfig
from training.trainer import scheduled_lr

UNREACHABLE = "http://127.0.0.1:9/input.txt"  # the discard port: a download fails at once, offline or not
# A run's settings that differ from the schema's defaults, as a preset's would: a resume must keep every one.
STARTED_WITH = {
    "train.max_iters": 60,
    "train.eval_interval": 20,
    "train.warmup_iters": 5,
    "train.learning_rate": 2e-3,
    "seed": 7,
}


def _evals(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["iter"] for r in map(json.loads, lines) if "val_loss" in r]


def _interrupted_run(tmp_path: Path, corpus: Path) -> str:
    """train.py stopped by SIGTERM after its first evaluation: promptly, with the shell's status for it and a
    checkpoint; returns the resume command it printed."""
    args = tiny_run_overrides(tmp_path, corpus, **STARTED_WITH, **{"train.log_interval": 1})
    process = start_script("train.py", args, tmp_path)
    wait_for_text(tmp_path / "run" / "metrics.jsonl", '"val_loss"')
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert time.monotonic() - signalled < 30
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stdout
    line = next(line for line in stdout.splitlines() if "Resume with: " in line)
    return line.partition("Resume with: ")[2]


def test_the_printed_resume_command_continues_the_run_with_its_own_settings(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's trap: resuming without repeating the overrides took the schema's defaults (max_iters 2000,
    another eval_interval) and trained on. Now the printed command alone finishes the run as it was started. (Also
    the one test of SIGTERM to the script: it stops promptly, and the run resumes, in the same metrics.jsonl.)"""
    command = _interrupted_run(tmp_path, corpus_path)
    run = tmp_path / "run"
    assert command == f"python train.py out_dir={run} resume=true"
    stopped_at = load_checkpoint(run / CKPT_NAME).progress.iter
    assert 0 < stopped_at < 60

    program, script, *args = shlex.split(command)
    assert (program, script) == ("python", "train.py")
    with caplog.at_level(logging.INFO, logger="train"):
        result = run_in_process("train.py", args, tmp_path)  # in this process: its log lines reach caplog
    assert result.returncode == 0, result.stderr
    assert f"resuming {run} at iter {stopped_at}" in caplog.text and "changed from" not in caplog.text
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 60  # not the schema's 2000
    assert _evals(run)[-1] == 60 and all(i % 20 == 0 for i in _evals(run)[:-1])
    resumed = OmegaConf.load(run / "config.yaml")
    for key, value in STARTED_WITH.items():
        assert OmegaConf.select(resumed, key) == value, key
    assert resumed.model.n_embd == 32 and resumed.data.input == str(corpus_path)


def _resume(args: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """train.py's resume, in this process: the saved config with the command's overrides, then the run."""
    with caplog.at_level(logging.INFO, logger="train"):
        caplog.clear()
        train(resumed_config(compose_config(args), args, TrainRunConfig))
    return caplog.text


def test_a_resume_refuses_changes_to_what_the_run_trains_unless_asked(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    start = tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 10})
    train_py(start)  # its .hydra/ records the groups it took
    run = tmp_path / "run"
    before = (run / CKPT_NAME).read_bytes()

    refused = run_in_process("train.py", [f"out_dir={run}", "resume=true", "train.max_iters=20"], tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == (
        "error: resume=true would change what the run trains (train.max_iters 10 -> 20); drop those overrides to "
        "continue the run as it was, or add resume_with_changes=true to resume with them"
    )
    with pytest.raises(
        ConfigError,
        match="^experiment=speedrun_cpu: resume=true continues .* it was started with "
        "experiment=null; drop experiment=speedrun_cpu",
    ):
        _resume([f"out_dir={run}", "resume=true", "experiment=speedrun_cpu"], caplog)
    assert (run / CKPT_NAME).read_bytes() == before

    # The start command repeated (its group, its keys) is no change; a free key (eval_iters) may change.
    assert "resume: train.eval_iters changed from 4 to 3" in _resume(
        [*start, "model=baby", "resume=true", "train.eval_iters=3"], caplog
    )
    asked = _resume([f"out_dir={run}", "resume=true", "resume_with_changes=true", "train.max_iters=20"], caplog)
    assert "resume: train.max_iters changed from 10 to 20" in asked
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 20
    with pytest.raises(ConfigError, match=r"\(train.max_iters 20 -> 30\)"):  # asked once is not asked for good
        _resume([f"out_dir={run}", "resume=true", "train.max_iters=30"], caplog)
    charted = _resume([f"out_dir={run}", "resume=true", "wandb.project=elsewhere", "train.log_interval=2"], caplog)
    assert "resume: wandb.project changed from gpt to elsewhere" in charted  # where it is charted: free

    # Below the iterations taken: was resumed, rewriting config.yaml and adding its start-up to the elapsed time.
    files = {name: (run / name).read_bytes() for name in (CKPT_NAME, "config.yaml", "metrics.jsonl")}
    below = user_error(
        capsys, lambda: train_py([f"out_dir={run}", "resume=true", "resume_with_changes=true", "train.max_iters=15"])
    )
    assert below.strip() == (
        "error: train.max_iters=15 is below the 20 iterations the run already took; resume with train.max_iters=20 "
        "or more, or sample and evaluate the run as it is"
    )
    assert files == {name: (run / name).read_bytes() for name in files}


@pytest.mark.parametrize(
    "path",
    [
        "runs/cpu",
        "/tmp/a b/run",
        "runs/a,b",
        "runs/it's",
        "runs/[x]=y",
        "C:\\Users\\me\\run",
        "runs/x\\",
        "runs/$HOME",
        'runs/q"uote',
        "runs/café",  # Hydra's bare values are ASCII
        "runs/~x",
        "~x",
        "1e5",  # bare, these would read back as a number, a bool, null
        "true",
        "null",
        "1_000",
        "-5",
        "nan",
    ],
)
def test_the_printed_resume_command_names_any_out_dir_as_the_shell_and_hydra_read_it(path: str) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    words = shlex.split(resume_argument(Path(path)))
    assert len(words) == 1
    assert OverridesParser.create().parse_overrides(words)[0].value() == str(Path(path))


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")))
def test_the_schedule_follows_max_iters_in_every_preset(preset: str) -> None:
    """experiment=shakespeare_char_cpu train.max_iters=500 ended at lr 9.06e-4, not min_lr: presets fixed
    lr_decay_iters at their own max_iters."""
    iters = compose_config([f"experiment={preset}"]).train.warmup_iters + 500
    config = typed_config(compose_config([f"experiment={preset}", f"train.max_iters={iters}"]), TrainRunConfig)
    train = config.train
    assert train.decay_iters == iters
    assert scheduled_lr(train, iters - 1) == pytest.approx(train.min_lr, rel=0.01, abs=1e-7)


def test_prepared_data_is_used_offline_without_data_input(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prepared once with data.input, then every later command (a preset, a resume, a sweep) without it: the
    prepared files are used and no download is tried; with nothing prepared the download is tried, and fails."""
    data_dir = tmp_path / "data"
    made = ensure_prepared(DataConfig(input=str(corpus_path), url=UNREACHABLE, dir=str(data_dir)))
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        again = ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(data_dir)))
    assert again.meta == made.meta
    assert f"data: {data_dir} holds the text of {corpus_path}, not {UNREACHABLE}; training on it" in caplog.text
    caplog.clear()
    with monkeypatch.context() as known:
        known.setitem(KNOWN_TEXTS, UNREACHABLE, made.meta["source"]["input_sha256"])  # a copy of the URL's text
        with caplog.at_level(logging.INFO, logger="data.prepare"):
            ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(data_dir)))
    assert caplog.records[-1].levelname == "INFO"
    assert caplog.messages[-1] == f"data: using {data_dir}, prepared from {corpus_path}, a copy of {UNREACHABLE}"

    with pytest.raises(DataError, match="val_fraction=0.1, not .* val_fraction=0.2 as asked"):  # another split
        ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(data_dir), val_fraction=0.2))
    with pytest.raises(Exception, match=f"could not download {UNREACHABLE}"):
        ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(tmp_path / "empty")))

    overrides = [
        f"out_dir={tmp_path / 'run'}",
        "device=cpu",
        f"data.dir={data_dir}",
        f"data.url={UNREACHABLE}",
        "train.max_iters=2",
        "train.eval_iters=2",
        "model.n_layer=1",
        "model.n_embd=32",
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train_py(overrides)
    assert (tmp_path / "run" / CKPT_NAME).exists()
    assert f"prepared from {corpus_path}, a copy of {UNREACHABLE}" not in caplog.text  # KNOWN_TEXTS as shipped: warned
    assert f"holds the text of {corpus_path}" in caplog.text


def test_a_failed_first_preparation_leaves_no_data_folder_behind(tmp_path: Path) -> None:
    """Offline, the first start fails: neither the data folder nor the new folder it was prepared in stays. A folder
    that was there stays, as it was."""
    with pytest.raises(Exception, match=f"could not download {UNREACHABLE}"):
        ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(tmp_path / "made" / "by" / "us")))
    assert list((tmp_path / "made" / "by").iterdir()) == []

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    with pytest.raises(Exception, match=f"could not download {UNREACHABLE}"):
        ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(theirs / "data")))
    assert list(theirs.iterdir()) == []
    with pytest.raises(Exception, match=f"could not download {UNREACHABLE}"):
        ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(theirs)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made", "theirs"] and list(theirs.iterdir()) == []


def test_train_py_with_no_settings_says_what_it_runs(tmp_path: Path) -> None:
    """`python train.py` alone is a real run (the baby GPT, 2,000 iterations): its first line says so and where."""
    process = start_script("train.py", [], cwd=tmp_path)
    try:
        first = process.stdout.readline()
    finally:
        process.send_signal(signal.SIGINT)  # before it downloads or trains anything to speak of
        process.communicate(timeout=120)
    assert first.startswith("no settings given: configs/config.yaml's defaults, model=baby on data=shakespeare_char")
    assert "for 2,000 iterations into out_dir outputs/" in first and "python train.py --help" in first



def test_data_prepared_from_a_file_since_moved_stands_for_it(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A resume restores data.input from the run's config; a moved text no longer stops it."""
    text = tmp_path / "text.txt"
    text.write_bytes(corpus_path.read_bytes())
    made = ensure_prepared(DataConfig(input=str(text), dir=str(tmp_path / "data")))
    text.unlink()
    with caplog.at_level(logging.WARNING, logger="data.prepare"):
        assert ensure_prepared(DataConfig(input=str(text), dir=str(tmp_path / "data"))).meta == made.meta
    assert caplog.messages == [f"data.input={text} is gone; using the data prepared from it in {tmp_path / 'data'}"]
    with pytest.raises(Exception, match="does not exist"):  # prepared from another path: no stand-in
        ensure_prepared(DataConfig(input=str(tmp_path / "other.txt"), dir=str(tmp_path / "data")))


def _one_line_error(capsys: pytest.CaptureFixture, call) -> str:
    with pytest.raises(SystemExit) as stopped:
        call()
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["experiment=shakespeare_char_cp"],
            "error: experiment=shakespeare_char_cp is unknown; did you mean "
            "experiment=shakespeare_char_cpu? (the choices: finetune_shakespeare, ",
        ),
        (["model=small"], "error: model=small is unknown (the choices: baby, gpt2, shakespeare)"),
        (["-m", "experiment=speedrun_cpu,speedrun_cp"], "error: experiment=speedrun_cp is unknown; did you mean"),
    ],
)
def test_a_misspelt_preset_is_one_line_naming_the_choices(
    capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    assert _one_line_error(capsys, lambda: check_overrides(args, TrainRunConfig, CONFIG_GROUPS)).startswith(message)


def test_sample_takes_no_presets(capsys: pytest.CaptureFixture) -> None:
    assert "experiment is not a key" in _one_line_error(
        capsys, lambda: check_overrides(["experiment=speedrun_cpu"], SampleConfig)
    )


def test_help_lists_the_keys_set_most_with_examples(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import eval as eval_script
    import sample
    import serve
    import train as train_script

    monkeypatch.chdir(tmp_path)
    texts = {}
    for script, module, schema, groups in (
        ("train.py", train_script, TrainRunConfig, CONFIG_GROUPS),
        ("sample.py", sample, object, ()),
        ("eval.py", eval_script, object, ()),
        ("serve.py", serve, object, ()),
    ):
        monkeypatch.setattr(sys, "argv", [script, "--help"])
        with pytest.raises(SystemExit) as stopped:  # as the script's __main__
            run_hydra(lambda: pytest.fail("Hydra started"), schema, groups, usage=module.usage)
        assert stopped.value.code == 0
        texts[script] = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing made
    for script, text in texts.items():
        assert "Keys set most:" in text and "Examples:" in text and "docs/reference.md" in text
        examples = [line.strip() for line in text.splitlines() if line.strip().startswith(f"python {script}")]
        assert len(examples) >= 2, script
        assert ("experiment " in text) == (script == "train.py")  # only train.py takes presets


def test_a_command_that_fails_before_training_leaves_nothing_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo'd input once left outputs/DATE/TIME/{train.log,.lock}; a resume of a misspelt run, its directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()  # the user's own empty folder, and a run directory's neighbour
    (tmp_path / "outputs" / "older").mkdir(parents=True)
    for args in (
        ["data.input=missing.txt"],  # the default outputs/DATE/TIME
        ["out_dir=runs/typo/one", "resume=true"],  # two folders made for it
        ["out_dir=mine", "resume=true"],  # there before: only what the command added goes
    ):
        user_error(capsys, lambda args=args: train_py(args))
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["mine", "outputs", "outputs/older"]


def test_a_failed_start_touches_nothing_whatever_the_path_said(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """out_dir=runs/x/new/../old, with a mistake: the run directory is made only once every check has passed, so
    the user's runs/x/old (holding a train.log of theirs) stays as it was, and no runs/x/new appears."""
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "runs" / "x" / "old"
    old.mkdir(parents=True)
    (old / "train.log").write_text("the user's own\n")
    user_error(capsys, lambda: train_py(["out_dir=runs/x/new/../old", "data.input=/missing.txt"]))
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["runs", "runs/x", "runs/x/old", "runs/x/old/train.log"]
    assert (old / "train.log").read_text() == "the user's own\n"


def test_resuming_a_finished_run_says_so_and_writes_nothing(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It appended a settings line and added its start-up time to the run's. The first evaluation is announced: on
    a busy machine it is a long wait before the first log line."""
    start = tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 10})
    with caplog.at_level(logging.INFO, logger="train"):
        train(compose_config(start))
    assert "evaluating at iter 0: 4 batches of train, 4 batches of val" in caplog.text
    run = tmp_path / "run"
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    args = [f"out_dir={run}", "resume=true"]
    log = _resume(args, caplog)
    assert f"out_dir={run} is finished: 10 iters" in log and "nothing written" in log
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


def test_a_resume_with_other_threads_than_the_runs_says_so(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After Ctrl-C in one shell and a resume in another, the threads differed silently: they change the float sums'
    order, and plot.py groups runs by them."""
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 10})))
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    settings = json.loads(lines[0])
    threads = settings["settings"]["threads"]
    settings["settings"]["threads"] = threads + 1  # as another shell's OMP_NUM_THREADS would have it
    metrics.write_text("\n".join([json.dumps(settings), *lines[1:]]) + "\n")
    log = _resume([f"out_dir={tmp_path / 'run'}", "resume=true", "train.max_iters=12", "resume_with_changes=true"],
                  caplog)
    assert f"resume: threads {threads + 1} -> {threads} since the run last started" in log


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full, a disk that is always full, is Linux's")
def test_a_train_log_the_disk_cannot_take_costs_no_traceback(
    tmp_path: Path, corpus_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk the log handler's own errors (97 lines, 3 tracebacks) hid the one line saying why."""
    import training.run

    monkeypatch.setattr(training.run, "open_for_appending", lambda path: open("/dev/full", "a", encoding="utf-8"))
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})))
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err
