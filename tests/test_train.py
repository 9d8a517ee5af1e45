import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from common.errors import CheckpointError, ConfigError
from common.files import CKPT_NAME
from conftest import CONFIGS, MODERN, REACHES_TARGET, TINY_BPE, compose_config, sample_py, tiny_run_overrides
from model import GPTConfig
from model.checkpoint import load_checkpoint
from train import train
from training.trainer import lr_at

TEN = {"train.max_iters": 10}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("group", ["model", "data", "experiment"])
def test_every_preset_composes(group: str) -> None:
    names = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))
    assert names
    for name in names:
        OmegaConf.to_container(compose_config([f"{group}={name}"]), resolve=True, throw_on_missing=True)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("shakespeare_char_cpu", {  # nanoGPT's recipe
            "model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 64, "model.dropout": 0.0,
            "data.tokenizer": "char", "train.batch_size": 12, "train.max_iters": 2000, "train.lr_decay_iters": None,
            "train.warmup_iters": 100, "train.learning_rate": 1e-3, "train.min_lr": 1e-4, "train.compile": False}),
        ("speedrun_cpu", {  # the record's recipe as docs/speedrun.md states it; one evaluation, which stops it
            **{f"model.{key}": value for key, value in MODERN.items()},
            "model.n_embd": 64, "model.block_size": 64, "model.n_head": 2, "model.n_layer": 4,
            "train.optimizer": "muon", "train.muon_momentum": 0.8, "train.muon_momentum_warmup": 0,
            "train.learning_rate": 9e-3, "train.warmup_iters": 20, "train.batch_size": 16, "train.grad_clip": 0.0,
            "train.max_iters": 250, "train.lr_decay_iters": None, "train.eval_from": 225, "train.eval_interval": 225,
            "train.full_val": True, "train.target_val_loss": 1.89, "train.eval_iters": 20}),
        ("speedrun_gpu", {  # on an H200 val bottomed out near iteration 750-1000, then rose (issue 55)
            "train.max_iters": 1000, "train.lr_decay_iters": None, "train.eval_from": 500, "train.eval_interval": 125,
            "train.full_val": True, "train.target_val_loss": 1.47, "train.eval_iters": 20}),
        ("gpt2", {"model.vocab_multiple": 64, "model.bias": False}),  # GPT-2's 50257 tokens padded to 50304
        ("gpt2_speedrun", {"model.vocab_multiple": 64, "model.bias": False}),
    ],
)
def test_a_preset_holds_its_documented_recipe(preset: str, expected: dict) -> None:
    cfg = compose_config([f"experiment={preset}"])
    assert {key: OmegaConf.select(cfg, key) for key in expected} == expected


def test_command_line_overrides_beat_the_preset() -> None:
    cfg = compose_config(["experiment=shakespeare_char_cpu", "train.max_iters=7", "model=shakespeare"])
    assert cfg.train.max_iters == 7
    assert (cfg.model.n_embd, cfg.model.block_size) == (384, 256)  # model= replaces the preset's model group
    assert (compose_config([]).model.pos_emb, compose_config([]).model.activation) == ("learned", "gelu")


def test_every_model_option_but_vocab_size_is_a_config_key_in_gptconfigs_order() -> None:
    assert list(compose_config([]).model) == [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]


