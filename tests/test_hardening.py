"""What a careless or unlucky user does: each mistake is one line (status 2 from the scripts), nothing given is
silently accepted, and damaged files are refused or repaired rather than trusted."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from common.cli import check_overrides
from common.config import check_override
from common.errors import ConfigError, DataError, DiskFull, UserError
from common.runtime import make_directory, open_for_appending
from conftest import compose_config, run_in_process, run_script, tiny_run_overrides
from data.prepare import DataConfig, ensure_prepared
from inference.sampling import SampleConfig, load_model, read_prompt
from model import GPT, GPTConfig
from model.gpt import CKPT_NAME, Checkpoint, CheckpointError, load_checkpoint, saved_config
from training.run import train
from training.schema import CONFIG_GROUPS, TrainRunConfig, WandbConfig
from training.trainer import METRICS_NAME, MetricsLog, drop_records_after, read_records

FAST = {"train.max_iters": 4, "train.eval_interval": 2, "train.log_interval": 1}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "train.lerning_rate",
            1.0,
            "train.lerning_rate is not a key of this config; did you mean train.learning_rate?",
        ),  # noqa: E501
        ("modle.n_layer", 2, "modle is not a key of this config; did you mean model?"),
        ("train.max_iters", "abc", "train.max_iters=abc is not an integer"),
        ("model.attn_window", "wide", "model.attn_window=wide is not an integer or null"),
        ("train.compile", "maybe", "train.compile=maybe is not true or false or null"),
        ("wandb.tags", "x", "wandb.tags=x is not a list such as [a,b]"),
        ("data.val_fraction", 1.5, "data.val_fraction=1.5 must be < 1.0"),
        ("train.learning_rate", 0.0, "train.learning_rate=0.0 must be > 0.0"),
        ("train.learning_rate", float("nan"), "train.learning_rate=nan must be a finite number"),
        ("seed", None, "seed=null is not an integer"),
        ("train.learning_rate.x", 1, "train.learning_rate is a value, not a group of keys, so train.learning_rate.x"),
        ("train", {"max_iterz": 2}, "train.max_iterz is not a key of this config; did you mean train.max_iters?"),
        ("train", 5, "train=5: train is a group of keys; set one as train.KEY=VALUE"),
    ],
)
def test_a_command_line_override_is_checked_against_the_schema(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_override(TrainRunConfig, key, value)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "args",
    [
        ["experiment=speedrun_cpu", "model=gpt2", "data=shakespeare"],  # config groups
        ["-m", "model=baby,gpt2", "seed=1,2", "seed=range(1,1000000000)", "train.learning_rate=choice(1e-3,3e-3)"],
        ["hydra.run.dir=x", "hydra/job_logging=stdout", "--cfg", "job", "--resolve"],
        ["out_dir=${now:%H-%M}", "model.attn_window=null", "wandb.tags=[a,b]", "wandb.tags=[]", "+seed=3", "~seed"],
        ['train.learning_rate="1e-3"', "train.max_iters='100'", "train.learning_rate=1", "train.compile=true"],
        ["train={max_iters:2,batch_size:8}", "data.input=C:\\Users\\me\\input.txt"],
        ["-sc", "install=bash"],  # shell completion, not overrides
        ["--shell-comp", "install=bash"],
    ],
)
def test_commands_that_hydra_takes_still_pass(args: list[str]) -> None:
    check_overrides(args, TrainRunConfig, CONFIG_GROUPS)


def test_a_range_sweep_over_a_misspelt_key_is_one_line(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        check_overrides(["-m", "train.max_iterz=range(1,3)"], TrainRunConfig)
    assert info.value.code == 2
    assert (
        capsys.readouterr().err == "error: train.max_iterz is not a key of this config; did you mean train.max_iters?\n"
    )


def test_a_quoted_number_is_judged_as_the_number_it_becomes() -> None:
    with pytest.raises(ConfigError, match="train.learning_rate=-0.001 must be > 0.0"):
        check_override(TrainRunConfig, "train.learning_rate", "-1e-3")


@pytest.mark.parametrize(
    ("arg", "says", "run"),
    [  # the class's seam as a user meets it, then the same command in this process
        ("train.learning_rate=1e-3,3e-3", "error: Ambiguous value for argument 'train.learning_rate=1e-3,3e-3' ",
         run_script),
        ("+train.max_iters=5", "error: Could not append to config. An item is already at 'train.max_iters'.",
         run_in_process),
    ],
)
def test_what_hydra_alone_refuses_is_one_line_too(tmp_path: Path, arg: str, says: str, run) -> None:
    """Overrides are checked only once Hydra refuses them: its reason, when no check of ours names one."""
    result = run("train.py", [arg], cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith(says) and result.stderr.count("\n") == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_hydra_writes_nothing_of_its_own_even_for_an_out_dir_under_home(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """out_dir='~/runs/x' (quoted for Hydra, as zsh users pass it) once ran in $HOME/runs/x while Hydra's train.log
    went to a literal ./~/runs/x/ in the current directory: now the run writes all of its files, in one place."""
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir()
    here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    args = [*tiny_run_overrides(tmp_path, corpus_path, **FAST), "out_dir='~/runs/x'"]
    result = run_script("train.py", args, cwd=here)
    assert result.returncode == 0, result.stderr
    assert list(here.iterdir()) == []
    run = home / "runs" / "x"
    assert {".hydra", "ckpt.pt", "config.yaml", "metrics.jsonl", "train.log"} <= {p.name for p in run.iterdir()}
    log = (run / "train.log").read_text()
    assert "step 4:" in log and log.rstrip().splitlines()[-1].startswith("done: 4 iters")


def test_a_misspelt_key_on_the_command_line_is_one_line_not_hydras_report(tmp_path: Path) -> None:
    result = run_in_process("sample.py", ["out_dir=x", "temprature=0.5"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: temprature is not a key of this config; did you mean temperature?\n"


def test_a_prompt_file_that_is_a_directory_or_not_utf8_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"start=FILE:{tmp_path} is a directory"):
        read_prompt(f"FILE:{tmp_path}")
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"ROMEO:\xff\xfe")
    with pytest.raises(DataError, match=r"is not UTF-8 text \(invalid start byte at byte 6\)"):
        read_prompt(f"FILE:{binary}")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX's")
def test_a_pipe_where_a_file_is_expected_is_named_as_such(tmp_path: Path) -> None:
    """It was 'does not exist' (data.input, the HellaSwag file) or 'no such file' (start=FILE:)."""
    from data.prepare import input_file
    from evals.hellaswag import hellaswag_path

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    expected = "is not a regular file (a pipe, a device or a socket)"
    for call in (lambda: read_prompt(f"FILE:{fifo}"), lambda: input_file(str(fifo)),
                 lambda: hellaswag_path(str(fifo), "hellaswag_file")):
        with pytest.raises(DataError, match=re.escape(expected)):
            call()
    with pytest.raises(DataError, match=f"start=FILE:{tmp_path / 'none.txt'} does not exist"):
        read_prompt(f"FILE:{tmp_path / 'none.txt'}")


def test_max_iters_0_writes_the_initial_weights_it_claims(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="train")
    result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 0})))
    assert result.iters == 0 and load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 0
    done = caplog.records[-1].getMessage()
    assert done.startswith("done: 0 iters") and f"{tmp_path / 'run' / CKPT_NAME} keeps iter 0" in done


def test_damaged_metrics_lines_are_dropped_on_resume_and_left_out_by_plot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = [{"iter": 1, "train_loss": 2.0, "val_loss": 2.1, "val_bpb": 3.0}, {"iter": 2, "train_loss": 1.9}]
    lines = [json.dumps(r).encode() + b"\n" for r in good]
    (run / METRICS_NAME).write_bytes(lines[0] + b'{"iter": 2, "lo\xff\xfess": 1}\n' + lines[1] + b'{"iter": 3, "tra')
    assert read_records(run) == (good, 2)
    drop_records_after(run, 1)
    assert (run / METRICS_NAME).read_bytes() == lines[0]
    (run / METRICS_NAME).write_bytes(lines[0] + lines[1] + b'{"iter": 3, "tra')
    result = run_in_process("plot.py", [str(run), "--out", str(tmp_path / "plot.png")], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"warning: {run / METRICS_NAME}: left out 1 damaged line(s)" in result.stderr


def test_wandb_that_cannot_start_is_one_warning_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    seen = {}

    def no_network(**kwargs: object) -> None:
        seen["timeout"] = kwargs["settings"].init_timeout
        raise wandb.errors.CommError("Run initialization has timed out after 3.0 sec.\nPlease retry.")

    monkeypatch.setattr(wandb, "init", no_network)
    metrics = MetricsLog(tmp_path)
    metrics.start_wandb(WandbConfig(enabled=True, init_timeout=3.0), {})
    assert metrics.wandb_run is None and seen["timeout"] == 3.0
    assert [r.getMessage() for r in caplog.records] == [
        "wandb did not start (Run initialization has timed out after 3.0 sec.); training goes on without it, "
        "metrics.jsonl has everything"
    ]
    metrics.write({"iter": 1, "train_loss": 1.0, "lr": 1e-3})
    assert read_records(tmp_path)[0] == [{"iter": 1, "train_loss": 1.0, "lr": 1e-3}]


def test_random_bytes_are_called_damaged_not_dangerous(tmp_path: Path) -> None:
    path = tmp_path / CKPT_NAME
    path.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(CheckpointError, match="damaged, or not a checkpoint") as info:
        load_checkpoint(path)
    assert "run code" not in str(info.value)


def test_resuming_on_data_with_another_vocabulary_names_the_data_not_overrides(
    tmp_path: Path, corpus_path: Path
) -> None:
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **FAST)))
    other = tmp_path / "other.txt"
    other.write_text("abc " * 2000)
    other_data = {"data.dir": tmp_path / "other", "resume_with_changes": True}  # without: refused as a change
    overrides = tiny_run_overrides(tmp_path, other, **FAST, resume=True, **other_data)
    with pytest.raises(CheckpointError, match="the data's vocabulary has 4 tokens and the checkpoint's model") as info:
        train(compose_config(overrides))
    assert "overrides" not in str(info.value)


@pytest.mark.parametrize(
    ("content", "val_fraction", "expected"),
    [
        ("a short text\n" * 5, 0.1, "the train split's longest token file has 58 tokens, too few"),
        ("a", 0.1, "the train split's longest token file has 0 tokens, too few"),  # an empty token file
        ("a short text\n" * 50, 1e-17, "the val split's longest token file has 0 tokens, too few"),  # empty too
    ],
)
def test_a_short_text_is_one_line_naming_the_split(
    tmp_path: Path, content: str, val_fraction: float, expected: str
) -> None:
    text = tmp_path / "short.txt"
    text.write_text(content)
    overrides = tiny_run_overrides(tmp_path, text, **{"model.block_size": 64, "data.val_fraction": val_fraction})
    with pytest.raises(ConfigError, match=expected) as info:
        train(compose_config(overrides))
    assert "shard_tokens" not in str(info.value)
    hint = "raise data.val_fraction" if "val split" in expected else "lower data.val_fraction"
    assert str(info.value).endswith(f"train on more text (or {hint})")


def test_data_prepared_inside_the_run_directory_trains(tmp_path: Path, corpus_path: Path) -> None:
    """The data folder's files move into the run directory, beside the run's own."""
    overrides = tiny_run_overrides(tmp_path, corpus_path, **FAST, **{"data.dir": tmp_path / "run"})
    assert train(compose_config(overrides)).iters == 4


def test_a_checkpoint_that_would_call_os_system_is_called_dangerous_not_damaged(tmp_path: Path) -> None:
    path = tmp_path / CKPT_NAME
    torch.save({"model": _CallsOsSystem()}, path)
    with pytest.raises(CheckpointError, match="unpickling those could run code"):
        load_checkpoint(path)


class _CallsOsSystem:
    def __reduce__(self) -> tuple:
        return (os.system, ("true",))


@pytest.mark.parametrize("args", [["stream=true", "num_samples=3"], ["num_samples=1", "check_causal=true"]])
def test_a_reader_that_leaves_early_ends_sample_py_quietly(trained_run: Path, args: list[str]) -> None:
    """`sample.py ... | head -c 20`: no traceback; ended by SIGPIPE, as `cat` is (or 0 if all was written)."""
    import subprocess
    import sys

    from conftest import REPO

    command = [sys.executable, str(REPO / "sample.py"), f"out_dir={trained_run}", "max_new_tokens=200", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=trained_run.parent)
    assert len(process.stdout.read(20)) == 20
    process.stdout.close()  # the reader leaves
    _, stderr = process.communicate(timeout=120)
    assert process.returncode in (0, -signal.SIGPIPE), stderr.decode()
    assert b"Traceback" not in stderr and b"Error" not in stderr, stderr.decode()


@pytest.mark.parametrize(
    ("override", "text"),
    [
        ("start='Cost: ${price}'", "Cost: ${price}"),  # an unknown key: was an interpolation traceback
        ("start=${seed}", "${seed}"),  # a known key: was silently 1337
        ("start='a \\${b}'", "a ${b}"),  # already escaped: left as it is
        ("stop=['${end}',x]", ["${end}", "x"]),
    ],
)
def test_a_prompt_is_taken_literally_interpolations_included(override: str, text: object) -> None:
    from common.config import literal_text, typed_config

    overrides = literal_text(["out_dir=run", override], ("start", "stop"))
    config = typed_config(compose_config(overrides, config_name="sample"), SampleConfig)
    key = override.partition("=")[0]
    assert getattr(config, key) == text


def test_every_path_key_expands_the_home_directory_once_for_checks_and_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """`~` (quoted for Hydra, or left by the shell) in out_dir and attention_dir made a literal ./~/ directory while
    data.input was expanded: one rule now, applied when the config is built."""
    from common.config import typed_config
    from inference.sampling import EvalConfig

    home = Path.home()
    train_config = typed_config(
        compose_config(["out_dir='~/runs/a'", "data.input='~/text.txt'", "data.dir='~/data'"]),
        TrainRunConfig,
    )
    assert (train_config.out_dir, train_config.data.input, train_config.data.dir) == (
        str(home / "runs/a"), str(home / "text.txt"), str(home / "data")
    )
    sample = typed_config(compose_config(["out_dir='~/runs/a'", "attention_dir='~/maps'"], "sample"), SampleConfig)
    assert (sample.out_dir, sample.attention_dir) == (str(home / "runs/a"), str(home / "maps"))
    evaluation = typed_config(compose_config(["out_dir='~/runs/a'", "input='~/t.txt'"], "eval"), EvalConfig)
    assert (evaluation.out_dir, evaluation.input) == (str(home / "runs/a"), str(home / "t.txt"))


def _crafted(run: Path, alter: Callable[[dict], object]) -> Path:
    """A tiny checkpoint as train.py writes it (names, shapes, optimizer state, random state), altered, in run/."""
    config = GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8)
    weights = GPT(config).state_dict()
    moments = {name: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(w)} for name, w in weights.items()}
    checkpoint = Checkpoint(config, weights, {"kind": "char", "chars": ["a", "b", "c"]},
                            optimizer={"state": moments, "param_groups": [{"params": list(weights)}]},
                            rng=[{"torch": torch.get_rng_state(), "cuda": []}], dtype="float32")
    raw = checkpoint.to_dict()
    alter(raw)
    run.mkdir(exist_ok=True)
    torch.save(raw, run / CKPT_NAME)
    return run


def _weights(raw: dict, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    raw["model"] = {name: change(w) for name, w in raw["model"].items()}


@pytest.mark.parametrize(
    ("alter", "message"),
    [
        (lambda raw: raw["model_config"].update(n_layer=10**6), "model_config n_layer=1000000 must be <= "),
        (lambda raw: raw["model_config"].update(block_size=2**40), "model_config block_size=1099511627776 must be <= "),
        (lambda raw: raw["model_config"].update(n_layer="abc"), "model_config n_layer=abc is not an integer"),
        (lambda raw: raw.update(model_config=[1]), "its model_config is a list, not a mapping"),
        (lambda raw: raw["model_config"].update(pos_emb="rope", n_embd=65536, n_head=1, block_size=2**20),
         "its model_config's tables don't fit in memory"),
        (lambda raw: raw["model_config"].update(n_layer=1000), "weights are too few for its model_config n_layer=1000"),
        (lambda raw: raw.update(iter=-100), "its iter=-100 must be >= 0"),
        (lambda raw: raw.update(elapsed_s="x"), "its elapsed_s=x is not a number"),
        (lambda raw: raw.update(config=[1]), "its config is a list"),
        (lambda raw: raw.update(model=[1, 2]), "its model is a list"),
        (lambda raw: raw["model"].update({"lm_head.weight": torch.zeros(3, 3)}),
         "its weight lm_head.weight is of shape (3, 3); its model_config implies shape (3, 8)"),
        (lambda raw: raw["model"].pop("transformer.ln_f.weight"), "its weight transformer.ln_f.weight is missing"),
        (lambda raw: raw["model"].update(extra=torch.zeros(1)), "its model_config has no weight extra"),
        (lambda raw: _weights(raw, torch.Tensor.long), "its weight transformer.wte.weight is torch.int64, not float"),
        (lambda raw: _weights(raw, lambda w: w * math.nan), "its weight transformer.wte.weight holds NaN or inf"),
        (lambda raw: raw.update(dtype="int8"), "dtype=int8 is no precision train.py runs in"),
        (lambda raw: raw.update(tokenizer={"kind": "zzz"}), "holds damaged tokenizer metadata (neither char nor bpe)"),
        (lambda raw: raw.update(tokenizer={"kind": "char", "chars": [1, 2, 3]}), "chars are not a list of characters"),
        (lambda raw: raw.update(tokenizer={"kind": "char", "chars": ["a"]}), "(1 characters for a model of 3 tokens)"),
        (lambda raw: raw.update(tokenizer={"kind": "bpe", "encoding": 5}), "(its encoding is not a name)"),
    ],
)
def test_a_crafted_or_damaged_checkpoint_is_refused_at_load_naming_the_field(
    tmp_path: Path, alter: Callable[[dict], object], message: str
) -> None:
    """Each was a traceback, an allocator's error, a spin until memory ran out or a crash in sampling; every command
    (sample, eval, serve, export, resume) loads through here, so none starts with such a file."""
    run = _crafted(tmp_path / "run", alter)
    with pytest.raises(UserError) as info:
        load_model(str(run), None, "latest", None)
    assert message in str(info.value) and str(run / CKPT_NAME) in str(info.value)


@pytest.mark.parametrize(
    ("alter", "message"),
    [
        (lambda raw: raw["optimizer"]["state"]["transformer.ln_f.weight"].update(exp_avg=torch.zeros(3)),
         "its optimizer's exp_avg for transformer.ln_f.weight is of shape (3,), the weight of shape (8,)"),
        (lambda raw: raw.update(optimizer={"state": [], "param_groups": []}), "its optimizer is not an optimizer's"),
        (lambda raw: raw.update(rng=[{"torch": torch.zeros(3, dtype=torch.uint8), "cuda": []}]), "its rng is not"),
    ],
)
def test_a_damaged_training_state_is_refused_when_resuming_and_ignored_by_sampling(
    tmp_path: Path, alter: Callable[[dict], object], message: str
) -> None:
    run = _crafted(tmp_path / "run", alter)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(run / CKPT_NAME, resuming=True)
    assert load_model(str(run), None, "latest", None).model.config.n_layer == 1


def test_the_checkpoint_crafted_for_the_test_loads() -> None:
    """The alterations above are all that is wrong with it."""
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(_crafted(Path(tmp), lambda raw: None)), None, "latest", None)
    assert loaded.model.config.n_layer == 1 and loaded.tokenizer.decode([2, 0]) == "ca"


def test_sample_py_says_a_nan_checkpoint_in_one_line(tmp_path: Path) -> None:
    run = _crafted(tmp_path / "run", lambda raw: _weights(raw, lambda w: w * math.nan))
    result = run_in_process("sample.py", [f"out_dir={run}", "max_new_tokens=3", "num_samples=1"], tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: {run / CKPT_NAME} can't be used: its weight transformer.wte.weight holds NaN or " \
                            "inf; use an earlier checkpoint\n"


def test_a_negative_iter_is_refused_before_metrics_jsonl_is_cut(tmp_path: Path, corpus_path: Path) -> None:
    """iter=-100 once emptied metrics.jsonl (7 lines to 1) before the crash."""
    run = _crafted(tmp_path / "run", lambda raw: raw.update(iter=-100))
    history = "".join(json.dumps({"iter": i, "loss": 1.0}) + "\n" for i in range(7))
    (run / METRICS_NAME).write_text(history)
    with pytest.raises(CheckpointError, match="its iter=-100 must be >= 0"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True)))
    assert (run / METRICS_NAME).read_text() == history and sorted(p.name for p in run.iterdir()) == [CKPT_NAME,
                                                                                                     METRICS_NAME]


@contextlib.contextmanager
def _no_wait(seconds: float = 20) -> Iterator[None]:
    """A blocked open fails the test (SIGALRM) instead of hanging the suite; never reached when the code is right."""
    def hung(signum: int, frame: object) -> None:
        raise TimeoutError("blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX's")
def test_a_fifo_where_a_run_or_data_file_belongs_is_refused_not_waited_on(tmp_path: Path, corpus_path: Path) -> None:
    """data.dir/meta.json, ckpt.pt on resume, metrics.jsonl and train.log each hung train.py forever."""
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    run.mkdir()
    for path in (data / "meta.json", run / CKPT_NAME, run / METRICS_NAME, run / "train.log"):
        os.mkfifo(path)
    fifo = "is not a regular file (a pipe, a device or a socket)"
    with _no_wait():
        with pytest.raises(DataError, match=re.escape(f"{data / 'meta.json'} {fifo}; remove it")):
            ensure_prepared(DataConfig(input=str(corpus_path), dir=str(data)))
        assert saved_config(run / CKPT_NAME) is None  # resume=true's first read
        with pytest.raises(DataError, match=re.escape(f"{run / CKPT_NAME} {fifo}")):
            load_checkpoint(run / CKPT_NAME)
        for name in (METRICS_NAME, "train.log"):  # both appended to through open_for_appending
            with pytest.raises(DataError, match=re.escape(f"{run / name} {fifo}; a run never writes through one")):
                open_for_appending(run / name)


def test_links_and_files_where_directories_or_logs_go_are_one_line(tmp_path: Path) -> None:
    """out_dir or attention_dir linked to a file, train.log linked to one (ELOOP): each was a traceback."""
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (tmp_path / "out").symlink_to(target)
    with pytest.raises(ConfigError, match=re.escape(f"out_dir={tmp_path / 'out'}: {tmp_path / 'out'} is a file, not")):
        make_directory(tmp_path / "out", f"out_dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        make_directory(tmp_path / "out" / "maps", "attention_dir=out/maps")
    (tmp_path / "train.log").symlink_to(target)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'train.log'} is a symbolic link; a run never writes")):
        open_for_appending(tmp_path / "train.log")
    assert target.read_text() == "mine"


def test_exhausted_inodes_or_space_at_mkdir_are_the_disk_full_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(DiskFull, match=r"^out_dir=runs/x not made: the disk holding it is full \(no space or no"):
        make_directory(tmp_path / "runs" / "x", "out_dir=runs/x")


def test_a_start_removes_its_killed_writers_temporaries_and_nothing_else(tmp_path: Path, corpus_path: Path) -> None:
    """ckpt.pt.PID.tmp of a writer killed mid-write stayed forever (up to 100 MB each)."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(finished.stdout), os.getppid()  # that process has exited; pytest's parent runs
    run = tmp_path / "run"
    run.mkdir()
    kept = [f"ckpt.pt.{alive}.tmp", "notes.tmp", f"thesis.{dead}.tmp"]  # a live writer's, and the user's own
    for name in [f"ckpt.pt.{dead}.tmp", f"metrics.jsonl.{dead}.tmp", f"best.pt.{dead}.tmp", *kept]:
        (run / name).write_bytes(b"partial")
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **FAST)))
    assert sorted(p.name for p in run.glob("*.tmp")) == sorted(kept)


