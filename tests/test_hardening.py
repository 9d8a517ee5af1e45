"""What a careless or unlucky user does: each mistake is one line (status 2 from the scripts), nothing given is
silently accepted, and damaged files are refused or repaired rather than trusted."""

from __future__ import annotations

import dataclasses
import errno
import faulthandler
import io
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import signal
import zipfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

import common.files
from common.config import check_overrides, literal_text, typed_config
from common.errors import CheckpointError, ConfigError, DataError, DiskFull, UserError
from common.files import CKPT_NAME, LOCK_NAME, LOG_NAME, METRICS_NAME, RunDir, make_directory, read_records
from common.runtime import World
from conftest import TINY_BPE, compose_config, refused, run_in_process, run_script, start_script, tiny_run_overrides
from data.prepare import DataConfig, ensure_prepared
from eval import EvalConfig
from inference.sampling import load_model, read_prompt
from model import GPT, GPTConfig
from model.checkpoint import Checkpoint, load_checkpoint
from sample import SampleConfig
from train import TrainConfig, TrainRunConfig, WandbConfig, check_fits, train
from training.resume import CONFIG_GROUPS
from training.trainer import MetricsLog

FAST = {"train.max_iters": 4, "train.eval_interval": 2, "train.log_interval": 1}


def test_a_model_too_large_for_memory_is_told_to_shrink_and_only_a_batch_too_large_to_lower_batch_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """40B parameters need 290 GiB for their weights and gradients alone: no batch size helps, so none is advised."""
    monkeypatch.setattr("common.runtime.memory_bytes", lambda device: 64 * 2**30)
    huge = GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=64, n_embd=8192)
    with pytest.raises(ConfigError) as info:
        check_fits(huge, TrainConfig(batch_size=1), torch.device("cpu"), World())
    assert str(info.value).startswith("a model of about 39,066,796,032 parameters (its weights and gradients alone) "
                                      "needs about 291.1 GiB, more than this machine's 64.0 GiB; train a smaller model")
    assert "batch_size" not in str(info.value)
    small = GPTConfig(vocab_size=50304, block_size=1024, n_layer=2, n_head=2, n_embd=64)
    with pytest.raises(ConfigError, match=r"^train.batch_size=100000 with a model of .*; lower train.batch_size "):
        check_fits(small, TrainConfig(batch_size=100_000), torch.device("cpu"), World())


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


@pytest.mark.parametrize(
    ("run", "script", "args", "says"),
    [
        (run_in_process, "sample.py", ["out_dir=x", "temprature=0.5"],
         "error: temprature is not a key of this config; did you mean temperature?"),
        (run_in_process, "train.py", ["-m", "train.max_iterz=range(1,3)"],
         "error: train.max_iterz is not a key of this config; did you mean train.max_iters?"),
        (run_in_process, "train.py", ["experiment=shakespeare_char_cp"], "error: experiment=shakespeare_char_cp is "
         "unknown; did you mean experiment=shakespeare_char_cpu? (the choices: finetune_shakespeare, "),
        (run_in_process, "train.py", ["model=small"],
         "error: model=small is unknown (the choices: baby, gpt2, shakespeare)"),
        (run_in_process, "train.py", ["-m", "experiment=speedrun_cpu,speedrun_cp"],
         "error: experiment=speedrun_cp is unknown; did"),
        (run_in_process, "sample.py", ["experiment=speedrun_cpu"], "error: experiment is not a key"),  # no presets
        # what Hydra alone refuses, in its words: as the class's seam meets a user, then in this process
        (run_script, "train.py", ["train.learning_rate=1e-3,3e-3"],
         "error: Ambiguous value for argument 'train.learning_rate=1e-3,3e-3' "),
        (run_in_process, "train.py", ["+train.max_iters=5"],
         "error: Could not append to config. An item is already at 'train.max_iters'."),
    ],
)
def test_a_mistake_on_the_command_line_is_one_line_and_writes_nothing(
    tmp_path: Path, run: Callable, script: str, args: list[str], says: str
) -> None:
    result = run(script, args, cwd=tmp_path)
    assert refused(result).startswith(says)
    assert list(tmp_path.iterdir()) == []


