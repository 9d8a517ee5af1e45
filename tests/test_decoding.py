"""Decoding controls: greedy at temperature 0, and the top_k / top_p / min_p cut-offs keep exactly the tokens their
definitions name, the most likely one always."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from conftest import run_script
from model import GPT, GPTConfig
from model.decoding import Decoding
from training.schema import SampleConfig

PROBS = [0.05, 0.5, 0.15, 0.3]  # token 1 most likely, then 3, 2, 0


def logits() -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in PROBS]])


def kept(decoding: Decoding) -> set[int]:
    return {i for i, value in enumerate(decoding.cut(logits())[0].tolist()) if value > float("-inf")}


@pytest.mark.parametrize(
    ("decoding", "tokens"),
    [
        (Decoding(), {0, 1, 2, 3}),
        (Decoding(top_k=2), {1, 3}),
        (Decoding(top_k=10), {0, 1, 2, 3}),
        (Decoding(top_p=0.5), {1}),  # 0.5 alone reaches 0.5
        (Decoding(top_p=0.7), {1, 3}),  # 0.5 + 0.3 = 0.8 >= 0.7
        (Decoding(top_p=0.9), {1, 2, 3}),
        (Decoding(top_p=1.0), {0, 1, 2, 3}),
        (Decoding(top_p=1e-6), {1}),  # the most likely token always stays
        (Decoding(min_p=0.5), {1, 3}),  # at least 0.25
        (Decoding(min_p=0.2), {1, 2, 3}),  # at least 0.1
        (Decoding(min_p=1.0), {1}),
        (Decoding(top_k=3, top_p=0.7, min_p=0.5), {1, 3}),
    ],
)
def test_each_cut_off_keeps_the_tokens_its_definition_names(decoding: Decoding, tokens: set[int]) -> None:
    assert kept(decoding) == tokens


def test_draws_never_leave_the_nucleus_and_follow_its_renormalised_probabilities() -> None:
    torch.manual_seed(0)
    draws = torch.cat([Decoding(top_p=0.7).next_token(logits().expand(2000, -1)) for _ in range(5)]).flatten()
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.5 / 0.8) < 0.02


def test_temperature_0_is_the_argmax_and_ignores_the_seed() -> None:
    assert Decoding(temperature=0).next_token(logits()).tolist() == [[1]]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, block_size=16, n_layer=2, n_head=2, n_embd=16))
    prompt = torch.tensor([[3, 1, 4]])
    greedy = model.generate(prompt, 20, temperature=0)
    torch.manual_seed(123)
    assert torch.equal(greedy, model.generate(prompt, 20, temperature=0))
    assert torch.equal(greedy, model.generate(prompt, 20, top_k=1))  # the old way to be greedy


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("temperature", -0.1, "temperature=-0.1 must be >= 0.0; 0 means greedy decoding"),
        ("top_p", 1.5, "top_p=1.5 must be <= 1.0; null means no cut-off"),
        ("top_p", 0.0, "top_p=0.0 must be > 0.0; null means no cut-off"),
        ("min_p", 2.0, "min_p=2.0 must be <= 1.0"),
    ],
)
def test_sample_config_refuses_decoding_values_out_of_range(key: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SampleConfig(out_dir="run", **{key: value})


def test_sample_py_at_temperature_0_prints_the_same_sample_whatever_the_seed(trained_run: Path, tmp_path: Path) -> None:
    outputs = []
    for seed in (1, 2):
        args = [f"out_dir={trained_run}", "temperature=0", "top_k=null", "num_samples=2", "max_new_tokens=30"]
        result = run_script("sample.py", [*args, f"seed={seed}"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    first, second = outputs[0].split("---------------\n")[:2]
    assert outputs[0] == outputs[1] and first == second
