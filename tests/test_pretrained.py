"""GPT-2 weights through Hugging Face transformers, both ways, offline: small random GPT2LMHeadModels stand in
for OpenAI's, and the logits must match. Every test name contains `pretrained` (pytest -k pretrained)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import CheckpointError, ConfigError
from common.files import CKPT_NAME
from conftest import (
    REPO,
    TINY_BPE,
    compose_config,
    refused,
    run_in_process,
    run_script,
    save_checkpoint,
    tiny_encoding,
    tiny_run_overrides,
)
from data.prepare import TokenFiles, every_window
from model import GPT, GPTConfig
from model.checkpoint import Checkpoint, load_checkpoint
from model.hf_gpt2 import PRETRAINED, PretrainedError, gpt_from_hf, hf_from_gpt, load_pretrained
from train import train

if TYPE_CHECKING:  # imported in the tests that need it: it takes seconds
    from transformers import GPT2LMHeadModel

SHAPE = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=97)
N_POSITIONS = 64


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough (logits ~ 2) that one misplaced, untransposed or dropped shows far above 1e-5."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.eval()


def _hf_class() -> type[GPT2LMHeadModel]:
    """transformers' GPT-2, imported where a test needs it: the import takes seconds, which collection would cost."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel


def _hf_model(seed: int = 0, **config: object) -> GPT2LMHeadModel:
    from transformers import GPT2Config

    hf_config = GPT2Config(**{**SHAPE, "n_positions": N_POSITIONS, "bos_token_id": None, "eos_token_id": None} | config)
    return _randomize(_hf_class()(hf_config), seed)


def _gpt(seed: int = 0, **config: object) -> GPT:
    return _randomize(GPT(GPTConfig(**{**SHAPE, "block_size": N_POSITIONS, **config})), seed)


@torch.no_grad()
def _assert_same_logits(ours: GPT, theirs: GPT2LMHeadModel, length: int = N_POSITIONS) -> None:
    idx = torch.randint(SHAPE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("hf_activation", "activation", "hf_attn", "attn_impl"), [  # each pair of attentions
    ("gelu_new", "gelu_tanh", "eager", "flash"), ("gelu_pytorch_tanh", "gelu_tanh", "sdpa", "math"),
    ("gelu", "gelu", "sdpa", "flash"), ("gelu", "gelu", "eager", "math")])
def test_pretrained_import_matches_hf_logits(hf_activation: str, activation: str, hf_attn: str, attn_impl: str) -> None:
    hf_model = _hf_model(activation_function=hf_activation, attn_implementation=hf_attn)
    assert hf_model.config._attn_implementation == hf_attn
    model = gpt_from_hf(hf_model, attn_impl=attn_impl)
    assert not model.training and model.lm_head.weight is model.transformer.wte.weight
    assert (model.config.activation, model.config.block_size, model.config.bias) == (activation, N_POSITIONS, True)
    _assert_same_logits(model, hf_model)


@pytest.mark.parametrize("bias", [True, False])
def test_pretrained_export_matches_our_logits(bias: bool) -> None:
    """gelu here; gelu_tanh (as gelu_new) in the export script's test."""
    model = _gpt(bias=bias)
    hf_model = hf_from_gpt(model)
    config = hf_model.config
    assert not hf_model.training and hf_model.lm_head.weight is hf_model.transformer.wte.weight
    assert (config.activation_function, config.n_positions, config.layer_norm_epsilon, config.tie_word_embeddings) == (
        "gelu", N_POSITIONS, 1e-5, True)
    if not bias:
        assert not hf_model.transformer.h[0].mlp.c_fc.bias.any() and not hf_model.transformer.ln_f.bias.any()
    _assert_same_logits(model, hf_model)


def test_pretrained_round_trips_are_exact() -> None:
    model = _gpt(dropout=0.1)
    hf_model = hf_from_gpt(model)
    assert (hf_model.config.resid_pdrop, hf_model.config.embd_pdrop, hf_model.config.attn_pdrop) == (0.1, 0.1, 0.1)
    back = gpt_from_hf(hf_model, dropout=0.1)
    assert back.config == model.config
    hf_original = _hf_model()
    for original, returned in ((model, back), (hf_original, hf_from_gpt(gpt_from_hf(hf_original)))):
        assert all(torch.equal(returned.state_dict()[key], value) for key, value in original.state_dict().items())