def test_hydra_writes_nothing_of_its_own_even_for_an_out_dir_under_home(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """out_dir='~/runs/x' (quoted, as zsh users pass it): the run's files and Hydra's, all in $HOME/runs/x, and a log
    a user can read."""
    home, here = tmp_path / "home", tmp_path / "here"
    here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    result = run_script("train.py", [*tiny_run_overrides(tmp_path, corpus_path, **FAST), "out_dir='~/runs/x'"], here)
    assert result.returncode == 0, result.stderr
    assert list(here.iterdir()) == []
    run = home / "runs" / "x"
    for name in ("ckpt.pt", "metrics.jsonl", "config.yaml", ".hydra/config.yaml", "train.log"):
        assert (run / name).is_file(), name
    log = (run / "train.log").read_text()
    assert "step 4: train loss" in log and "ms/iter" in log and "tok/s" in log and "parameters" in log
    assert log.rstrip().splitlines()[-1].startswith("done: 4 iters")


def test_every_path_key_expands_a_leading_tilde_once_for_checks_and_use() -> None:
    """One rule, applied when the config is built: an empty value (no data.input) and an unknown ~user stay."""
    home = Path.home()
    train_config = typed_config(compose_config(["out_dir='~/runs/a'", "data.input='~/text.txt'"]), TrainRunConfig)
    assert (train_config.out_dir, train_config.data.input) == (str(home / "runs/a"), str(home / "text.txt"))
    sample = typed_config(compose_config(["out_dir='~/runs/a'", "attention_dir='~/maps'"], "sample"), SampleConfig)
    assert (sample.out_dir, sample.attention_dir) == (str(home / "runs/a"), str(home / "maps"))
    evaluation = typed_config(compose_config(["out_dir='~/runs/a'", "input='~/t.txt'"], "eval"), EvalConfig)
    assert (evaluation.out_dir, evaluation.input) == (str(home / "runs/a"), str(home / "t.txt"))
    config = DataConfig(input="", dir="~nosuchuser_here/data")
    assert (config.input, config.dir, DataConfig(dir="a/./b/").dir) == ("", "~nosuchuser_here/data", "a/./b/")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX's")
def test_a_fifo_where_a_file_is_read_or_written_is_refused_not_waited_on(tmp_path: Path, corpus_path: Path) -> None:
    """Reading or appending to one would wait for a writer forever: each is named as what it is, in one line."""
    from evals.hellaswag import hellaswag_path

    pipe, meta = tmp_path / "pipe", tmp_path / "d" / "meta.json"
    ckpt, log, metrics = (tmp_path / run / "run" / name for run, name in (("r", CKPT_NAME), ("l", "train.log"),
                                                                          ("m", METRICS_NAME)))
    for path in (pipe, meta, ckpt, log, metrics):
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    data = {"data.dir": tmp_path / "data"}
    refused = [
        (pipe, lambda: read_prompt(f"FILE:{pipe}")),
        (pipe, lambda: hellaswag_path(str(pipe), "hellaswag_file")),
        (pipe, lambda: ensure_prepared(DataConfig(input=str(pipe), dir=str(tmp_path / "data")))),
        (meta, lambda: ensure_prepared(DataConfig(input=str(corpus_path), dir=str(meta.parent)))),
        (ckpt, lambda: train(compose_config(tiny_run_overrides(tmp_path / "r", corpus_path, resume=True, **data)))),
        (log, lambda: train(compose_config(tiny_run_overrides(tmp_path / "l", corpus_path, **data)))),
        (metrics, lambda: train(compose_config(tiny_run_overrides(tmp_path / "m", corpus_path, **data)))),
    ]
    faulthandler.dump_traceback_later(60, exit=True)  # a blocked open ends the session, saying where, not hangs it
    try:
        for path, call in refused:
            with pytest.raises(DataError, match=re.escape(f"{path} is not a regular file (a pipe, a device or a")):
                call()
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_no_space_or_inodes_at_mkdir_is_the_disk_full_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Path, "mkdir", mock.Mock(side_effect=OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(DiskFull, match=r"^out_dir=runs/x not made: the disk holding it is full \(no space or no"):
        make_directory(tmp_path / "runs" / "x", "out_dir=runs/x")


def test_max_iters_0_writes_the_initial_weights_it_claims(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="train")
    result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 0})))
    assert result.iters == 0 and load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 0
    done = caplog.messages[-1]
    assert done.startswith("done: 0 iters") and f"{tmp_path / 'run' / CKPT_NAME} keeps iter 0" in done


def test_wandb_that_cannot_start_is_one_warning_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    no_network = wandb.errors.CommError("Run initialization has timed out after 3.0 sec.\nPlease retry.")
    monkeypatch.setattr(wandb, "init", mock.Mock(side_effect=no_network))
    metrics = MetricsLog(RunDir(tmp_path))
    metrics.start_wandb(WandbConfig(enabled=True, init_timeout=3.0), {})
    assert wandb.init.call_args.kwargs["settings"].init_timeout == 3.0
    assert metrics.wandb_run is None and caplog.messages == [
        "wandb did not start (Run initialization has timed out after 3.0 sec.); training goes on without it, "
        "metrics.jsonl has everything"
    ]
    metrics.write({"iter": 1, "train_loss": 1.0, "lr": 1e-3})
    assert read_records(tmp_path)[0] == [{"iter": 1, "train_loss": 1.0, "lr": 1e-3}]