def test_attention_dir_never_overwrites_the_users_files(trained_run: Path, tmp_path: Path) -> None:
    """An index.html or any other file sample.py didn't write stops it before any work; its own output from an
    earlier run may be written again."""
    from analysis.attention_maps import check_output_dir

    mine = tmp_path / "maps"
    args = [f"out_dir={trained_run}", "max_new_tokens=20", "num_samples=1", f"attention_dir={mine}"]
    assert run_in_process("sample.py", args, tmp_path).returncode == 0
    assert run_in_process("sample.py", args, tmp_path).returncode == 0  # ours: written again
    for name, content in (("index.html", "<html>my homepage</html>"), ("notes.txt", "mine")):
        theirs = tmp_path / name.replace(".", "_")
        theirs.mkdir()
        (theirs / name).write_text(content)
        result = run_in_process("sample.py", [*args[:-1], f"attention_dir={theirs}"], tmp_path)
        assert result.returncode == 2 and result.stdout == ""  # refused before sampling
        assert f"holds files sample.py didn't write ({name}" in result.stderr
        assert (theirs / name).read_text() == content and len(list(theirs.iterdir())) == 1
    check_output_dir(tmp_path / "new")  # a new directory: nothing to check


def test_data_dir_never_replaces_a_meta_json_it_did_not_write(tmp_path: Path, corpus_path: Path) -> None:
    for content in ('{"vocab_size": 50257, "note": "my own dataset"}', '["a list"]'):
        data = tmp_path / "data"
        data.mkdir(exist_ok=True)
        (data / "meta.json").write_text(content)
        (data / "train.bin").write_bytes(b"\x01\x02")
        config = DataConfig(input=str(corpus_path), dir=str(data))
        with pytest.raises(DataError, match=r"holds a meta.json this project didn't write; .* name another data.dir"):
            ensure_prepared(config)
        assert (data / "meta.json").read_text() == content and (data / "train.bin").read_bytes() == b"\x01\x02"
    ours = DataConfig(input=str(corpus_path), dir=str(tmp_path / "ours"))
    ensure_prepared(ours)
    (tmp_path / "ours" / "meta.json").write_text("")  # damaged, not someone else's: prepared again
    ensure_prepared(ours)
    changed = DataConfig(input=str(corpus_path), dir=str(tmp_path / "ours"), val_fraction=0.2)
    with pytest.raises(DataError, match="was prepared from .* val_fraction=0.1, not .* val_fraction=0.2 as asked"):
        ensure_prepared(changed)  # its own, from other settings: refused, never prepared again


def test_the_path_rule_expands_only_a_leading_tilde() -> None:
    """An empty value stays empty (data.input= still means no input), an unknown ~user stays as given."""
    config = DataConfig(input="", dir="~nosuchuser_here/data")
    assert (config.input, config.dir) == ("", "~nosuchuser_here/data")
    assert DataConfig(dir="a/./b/").dir == "a/./b/"