def test_pretrained_weights_load_from_a_directory_with_the_settings_they_leave_open(tmp_path: Path) -> None:
    """load_pretrained's own path, as init_from takes it, without network; a shorter block_size keeps the first
    positions (nanoGPT's crop_block_size), to finetune on shorter windows; a sliding window, but not a new shape."""
    hf_model = _hf_model()
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_pretrained(str(tmp_path / "hf"), block_size=32, dropout=0.1, attn_impl="math")
    assert (model.config.block_size, model.config.dropout, model.config.attn_impl) == (32, 0.1, "math")
    assert model.transformer.wpe.weight.shape == (32, SHAPE["n_embd"])
    _assert_same_logits(model.eval(), hf_model, length=32)
    with pytest.raises(PretrainedError, match=f"block_size={N_POSITIONS + 1} exceeds the {N_POSITIONS} positions"):
        gpt_from_hf(hf_model, block_size=N_POSITIONS + 1)
    with pytest.raises(TypeError, match="n_layer"):
        gpt_from_hf(hf_model, n_layer=1)
    windowed = gpt_from_hf(hf_model, attn_window=4, window_pattern="S")
    with torch.no_grad():
        idx = torch.randint(SHAPE["vocab_size"], (1, 12))
        changed = (windowed(idx)[0] - model(idx)[0]).abs().amax(dim=-1)[0]
    assert torch.all(changed[:4] < 1e-5) and torch.all(changed[4:] > 1e-4)  # the window starts to bite at 4


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
        ({"scale_attn_weights": False}, "scale_attn_weights=False"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
        ({"n_inner": 64}, r"transformer.h.0.mlp.c_fc.weight has shape \(64, 32\), expected \(128, 32\)"),
        ({"add_cross_attention": True}, "transformer.h.0.crossattention.* is in only one of the two models"),
        ({"activation": "relu2"}, "activation='relu2' can't be exported"),  # and the other way
        ({"pos_emb": "rope"}, "pos_emb='rope' can't be exported"),
    ],
)
def test_pretrained_conversions_refuse_what_the_other_side_cannot_express(config: dict, refused: str) -> None:
    with pytest.raises(PretrainedError, match=refused):
        if {"activation", "pos_emb"} & config.keys():
            hf_from_gpt(GPT(GPTConfig(**SHAPE, block_size=16, **config)))
        else:
            gpt_from_hf(_hf_model(**config))


def test_pretrained_names_that_cannot_load_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PretrainedError, match="'gpt3'.*gpt2, gpt2-medium, gpt2-large, gpt2-xl"):
        load_pretrained("gpt3")
    with pytest.raises(PretrainedError, match=f"can't load '{tmp_path}'.*save_pretrained"):
        load_pretrained(str(tmp_path))  # a directory without weights
    _hf_model().save_pretrained(tmp_path / "partial")
    weights = load_file(tmp_path / "partial" / "model.safetensors")
    del weights["transformer.ln_f.weight"]  # from_pretrained would initialise it randomly, with a warning
    save_file(weights, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PretrainedError, match="no weights for transformer.ln_f.weight"):
        load_pretrained(str(tmp_path / "partial"))

    def offline(name: str, **kwargs: object) -> None:  # what from_pretrained raises without network or cache
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr("transformers.GPT2LMHeadModel.from_pretrained", offline)
    with pytest.raises(PretrainedError, match="can't load 'gpt2'.*network.*save_pretrained") as info:
        load_pretrained(PRETRAINED[0])
    assert "\n" not in str(info.value)
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: import transformers now fails
    for call in (lambda: load_pretrained("gpt2"), lambda: hf_from_gpt(GPT(GPTConfig(**SHAPE, block_size=16)))):
        with pytest.raises(PretrainedError, match=r'pip install "\.\[hf\]"'):
            call()


def _write_run(run_dir: Path, model: GPT) -> None:
    run_dir.mkdir()
    save_checkpoint(run_dir / CKPT_NAME, Checkpoint(model.config, model.state_dict(), tokenizer={}))