@dataclasses.dataclass
class _RunsCode:
    """Unpickled, it makes a file: the proof that code ran."""

    marker: Path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize(
    ("write", "says"),
    [
        (lambda path: path.write_bytes(random.Random(0).randbytes(4096)), "damaged, or not a checkpoint"),
        (lambda path: path.write_bytes(b""), "damaged, or not a checkpoint"),
        (lambda path: path.write_bytes(b"PK\x03\x04 half a zip file"), "damaged, or not a checkpoint"),
        (lambda path: torch.save({"model": _RunsCode(path.with_name("code_ran"))}, path),
         "it holds objects .* could run code"),
    ],
)
def test_an_unreadable_checkpoint_is_one_line_and_runs_nothing(
    tmp_path: Path, write: Callable[[Path], None], says: str
) -> None:
    path = tmp_path / CKPT_NAME
    write(path)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))} is not a readable checkpoint: {says}") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value) and not (tmp_path / "code_ran").exists()
    pickle.loads(pickle.dumps(_RunsCode(tmp_path / "code_ran")))  # the payload is real: plain unpickling runs it
    assert (tmp_path / "code_ran").exists()


def _crafted(run: Path, alter: Callable[[dict], object]) -> Path:
    """A tiny checkpoint as train.py writes it (names, shapes, optimizer state, random state), altered, in run/."""
    config = GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8)
    model = GPT(config)
    moments = {name: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(weight)}
               for name, weight in model.named_parameters()}
    checkpoint = Checkpoint(config, model.state_dict(), {"kind": "char", "chars": ["a", "b", "c"]},
                            optimizer={"state": moments, "param_groups": [{"params": list(moments)}]},
                            rng=[{"torch": torch.get_rng_state(), "cuda": []}], dtype="float32")
    raw = checkpoint.to_dict()
    alter(raw)
    run.mkdir(exist_ok=True)
    torch.save(raw, run / CKPT_NAME)
    return run


def _set(**values: object) -> Callable[[dict], None]:
    return lambda raw: raw.update(values)


def _model(**values: object) -> Callable[[dict], None]:
    return lambda raw: raw["model_config"].update(values)


