"""A newcomer's traps: resume continues the run it names, the schedule follows max_iters, prepared data is reused
offline."""

from __future__ import annotations

import json
import logging
import re
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from common.config import typed_config
from common.files import CKPT_NAME
from conftest import CONFIGS, REPO, compose_config, run_in_process, start_script, tiny_run_overrides, wait_for_text
from data.prepare import KNOWN_TEXTS, DataConfig, ensure_prepared
from model.checkpoint import load_checkpoint
from train import TrainRunConfig, train
from training.resume import resume_argument
from training.trainer import lr_at

UNREACHABLE = "http://127.0.0.1:9/input.txt"  # the discard port: a download fails at once, offline or not
# A run's settings that differ from the schema's defaults, as a preset's would: a resume must keep every one.
STARTED_WITH = {"train.max_iters": 60, "train.eval_interval": 20, "train.warmup_iters": 5, "train.learning_rate": 2e-3,
                "seed": 7, "train.log_interval": 1}


def test_the_printed_resume_command_continues_the_run_with_its_own_settings(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM stops train.py promptly, with the shell's status and a checkpoint; the command it prints alone finishes
    the run as it was started (not with the schema's defaults), in the same metrics.jsonl."""
    run = tmp_path / "run"
    process = start_script("train.py", tiny_run_overrides(tmp_path, corpus_path, **STARTED_WITH), tmp_path)
    wait_for_text(run / "metrics.jsonl", '"val_loss"')  # after its first evaluation
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert time.monotonic() - signalled < 30
    assert process.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in stdout, stderr
    command = next(line for line in stdout.splitlines() if "Resume with: " in line).partition("Resume with: ")[2]
    assert command == f"python train.py out_dir={run} resume=true"
    stopped_at = load_checkpoint(run / CKPT_NAME).progress.iter
    assert 0 < stopped_at < 60

    with caplog.at_level(logging.INFO, logger="train"):
        result = run_in_process("train.py", shlex.split(command)[2:], tmp_path)  # in this process: logs reach caplog
    assert result.returncode == 0, result.stderr
    assert f"resuming {run} at iter {stopped_at}" in caplog.text and "changed from" not in caplog.text
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 60  # not the schema's 2000
    evals = [r["iter"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert evals[-1] == 60 and all(i % 20 == 0 for i in evals[:-1])
    resumed = OmegaConf.load(run / "config.yaml")
    for key, value in STARTED_WITH.items():
        assert OmegaConf.select(resumed, key) == value, key
    assert resumed.model.n_embd == 32 and resumed.data.input == str(corpus_path)


def _train_py(args: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """train.py in this process: its log lines, or the one line of its refusal."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train"):
        result = run_in_process("train.py", args, Path.cwd())
    assert "Traceback" not in result.stderr and result.returncode in (0, 2), result.stderr
    return caplog.text if result.returncode == 0 else result.stderr


def test_a_resume_refuses_changes_to_what_the_run_trains_unless_asked_and_says_what_else_changed(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished run's resume writes nothing and lets go of a killed writer's temporary (a checkpoint's size: it
    stayed until a resume that trained); other threads than the run's are said (they change the float sums' order,
    and plot.py groups runs by them). The first evaluation is announced: it may be a long wait."""
    start = tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 10})  # warmup_iters=2
    log = _train_py(start, caplog)  # nor is it told of a decay it has, or of a long wait for its first log line
    assert "evaluating at iter 0: 4 batches of train, 4 batches of val" in log and "never decays" not in log
    assert "the first log line is at least" not in log
    run = tmp_path / "run"
    resume = [f"out_dir={run}", "resume=true"]

    def files() -> dict[Path, bytes]:
        return {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}

    before = files()
    assert _train_py([*resume, "train.max_iters=20"], caplog) == (
        "error: resume=true would change what the run trains (train.max_iters 10 -> 20); drop those overrides to "
        "continue the run as it was, or add resume_with_changes=true to resume with them\n"
    )
    assert re.match(
        "error: experiment=speedrun_cpu: resume=true continues .* it was started with experiment=null; "
        "drop experiment=speedrun_cpu",
        _train_py([*resume, "experiment=speedrun_cpu"], caplog),
    )
    assert files() == before

    # The start command repeated (its group, its keys) is no change; a free key (eval_iters) may change.
    log = _train_py([*start, "model=baby", "resume=true", "train.eval_iters=3"], caplog)
    assert "resume: train.eval_iters changed from 4 to 3" in log
    asked = _train_py([*resume, "resume_with_changes=true", "train.max_iters=20"], caplog)
    assert "resume: train.max_iters changed from 10 to 20" in asked
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 20
    assert "(train.max_iters 20 -> 30)" in _train_py([*resume, "train.max_iters=30"], caplog)  # asked once only
    charted = _train_py([*resume, "wandb.project=elsewhere", "train.log_interval=2"], caplog)
    assert "resume: wandb.project changed from gpt to elsewhere" in charted  # where it is charted: free

    before = files()
    assert _train_py([*resume, "resume_with_changes=true", "train.max_iters=15"], caplog) == (
        "error: train.max_iters=15 is below the 20 iterations the run already took; resume with train.max_iters=20 "
        "or more, or sample and evaluate the run as it is\n"
    )
    (run / "ckpt.pt.tmp").write_bytes(b"what a killed writer left")
    finished = _train_py(resume, caplog)
    assert f"out_dir={run} is finished: 20 iters" in finished and "nothing written" in finished
    assert files() == before

    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # as another shell's OMP_NUM_THREADS would have it (put back after the test)
    log = _train_py([*resume, "train.max_iters=22", "resume_with_changes=true"], caplog)
    assert f"resume: threads {threads} -> {threads + 1} since the run last started" in log


@pytest.mark.parametrize(
    "path",
    # Hydra's bare values are ASCII; bare, 1e5, true, null, ... would read back as a number, a bool, null
    ["runs/cpu", "/tmp/a b/run", "runs/a,b", "runs/it's", "runs/[x]=y", "C:\\Users\\me\\run", "runs/x\\", "runs/$HOME",
     'runs/q"uote', "runs/café", "runs/~x", "~x", "1e5", "true", "null", "1_000", "-5", "nan"],
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
    t = typed_config(compose_config([f"experiment={preset}", f"train.max_iters={iters}"]), TrainRunConfig).train
    assert t.decay_iters == iters
    last = lr_at(iters - 1, t.learning_rate, t.min_lr, t.warmup_iters, t.decay_iters, t.lr_schedule, t.cooldown_frac)
    assert last == pytest.approx(t.min_lr, rel=0.01, abs=1e-7)


def test_a_first_log_line_far_off_on_this_cpu_and_a_schedule_that_never_decays_are_said_before_the_first_step(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU's preset on a CPU sat silent for minutes, a context of 100,000 tokens for hours, and Ctrl-C waited for
    the torch op under way. Now a warning at start, when even the CPU's matmul rate (given here, not timed) puts the
    first log line over 30 s away; and another for a run shorter than its warmup."""
    monkeypatch.setattr("train.cpu_matmul_flops", lambda threads: 1e9)
    keys = {"train.grad_accum": 1024, "train.eval_from": 100,  # 5 steps to the first log line, no evaluation first
            "train.max_iters": 10, "train.warmup_iters": 20}

    class Stopped(Exception):
        """Raised before the first step: what was said at start is what matters."""

    def stop(it: int) -> None:
        raise Stopped

    with caplog.at_level(logging.INFO, logger="train"), pytest.raises(Stopped):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)), before_step=stop)
    assert ("train.max_iters=10 <= train.warmup_iters=20: the learning rate only warms up, never decays; lower "
            "train.warmup_iters (say 1) or raise train.max_iters") in caplog.messages
    warned = [m for m in caplog.messages if m.startswith("the first log line is at least")]
    assert len(warned) == 1 and re.fullmatch(
        r"the first log line is at least \d+m\d\ds away: 5 steps need \d\.\de\+11 FLOPs, at this CPU's \d GFLOP/s of "
        r"matmuls; lower model.block_size, train.batch_size or train.eval_iters, or use a CPU preset or a GPU "
        r"\(Ctrl-C waits for the torch op under way\)", warned[0])


def test_prepared_data_is_used_offline_without_data_input(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prepared once with data.input, then every later command (a preset, a resume, a sweep) without it, or with it
    moved: the prepared files are used and no download is tried."""
    data_dir = tmp_path / "data"
    made = ensure_prepared(DataConfig(input=str(corpus_path), url=UNREACHABLE, dir=str(data_dir)))
    with monkeypatch.context() as known, caplog.at_level(logging.INFO, logger="data.prepare"):
        known.setitem(KNOWN_TEXTS, UNREACHABLE, made.meta["source"]["input_sha256"])  # a copy of the URL's text
        assert ensure_prepared(DataConfig(input=None, url=UNREACHABLE, dir=str(data_dir))).meta == made.meta
    assert caplog.records[-1].levelname == "INFO"
    assert caplog.messages[-1] == f"data: using {data_dir}, prepared from {corpus_path}, a copy of {UNREACHABLE}"

    with caplog.at_level(logging.INFO):
        _train_py([f"out_dir={tmp_path / 'run'}", "device=cpu", f"data.dir={data_dir}", f"data.url={UNREACHABLE}",
                   "train.max_iters=2", "train.eval_iters=2", "model.n_layer=1", "model.n_embd=32"], caplog)
    assert (tmp_path / "run" / CKPT_NAME).exists()
    # KNOWN_TEXTS as shipped: not a copy of the URL's text, so said
    assert f"data: {data_dir} holds the text of {corpus_path}, not {UNREACHABLE}; training on it" in caplog.text

    caplog.clear()  # a resume restores data.input from the run's config: a text moved since no longer stops it
    text = tmp_path / "text.txt"
    text.write_bytes(corpus_path.read_bytes())
    made = ensure_prepared(DataConfig(input=str(text), dir=str(tmp_path / "moved")))
    text.unlink()
    with caplog.at_level(logging.WARNING, logger="data.prepare"):
        assert ensure_prepared(DataConfig(input=str(text), dir=str(tmp_path / "moved"))).meta == made.meta
    assert caplog.messages == [f"data.input={text} is gone; using the data prepared from it in {tmp_path / 'moved'}"]
    with pytest.raises(Exception, match="does not exist"):  # prepared from another path: no stand-in
        ensure_prepared(DataConfig(input=str(tmp_path / "other.txt"), dir=str(tmp_path / "moved")))


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


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("train.py", ["--max_iters=100"], "unrecognized arguments"),  # Hydra's usage text: no hint of ours
        ("sample.py", ["runs/cpu"], "missing EQUAL"),  # and how to quote a value
        ("train.py", ["experiment=shakespeare_char_cp"], "did you mean"),
    ],
)
def test_the_reference_quotes_what_a_mistaken_command_line_really_says(
    tmp_path: Path, script: str, args: list[str], says: str
) -> None:
    result = run_in_process(script, args, tmp_path)
    assert result.returncode == 2 and says in result.stderr
    reference = " ".join((REPO / "docs" / "reference.md").read_text(encoding="utf-8").split())
    assert args[0] in reference and says in reference


def test_help_lists_the_keys_set_most_and_cfg_job_is_called_resolved_only_with_resolve(tmp_path: Path) -> None:
    """--help lists the keys set most, with examples; --cfg job prints the composed config, out_dir's ${now:...} as
    written, and --resolve fills it in. Neither makes anything."""
    texts = [(REPO / name).read_text(encoding="utf-8") for name in ("README.md", "docs/reference.md", "train.py")]
    for script in ("train.py", "sample.py", "eval.py", "serve.py"):
        result = run_in_process(script, ["--help"], tmp_path)
        text = result.stdout
        assert result.returncode == 0, result.stderr
        assert "Keys set most, at their defaults:" in text and "Examples:" in text and "docs/reference.md" in text
        examples = [line.strip() for line in text.splitlines() if line.strip().startswith(f"python {script}")]
        assert len(examples) >= 2, script
        assert ("experiment " in text) == (script == "train.py")  # only train.py takes presets
        texts.append(text)
    for text in texts:
        for after in re.findall(r"--cfg job(?! --resolve)(.{0,40})", " ".join(text.split())):
            assert "resolved" not in after, after
    unresolved = run_in_process("train.py", ["experiment=shakespeare_char_cpu", "--cfg", "job"], tmp_path)
    resolved = run_in_process("train.py", ["--cfg", "job", "--resolve"], tmp_path).stdout
    assert unresolved.returncode == 0 and "n_embd: 128" in unresolved.stdout, unresolved.stderr
    assert "out_dir: outputs/${now:" in unresolved.stdout and "out_dir: outputs/2" in resolved
    assert "out_dir: RUN" in run_in_process("sample.py", ["out_dir=RUN", "--cfg", "job"], tmp_path).stdout
    assert list(tmp_path.iterdir()) == []


def test_a_command_that_fails_before_training_leaves_nothing_behind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run directory (and a data folder) is made only once every check has passed: what the command added goes,
    and folders that were there before, such as the user's runs/x/old behind runs/x/new/../old, stay as they were."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()  # the user's own empty folder, and a run directory's neighbour
    (tmp_path / "outputs" / "older").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "old" / "train.log").write_text("the user's own\n")
    offline = f"data.url={UNREACHABLE}"
    for args in (
        ["data.input=missing.txt"],  # the default outputs/DATE/TIME
        ["out_dir=runs/typo/one", "resume=true"],  # two folders made for it
        ["out_dir=mine", "resume=true"],
        ["out_dir=runs/x/new/../old", "data.input=/missing.txt"],
        [offline, "data.dir=made/by/us"],  # us goes; the folders above it stay, empty
        [offline, "data.dir=mine/data"],
        [offline, "data.dir=mine"],
    ):
        err = _train_py(args, caplog)
        assert err.startswith("error: ") and (offline not in args or f"could not download {UNREACHABLE}" in err)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == [
        "made", "made/by", "mine", "outputs", "outputs/older", "runs", "runs/x", "runs/x/old", "runs/x/old/train.log"
    ]
    assert (tmp_path / "runs" / "x" / "old" / "train.log").read_text() == "the user's own\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full, a disk that is always full, is Linux's")
def test_a_train_log_the_disk_cannot_take_costs_no_traceback(
    tmp_path: Path, corpus_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk the log handler's own errors (97 lines, 3 tracebacks) hid the one line saying why."""
    import common.files

    opened = open
    monkeypatch.setattr(common.files, "open", lambda path, *args, **kwargs: opened(
        "/dev/full" if Path(path).name == "train.log" else path, *args, **kwargs), raising=False)
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})))
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err