def test_pretrained_export_script_writes_a_model_hf_loads_and_refusals_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("export_hf", REPO / "scripts" / "export_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = _gpt(activation="gelu_tanh")
    _write_run(tmp_path / "run", model)
    script.main([str(tmp_path / "run"), str(tmp_path / "hf")])
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'hf'}: GPT-2 with 2 layers")
    with pytest.raises(SystemExit) as exit_info:
        script.main([str(tmp_path / "none"), str(tmp_path / "other")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "no checkpoint" in err and err.count("\n") == 1
    hf_model = _hf_class().from_pretrained(tmp_path / "hf")
    assert hf_model.config.activation_function == "gelu_new"
    _assert_same_logits(model, hf_model)
    # As a user runs it, from another directory: its own process.
    _write_run(tmp_path / "relu2", GPT(GPTConfig(**SHAPE, block_size=16, activation="relu2")))
    result = run_script("scripts/export_hf.py", [str(tmp_path / "relu2"), str(tmp_path / "other")], cwd=tmp_path)
    assert "activation='relu2'" in refused(result) and not (tmp_path / "other").exists()


def _saved_hf_model(tmp_path: Path, vocab_size: int) -> Path:
    _hf_model(seed=3, vocab_size=vocab_size).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_pretrained_init_from_trains_from_the_hf_weights_and_resumes(tmp_path: Path, corpus_path: Path) -> None:
    """init_from: the first evaluation is the HF model's own loss on the val split; then it finetunes and resumes."""
    hf_dir = _saved_hf_model(tmp_path, tiny_encoding().n_vocab)
    extra = {"data.tokenizer": TINY_BPE, "init_from": hf_dir, "train.full_val": True, "train.max_iters": 4}
    result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **extra)))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    first_val = next(r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r)
    hf_model = _hf_class().from_pretrained(hf_dir).eval()
    losses, count = 0.0, 0
    with torch.no_grad():
        for x, y in every_window(TokenFiles((tmp_path / "data" / "val.bin",)), 64, 32):
            losses += torch.nn.functional.cross_entropy(hf_model(x).logits.flatten(0, 1), y.flatten()).item() * len(x)
            count += len(x)
    assert first_val == pytest.approx(losses / count, abs=1e-5)
    ckpt = load_checkpoint(tmp_path / "run" / CKPT_NAME)
    assert ckpt.model_config.block_size == 32 and ckpt.model_config.activation == "gelu_tanh"
    # A finetune resumes with the pretrained shape, though the config's model group is the default's.
    overrides = tiny_run_overrides(
        tmp_path, corpus_path, **{**extra, "resume": True, "resume_with_changes": True, "train.max_iters": 6}
    )
    assert result.iters == 4 and train(compose_config(overrides)).iters == 6
    for change, message in (("model.attn_window=4", "attn_window: None -> 4"), ("model.block_size=16", "32 -> 16")):
        with pytest.raises(CheckpointError, match=message):  # what init_from took from the config is kept too
            train(compose_config([*overrides, change]))
    other = _saved_hf_model(tmp_path / "other", vocab_size=97)
    with pytest.raises(ConfigError, match=r"init_from=.* vocabulary of 97 tokens"):  # not the data's
        train(compose_config(tiny_run_overrides(tmp_path / "other", corpus_path, init_from=other)))


@pytest.mark.skipif(not os.environ.get("TIKTOKEN_CACHE_DIR"), reason="GPT-2 ranks not provided (set "
                    "TIKTOKEN_CACHE_DIR as .ci/run does)")
def test_pretrained_sample_py_samples_from_an_hf_directory_and_says_in_one_line_when_offline(tmp_path: Path) -> None:
    """sample.py init_from=...: the pretrained model with GPT-2's BPE (r50k_base); gpt2 offline and not cached."""
    hf_dir = _saved_hf_model(tmp_path, vocab_size=50257)
    args = [f"init_from={hf_dir}", "start=Hello", "max_new_tokens=5", "num_samples=1"]
    result = run_in_process("sample.py", args, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("Hello"), result.stderr
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run([sys.executable, str(REPO / "sample.py"), "init_from=gpt2"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert refused(result).startswith("error: can't load 'gpt2'") and result.stdout == ""