def _weights(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda raw: raw.update(model={name: change(w) for name, w in raw["model"].items()})


def _moments(change: Callable[[dict, dict, list], object]) -> Callable[[dict], None]:
    """change(state, moments of ln_f, the first group's names) on the optimizer's state."""
    return lambda raw: change(opt := raw["optimizer"], opt["state"]["transformer.ln_f.weight"],
                              opt["param_groups"][0]["params"])


def _by_position(raw: dict) -> None:
    """The optimizer's state keyed by position, as files from before torchrun were: AdamW's groups, matrices first."""
    state = raw["optimizer"]["state"]
    names = sorted(state, key=lambda name: state[name]["exp_avg"].dim() < 2)
    matrices = sum(state[name]["exp_avg"].dim() >= 2 for name in names)
    raw["optimizer"]["state"] = {i: state[name] for i, name in enumerate(names)}
    raw["optimizer"]["param_groups"] = [{"params": list(range(matrices))},
                                        {"params": list(range(matrices, len(names)))}]


@pytest.mark.parametrize(
    ("alter", "message"),
    [
        (_model(n_layer=10**6), "model_config n_layer=1000000 must be <= "),
        (_model(block_size=2**40), "model_config block_size=1099511627776 must be <= "),
        (_model(n_layer="abc"), "model_config n_layer=abc is not an integer"),
        (_set(model_config=[1]), "its model_config is a list, not a mapping"),
        (_model(pos_emb="rope", n_embd=65536, n_head=1, block_size=2**20), "model_config's tables don't fit in memory"),
        (_model(n_layer=1000), "weights are too few for its model_config n_layer=1000"),
        (_set(iter=-100), "its iter=-100 must be >= 0"),
        (_set(elapsed_s="x"), "its elapsed_s=x is not a number"),
        (_set(config=[1]), "its config is a list"),
        (_set(model=[1, 2]), "its model is a list"),
        (lambda raw: raw["model"].update({"lm_head.weight": torch.zeros(3, 3)}),
         "size mismatch for lm_head.weight: copying a param with shape torch.Size([3, 3]) from checkpoint"),
        (lambda raw: raw["model"].pop("transformer.ln_f.weight"), 'Missing key(s) in state_dict: "transformer.ln_f'),
        (lambda raw: raw["model"].update(extra=torch.zeros(1)), 'Unexpected key(s) in state_dict: "extra"'),
        (_weights(torch.Tensor.long), 'While copying the parameter named "transformer.wte.weight"'),
        (_weights(torch.Tensor.to_sparse), "its weight transformer.wte.weight is not a dense floating-point tensor"),
        (_weights(lambda w: w.flatten()[:1].clone().expand(w.shape)), "weight transformer.wte.weight is not a dense"),
        (_weights(lambda w: w * math.nan), "its weight transformer.wte.weight holds NaN or inf; use an earlier "
                                           "checkpoint"),
        (_set(dtype="int8"), "dtype=int8 is no precision train.py runs in"),
        (_set(tokenizer={}), "holds no tokenizer: it wasn't written by train.py"),
        (_set(tokenizer={"kind": "zzz"}), "holds damaged tokenizer metadata (neither char nor bpe)"),
        (_set(tokenizer={"kind": "char", "chars": [1, 2, 3]}), "chars are not a list of characters"),
        (_set(tokenizer={"kind": "char", "chars": ["a"]}), "(1 characters for a model of 3 tokens)"),
        (_set(tokenizer={"kind": "bpe", "encoding": TINY_BPE}), "(272 tokens for a model of 3 tokens)"),
        (_set(tokenizer={"kind": "char", "chars": ["a", "b", "\ud800"]}), "its chars are not a list of characters"),
        (_set(tokenizer={"kind": "bpe", "encoding": 5}), "(its encoding is not a name)"),
    ],
)
def test_a_crafted_or_damaged_checkpoint_is_refused_at_load_naming_the_field(
    tmp_path: Path, alter: Callable[[dict], object], message: str
) -> None:
    """Every command (sample, eval, serve, export, resume) loads through here, so none starts with such a file."""
    run = _crafted(tmp_path / "run", alter)
    with pytest.raises(UserError) as info:
        load_model(str(run), None, "latest", None)
    assert message in str(info.value) and str(run / CKPT_NAME) in str(info.value)


def test_a_checkpoint_saved_before_this_versions_keys_resumes_and_samples_in_float32(tmp_path: Path,
                                                                                    corpus_path: Path) -> None:
    """model.vocab_multiple came later (its runs were unpadded, the schema pads now), and a file may hold float16
    weights beside float32 ones: each still resumes, or samples in float32."""
    keys = {**FAST, "model.vocab_multiple": 1}
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
    path = tmp_path / "run" / CKPT_NAME
    raw = torch.load(path, weights_only=True)
    del raw["config"]["model"]["vocab_multiple"], raw["model_config"]["vocab_multiple"]
    raw["model"]["transformer.h.0.mlp.c_fc.weight"] = raw["model"]["transformer.h.0.mlp.c_fc.weight"].half()
    torch.save(raw, path)
    assert {p.dtype for p in load_model(str(tmp_path / "run"), None, "latest", None).model.parameters()} == {
        torch.float32}
    args = [f"out_dir={tmp_path / 'run'}", "resume=true", "resume_with_changes=true", "train.max_iters=6"]
    result = run_in_process("train.py", args, tmp_path)  # train.py's resume: the saved config, less the new key
    assert result.returncode == 0, result.stderr
    assert load_checkpoint(path).progress.iter == 6


@pytest.mark.parametrize(
    ("alter", "message"),
    [
        (_moments(lambda opt, ln_f, names: ln_f.update(exp_avg=torch.zeros(3))),
         "its optimizer's exp_avg for transformer.ln_f.weight is of shape (3,), the weight of shape (8,)"),
        (_moments(lambda opt, ln_f, names: ln_f.update(exp_avg=torch.tensor(0.0))),  # a segfault (exit 139)
         "its optimizer's exp_avg for transformer.ln_f.weight is of shape (), the weight of shape (8,)"),
        (_moments(lambda opt, ln_f, names: ln_f.update(exp_avg=torch.zeros(8).to_sparse())), "ln_f.weight is sparse"),
        (_moments(lambda opt, ln_f, names: ln_f.update(step=torch.zeros(0))),
         "its optimizer's step for transformer.ln_f.weight is of shape (0,), not one number"),
        (_moments(lambda opt, ln_f, names: names.append("transformer.h.7.mlp.c_fc.weight")),  # heap corruption
         "its optimizer names 'transformer.h.7.mlp.c_fc.weight', no parameter of its model"),
        (_moments(lambda opt, ln_f, names: names.append("lm_head.weight")),  # the tied head: a weight, no parameter
         "its optimizer names 'lm_head.weight', no parameter of its model"),
        (_moments(lambda opt, ln_f, names: names.append(names[0])),
         "its optimizer's param_groups list transformer.wte.weight 2 times, not once"),
        (_moments(lambda opt, ln_f, names: opt["state"].pop("transformer.ln_f.weight")),
         "its optimizer holds no state for transformer.ln_f.weight"),
        (lambda raw: (_by_position(raw), raw["optimizer"]["param_groups"][0]["params"].append(99)),
         "its optimizer names 99, no parameter of its model"),
        (lambda raw: (_by_position(raw), raw["optimizer"]["state"][0].update(exp_avg=torch.zeros(3))),
         "its optimizer's exp_avg for transformer.wte.weight is of shape (3,), the weight of shape (3, 8)"),
        (_set(optimizer={"state": [], "param_groups": []}), "its optimizer is not an optimizer's"),
        (_set(rng=[{"torch": torch.zeros(3, dtype=torch.uint8), "cuda": []}]), "its rng is not"),
    ],
)
def test_a_damaged_training_state_is_refused_when_resuming_and_ignored_by_sampling(
    tmp_path: Path, alter: Callable[[dict], object], message: str
) -> None:
    run = _crafted(tmp_path / "run", alter)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(run / CKPT_NAME, resuming=True)
    loaded = load_model(str(run), None, "latest", None)  # the crafted checkpoint's other fields are sound
    assert loaded.model.config.n_layer == 1 and loaded.tokenizer.decode([2, 0]) == "ca"


def test_a_crafted_optimizer_state_is_one_line_at_resume_never_a_crash(trained_run: Path, tmp_path: Path) -> None:
    """A group naming a parameter the model lacks gave heap corruption and a segfault (exit 139) at the first step."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    raw = torch.load(run / CKPT_NAME, weights_only=True)
    raw["optimizer"]["param_groups"][0]["params"][0] = "transformer.h.9.attn.c_attn.weight"
    torch.save(raw, run / CKPT_NAME)
    result = run_script("train.py", [f"out_dir={run}", "resume=true", "resume_with_changes=true",
                                     "train.max_iters=62"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {run / CKPT_NAME} can't be used: its optimizer names " \
                            "'transformer.h.9.attn.c_attn.weight', no parameter of its model\n"


def test_a_compressed_checkpoint_is_refused_before_it_is_unpacked(tmp_path: Path) -> None:
    """11.8 MB whose first weight unpacked to 2 GiB took 2.4 GB and 28 s before its shape was refused; torch.save
    compresses nothing, so such a file is refused from its zip directory alone, for sampling and for resuming."""
    run = _crafted(tmp_path / "run", lambda raw: raw["model"].update({"transformer.wte.weight": torch.zeros(2**24)}))
    saved = zipfile.ZipFile(io.BytesIO((run / CKPT_NAME).read_bytes()))
    with zipfile.ZipFile(run / CKPT_NAME, "w", zipfile.ZIP_DEFLATED) as packed:
        for record in saved.infolist():
            packed.writestr(record.filename, saved.read(record))
    assert (run / CKPT_NAME).stat().st_size < 2**20  # 64 MiB of weights in under 1 MiB
    for script, args in (("sample.py", ["max_new_tokens=3"]), ("train.py", ["resume=true"])):
        result = run_in_process(script, [f"out_dir={run}", *args], tmp_path)
        assert result.returncode == 2 and result.stderr == f"error: {run / CKPT_NAME} can't be used: its records are " \
            "compressed, which torch.save never does, and unpacking them could take gigabytes; use the file as " \
            "train.py wrote it\n"


@pytest.mark.parametrize(
    ("alter", "command", "says"),
    [  # a tokenizer larger than the model's vocabulary: an IndexError in sample.py and eval.py, a 500 from serve.py
        *[(_set(tokenizer={"kind": "char", "chars": list("abcdefgh")}), [*command, "device=cpu"],
           "CKPT holds damaged tokenizer metadata (8 characters for a model of 3 tokens); use a file train.py wrote")
          for command in (["sample.py", "start=hhh"], ["eval.py", "input=TEXT"], ["serve.py", "port=0"])],
        # a saved config that can't be read: OmegaConf's words (full_key, reference_type=TrainConfig) after Hydra's
        # "Error executing job"; a ValueError with an override
        *[(_set(config=config), ["train.py", "resume=true", *override], f"CKPT can't be used: its config's {says}")
          for config, says in [({"train": [1, 2]}, "train is a list, not a mapping"),
                               ({"train": {"max_iters": "${nope}"}}, "train.max_iters: Interpolation key 'nope' not"),
                               ({"train": {"max_iters": "many"}}, "train.max_iters: Value 'many' of type 'str' could")]
          for override in ([], ["train.eval_interval=5"])],
        *[(_set(config=config), ["eval.py", "device=cpu"], "the checkpoint in RUN holds no data config to find its val "
           "split; pass input=FILE") for config in ({}, {"data": [1]})],
    ],
)
def test_a_crafted_checkpoint_is_one_line_in_every_command_and_writes_nothing(
    tmp_path: Path, alter: Callable[[dict], object], command: list[str], says: str
) -> None:
    run = _crafted(tmp_path / "run", alter)
    (tmp_path / "text.txt").write_text("hhhh gggg " * 20)
    script, *args = (word.replace("TEXT", str(tmp_path / "text.txt")) for word in command)
    result = run_in_process(script, [f"out_dir={run}", *args], tmp_path)
    says = says.replace("CKPT", str(run / CKPT_NAME)).replace("RUN", str(run))
    assert refused(result).startswith(f"error: {says}") and result.stdout == ""
    assert sorted(p.name for p in run.iterdir()) == [CKPT_NAME]


def test_metrics_jsonl_loses_only_damaged_lines_and_records_after_the_checkpoint(
    tmp_path: Path, corpus_path: Path
) -> None:
    """A checkpoint refused at resume (iter=-100 once emptied metrics.jsonl) cuts nothing."""
    run = _crafted(tmp_path / "run", _set(iter=-100))
    good = [{"iter": 1, "train_loss": 2.0, "val_loss": 2.1, "val_bpb": 3.0}, {"iter": 2, "train_loss": 1.9}]
    lines = [json.dumps(r).encode() + b"\n" for r in good]
    history = lines[0] + b'{"iter": 2, "lo\xff\xfess": 1}\n' + lines[1] + b'{"iter": 3, "tra'
    (run / METRICS_NAME).write_bytes(history)
    with pytest.raises(CheckpointError, match="its iter=-100 must be >= 0"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True)))
    assert (run / METRICS_NAME).read_bytes() == history
    assert sorted(p.name for p in run.iterdir()) == [CKPT_NAME, METRICS_NAME]
    assert read_records(run) == (good, 2)  # plot.py's warning for the damaged ones: tests/test_stats.py
    RunDir(run).cut_history(1)
    assert (run / METRICS_NAME).read_bytes() == lines[0]


@pytest.mark.parametrize(
    ("content", "val_fraction", "expected"),
    [
        ("a short text\n" * 5, 0.1, "the train split's longest token file has 58 tokens, too few .* lower data."),
        ("a", 0.1, "the train split's longest token file has 0 tokens, too few .* lower data."),  # an empty file
        ("a short text\n" * 50, 1e-17, "the val split's longest token file has 0 tokens, too few .* raise data."),
    ],
)
def test_a_short_text_is_one_line_naming_the_split(
    tmp_path: Path, content: str, val_fraction: float, expected: str
) -> None:
    text = tmp_path / "short.txt"
    text.write_text(content)
    overrides = tiny_run_overrides(tmp_path, text, **{"model.block_size": 64, "data.val_fraction": val_fraction})
    with pytest.raises(ConfigError, match=f"^{expected}val_fraction\\)$"):  # not data.shard_tokens: not sharded
        train(compose_config(overrides))


def test_data_prepared_inside_a_new_run_directory_trains(tmp_path: Path, corpus_path: Path) -> None:
    """The data folder is made where the run directory goes; the run then opens it and trains beside the data."""
    overrides = tiny_run_overrides(tmp_path, corpus_path, **FAST, **{"data.dir": tmp_path / "run"})
    assert train(compose_config(overrides)).iters == FAST["train.max_iters"]


@pytest.mark.parametrize("args", [["stream=true", "num_samples=3"], ["num_samples=1", "check_causal=true"]])
def test_a_reader_that_leaves_early_ends_sample_py_quietly(trained_run: Path, args: list[str]) -> None:
    """`sample.py ... | head -c 20`: no traceback; ended by SIGPIPE, as `cat` is (or 0 if all was written)."""
    process = start_script("sample.py", [f"out_dir={trained_run}", "max_new_tokens=200", *args], trained_run.parent)
    assert len(process.stdout.read(20)) == 20
    process.stdout.close()  # the reader leaves
    _, stderr = process.communicate(timeout=120)
    assert process.returncode in (0, -signal.SIGPIPE) and "Traceback" not in stderr and "Error" not in stderr, stderr


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
    overrides = literal_text(["out_dir=run", override], ("start", "stop"))
    config = typed_config(compose_config(overrides, config_name="sample"), SampleConfig)
    assert getattr(config, override.partition("=")[0]) == text


def test_a_new_run_writes_only_into_a_new_or_empty_directory_or_one_its_own_dead_run_left(
    tmp_path: Path, corpus_path: Path
) -> None:
    """An empty out_dir= is the current directory: a run there replaced the user's config.yaml, metrics.jsonl and
    train.log. Refused before any work; a run killed before its first checkpoint leaves a directory a new one takes,
    its data prepared there too. The lock makes a run its directory's one writer: what a writer killed mid-write left
    in ckpt.pt.tmp (up to 100 MB) is neither read nor kept; a link there is removed, its target untouched."""
    here = tmp_path / "here"
    here.mkdir()
    mine = {"config.yaml": "my settings\n", "metrics.jsonl": "my numbers\n", "train.log": "my notes\n", "a.txt": ""}
    for name, text in mine.items():
        (here / name).write_text(text)
    overrides = [o for o in tiny_run_overrides(tmp_path, corpus_path, **FAST) if not o.startswith("out_dir=")]
    result = run_in_process("train.py", [*overrides, "out_dir="], here)
    assert (result.returncode, result.stderr) == (2, "error: out_dir=. holds files no run wrote (a.txt); a new run "
                                                     "needs a new or empty directory: name another out_dir\n")
    assert {p.name: p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == mine
    dead = tmp_path / "dead"  # what a kill -9 before the first checkpoint leaves
    (dead / ".hydra").mkdir(parents=True)
    for name in (LOCK_NAME, LOG_NAME, METRICS_NAME, "config.yaml", ".hydra/config.yaml"):
        (dead / name).write_text("")
    (dead / "ckpt.pt.tmp").write_bytes(b"partial")
    (tmp_path / "elsewhere").write_text("the user's own\n")
    (dead / "config.yaml.tmp").symlink_to(tmp_path / "elsewhere")
    inside = [o for o in overrides if not o.startswith("data.dir=")]
    assert train(compose_config([*inside, f"out_dir={dead}", f"data.dir={dead}"])).iters == FAST["train.max_iters"]
    assert not list(dead.glob("*.tmp")) and load_checkpoint(dead / CKPT_NAME).progress.iter == FAST["train.max_iters"]
    assert (tmp_path / "elsewhere").read_text() == "the user's own\n"


def test_hydra_as_a_file_in_out_dir_is_one_line_for_a_new_run_and_a_resume(
    trained_run: Path, tmp_path: Path, corpus_path: Path
) -> None:
    """Its mkdir was a traceback (FileExistsError), after .lock and train.log were made."""
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    fresh.mkdir()
    shutil.copytree(trained_run, resumed)
    shutil.rmtree(resumed / ".hydra")
    resume = [f"out_dir={resumed}", "resume=true", "resume_with_changes=true", "train.max_iters=70"]
    for run, args in ((fresh, tiny_run_overrides(tmp_path, corpus_path, **FAST, out_dir=fresh)), (resumed, resume)):
        (run / ".hydra").write_text("not Hydra's folder\n")
        before = {p: p.read_bytes() for p in run.iterdir()}
        result = run_in_process("train.py", args, tmp_path)
        assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
            f"error: {run / '.hydra'} is not a directory; a run keeps Hydra's record of its command in that folder: "
            "remove it")
        assert {p: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.parametrize("name", [LOCK_NAME, LOG_NAME, ".hydra/config.yaml", "config.yaml"])
def test_a_disk_full_at_start_is_one_line_and_leaves_no_run_directory(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """No inodes left for .lock was a traceback; a full disk at Hydra's record left .hydra/, .lock and an empty
    train.log."""
    run, no_room = tmp_path / "run", OSError(errno.ENOSPC, "No space left on device")
    opened, lock = open, common.files.FileLock

    def full(path: Path, *args: object, **kwargs: object) -> object:
        if Path(path) in (run / name, run / f"{name}.tmp"):
            raise no_room
        return (lock if Path(path).name == LOCK_NAME else opened)(path, *args, **kwargs)

    monkeypatch.setattr(common.files, "open", full, raising=False)
    monkeypatch.setattr(common.files, "FileLock", full)
    result = run_in_process("train.py", tiny_run_overrides(tmp_path, corpus_path, **FAST), tmp_path)
    where = re.escape(str((run / name).parent))
    assert result.returncode == 2 and re.fullmatch(rf"error: {re.escape(str(run / name))} not written: the disk "
                                                   rf"holding {where} is full \([\d,.]+ MiB free\)\n", result.stderr)
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_attention_dir_on_a_full_disk_is_one_line(trained_run: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    monkeypatch.setattr(np, "savez", mock.Mock(side_effect=OSError(errno.ENOSPC, "No space left on device")))
    maps = tmp_path / "maps"
    result = run_in_process("sample.py", [f"out_dir={trained_run}", "max_new_tokens=20", "num_samples=1",
                                          f"attention_dir={maps}"], tmp_path)
    assert result.returncode == 2 and re.fullmatch(rf"error: {re.escape(str(maps / 'attention.npz'))} not written: "
                                                   r"the disk holding .* is full \([\d,.]+ MiB free\)\n", result.stderr)
    assert list(maps.iterdir()) == []


def test_attention_dir_never_overwrites_the_users_files(trained_run: Path, tmp_path: Path) -> None:
    """A file sample.py didn't write stops it before any work; its own output from an earlier run is replaced, and so
    is a link named like it (maps/attention_layer0.png -> a file elsewhere: sample.py wrote through it, destroying
    that file)."""
    maps, mine = tmp_path / "maps", tmp_path / "mine"
    maps.mkdir()
    mine.mkdir()
    for name in ("attention_layer0.png", "attention.npz"):
        (mine / name).write_text("the user's own")
        (maps / name).symlink_to(mine / name)
    args = [f"out_dir={trained_run}", "max_new_tokens=20", "num_samples=1"]
    for _ in range(2):  # ours: written again
        assert run_in_process("sample.py", [*args, f"attention_dir={maps}"], tmp_path).returncode == 0
    assert [(p.read_text(), p.is_symlink()) for p in sorted(mine.iterdir())] == [("the user's own", False)] * 2
    assert not any(p.is_symlink() for p in maps.iterdir()) and (maps / "attention_layer0.png").stat().st_size > 1000
    for name, content in (("index.html", "<html>my homepage</html>"), ("notes.txt", "mine")):
        theirs = tmp_path / name.replace(".", "_")
        theirs.mkdir()
        (theirs / name).write_text(content)
        result = run_in_process("sample.py", [*args, f"attention_dir={theirs}"], tmp_path)
        assert f"holds files sample.py didn't write ({name}" in refused(result) and result.stdout == ""
        assert (theirs / name).read_text() == content and len(list(theirs.iterdir())) == 1
    (tmp_path / "link").symlink_to(tmp_path / "notes_txt" / "notes.txt")  # under a link to a file: one line too
    result = run_in_process("sample.py", [*args, f"attention_dir={tmp_path / 'link' / 'maps'}"], tmp_path)
    assert "is a file, not a directory" in refused(result)


def test_data_dir_never_replaces_a_meta_json_it_did_not_write(tmp_path: Path, corpus_path: Path) -> None:
    """Its own, damaged or from other settings: prepared again or refused, in tests/test_data.py."""
    data = tmp_path / "data"
    data.mkdir()
    for content in ('{"vocab_size": 50257, "note": "my own dataset"}', '["a list"]'):
        (data / "meta.json").write_text(content)
        (data / "train.bin").write_bytes(b"\x01\x02")
        with pytest.raises(DataError, match=r"holds a meta.json this project didn't write; .* name another data.dir"):
            ensure_prepared(DataConfig(input=str(corpus_path), dir=str(data)))
        assert (data / "meta.json").read_text() == content and (data / "train.bin").read_bytes() == b"\x01\x02"


def test_a_checkpoint_s_data_dir_at_another_tool_s_dataset_is_refused_on_resume(
    trained_run: Path, tmp_path: Path
) -> None:
    """A crafted checkpoint's saved data.dir naming nanoGPT's train.bin, val.bin and meta.pkl: they were replaced."""
    nanogpt, run = tmp_path / "nanogpt", tmp_path / "run"
    nanogpt.mkdir()
    for name in ("train.bin", "val.bin", "meta.pkl"):
        (nanogpt / name).write_bytes(b"\x01\x02")
    shutil.copytree(trained_run, run)
    raw = torch.load(run / CKPT_NAME, weights_only=True)
    raw["config"]["data"]["dir"] = str(nanogpt)
    torch.save(raw, run / CKPT_NAME)
    result = run_in_process("train.py", [f"out_dir={run}", "resume=true"], tmp_path)
    assert refused(result).startswith(f"error: data.dir={nanogpt} holds token files without the meta.json")
    assert sorted((p.name, p.read_bytes()) for p in nanogpt.iterdir()) == [
        ("meta.pkl", b"\x01\x02"), ("train.bin", b"\x01\x02"), ("val.bin", b"\x01\x02")]