def test_learning_rate_schedules_warm_up_then_decay_or_hold_and_cool_down_to_min_lr() -> None:
    cosine = [lr_at(s, 1e-3, 1e-4, 10, 100) for s in range(120)]
    assert cosine[0] == pytest.approx(1e-3 / 11) and cosine[9] == pytest.approx(1e-3 * 10 / 11)
    assert cosine[10] == pytest.approx(1e-3) and cosine[55] == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert all(a >= b for a, b in zip(cosine[10:], cosine[11:], strict=False)) and cosine[100:] == [1e-4] * 20
    wsd = [lr_at(s, 1e-3, 1e-4, 10, 100, "wsd", 0.25) for s in range(120)]
    assert wsd[:10] == cosine[:10] and wsd[10:76] == [1e-3] * 66  # the plateau, up to the cooldown at 100 - 25
    assert wsd[85] == pytest.approx(1e-3 - 10 / 25 * 9e-4) and wsd[99] == pytest.approx(1e-4 + 9e-4 / 25)
    assert wsd[100:] == [1e-4] * 20
    # a cooldown longer than what follows warmup starts at its end
    assert lr_at(10, 1e-3, 0.0, 10, 20, "wsd", 1.0) == 1e-3 and lr_at(15, 1e-3, 0.0, 10, 20, "wsd", 1.0) == 5e-4


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_short_real_run_learns_and_writes_its_run_directory(tmp_path: Path, corpus_path: Path, optimizer: str) -> None:
    keys = {"train.optimizer": optimizer, "model.n_embd": 64, "model.block_size": 64, "train.max_iters": 150,
            "train.eval_interval": 50, "train.eval_iters": 10, "train.learning_rate": 3e-3, "train.warmup_iters": 10}
    result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
    vocab = json.loads((tmp_path / "data" / "meta.json").read_text())["vocab_size"]
    assert result.iters == 150 and result.val_loss < 0.7 * math.log(vocab)

    run = tmp_path / "run"
    records = _records(run)
    evals, logs = [r for r in records if "val_loss" in r], [r for r in records if "lr" in r]
    settings = {"device": "cpu", "train.dtype": "float32", "train.compile": False, "threads": torch.get_num_threads()}
    assert records[0] == {"iter": 0, "settings": settings}  # what the run resolved, first
    assert len(records) == 1 + len(evals) + len(logs)
    assert [r["iter"] for r in evals] == [0, 50, 100, 150] and evals[-1]["val_loss"] == pytest.approx(result.val_loss)
    assert evals[0]["val_loss"] == pytest.approx(math.log(vocab), abs=0.3)
    assert [r["iter"] for r in logs] == list(range(5, 151, 5))
    assert all(r["tokens_per_sec"] > 0 and r["lr"] > 0 and math.isfinite(r["train_loss"]) for r in logs)
    assert OmegaConf.load(run / "config.yaml").train.max_iters == 150

    ckpt = load_checkpoint(run / CKPT_NAME)
    assert ckpt.progress.iter == 150 and ckpt.config["model"]["n_embd"] == 64
    assert ckpt.progress.best_val_loss == pytest.approx(min(r["val_loss"] for r in evals))
    assert ckpt.tokenizer["kind"] == "char" and ckpt.model_config.vocab_size == vocab


def test_resume_continues_and_drops_the_records_after_the_checkpoint(tmp_path: Path, corpus_path: Path) -> None:
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **TEN)))
    first = len(_records(tmp_path / "run"))
    saved_elapsed = load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.elapsed_s
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # what a run killed after its last checkpoint leaves
        f.write(json.dumps({"iter": 15, "train_loss": 9.0, "lr": 1e-3, "elapsed_s": 99.0}) + "\n")
    more = {"resume_with_changes": True, "train.max_iters": 30}
    assert train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, **more))).iters == 30
    records = _records(tmp_path / "run")
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 30
    assert not any(r.get("train_loss") == 9.0 for r in records)
    assert [r["iter"] for r in records[first:] if "val_loss" in r] == [20, 30]
    iters = [r["iter"] for r in records if "lr" in r]  # the log lines
    assert iters == sorted(iters) and len(iters) == len(set(iters))
    assert records[-1]["elapsed_s"] > saved_elapsed  # wall time continues across the resume


def _another_mapping(text: str) -> str:
    """As many characters as `text`, one of them another: the same vocabulary size, tokenized differently."""
    return text.replace("e", next(c for c in "~^`|@#$%&*" if c not in text))


@pytest.mark.parametrize(
    ("keys", "other_text", "message"),
    [
        ({"out_dir": "/no/such/run"}, None, "no checkpoint at /no/such/run"),
        ({"model.n_layer": 3}, None, "n_layer: 2 -> 3"),
        ({"model.n_layer": 3, "resume_with_changes": True}, None, "n_layer: 2 -> 3"),  # the shape never changes
        ({"train.optimizer": "muon"}, None, "^resume=true with train.optimizer=muon, but the checkpoint's"),
        ({"resume_with_changes": True}, lambda text: "abc " * 2000,
         "the data's vocabulary has 4 tokens and the checkpoint's model"),
        ({"resume_with_changes": True}, _another_mapping, "tokenized differently"),
    ],
)
def test_resume_refuses_what_would_not_continue_the_run(
    tmp_path: Path, corpus_path: Path, keys: dict, other_text: object, message: str
) -> None:
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **TEN)))
    corpus = corpus_path
    if other_text is not None:
        corpus = tmp_path / "other.txt"
        corpus.write_text(other_text(corpus_path.read_text(encoding="utf-8")), encoding="utf-8")
        keys = {**keys, "data.dir": tmp_path / "other_data"}
    with pytest.raises(CheckpointError, match=message) as info:
        train(compose_config(tiny_run_overrides(tmp_path, corpus, resume=True, **keys)))
    assert other_text is None or "overrides" not in str(info.value)  # the data's fault: it names the data


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_takes_free_keys_as_given_and_new_optimizer_settings_when_asked(
    tmp_path: Path, corpus_path: Path, optimizer: str
) -> None:
    keys = {"train.optimizer": optimizer, **TEN}
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
    free = {"model.attn_impl": "math", "train.eval_iters": 3}  # allowed without resume_with_changes
    assert train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, **keys, **free))).iters == 10
    changed = {**keys, "train.max_iters": 20, "train.weight_decay": 0.5, "train.beta2": 0.9, "model.dropout": 0.1}
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, resume_with_changes=True, **changed)))
    groups = load_checkpoint(tmp_path / "run" / CKPT_NAME).optimizer["param_groups"]
    assert groups[0]["weight_decay"] == 0.5 and groups[1]["weight_decay"] == 0.0
    adamw, muon = groups[:2], groups[2:]  # Muon's matrices: their own group, after AdamW's two
    assert all(tuple(g["betas"]) == (0.9, 0.9) and "momentum" not in g for g in adamw)
    assert all(g["weight_decay"] == 0.5 and "betas" not in g for g in muon) and len(muon) == (optimizer == "muon")


def test_a_device_this_machine_lacks_is_refused(tmp_path: Path, corpus_path: Path) -> None:
    """Every other bad value is refused before the run starts: test_config.py's RULES."""
    device = "mps" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ConfigError, match=f"device={device} is not available on this machine; use device"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, device=device)))


def test_bpe_run_trains_and_samples(tmp_path: Path, corpus_path: Path, capsys: pytest.CaptureFixture) -> None:
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"data.tokenizer": TINY_BPE})))
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).tokenizer == {"kind": "bpe", "encoding": TINY_BPE}
    capsys.readouterr()
    sample_py([f"out_dir={tmp_path / 'run'}", "start=The", "num_samples=2", "max_new_tokens=12", "device=cpu"])
    samples = capsys.readouterr().out.split("\n---------------\n")
    assert len(samples) == 3 and all(s.startswith("The") and len(s) > len("The") for s in samples[:2])


def test_wandb_offline_run_leaves_its_files_in_the_run_directory(tmp_path: Path, corpus_path: Path) -> None:
    extra = {"wandb.enabled": True, "wandb.mode": "offline", "wandb.run_name": "tiny", "wandb.tags": "[tiny,test]",
             "wandb.group": "tests", **TEN}
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **extra)))
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    (table,) = run.glob("files/media/table/samples_*.table.json")
    assert list(run.glob("run-*.wandb"))
    table = json.loads(table.read_text())
    assert table["columns"] == ["prompt", "sample"] and len(table["data"]) == 3
    assert all(len(sample) == 201 and sample.startswith(prompt) for prompt, sample in table["data"])


def test_a_compiled_run_saves_the_plain_module_keys(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, backend="eager"))  # fast, same wrapper
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.compile": True, **TEN})))
    keys = load_checkpoint(tmp_path / "run" / CKPT_NAME).model.keys()
    assert "lm_head.weight" in keys and not any(k.startswith("_orig_mod.") for k in keys)


def test_a_run_stops_at_its_target_val_loss_and_a_resume_does_nothing_more(tmp_path: Path, corpus_path: Path) -> None:
    result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **REACHES_TARGET)))
    evals = [r for r in _records(tmp_path / "run") if "val_loss" in r]
    assert result.iters < 400 and result.iters == evals[-1]["iter"]
    assert evals[-1]["val_loss"] <= 3.6 and evals[-1]["time_to_target_s"] == evals[-1]["elapsed_s"]
    assert all(r["val_loss"] > 3.6 and "time_to_target_s" not in r for r in evals[:-1])
    again = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, **REACHES_TARGET)))
    assert again.iters == result.iters
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("time_to_target_s") == 1

