"""Decoding controls: greedy at temperature 0, and the top_k / top_p / min_p cut-offs keep exactly the tokens their
definitions name, the most likely one always."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from conftest import run_in_process
from inference.sampling import SampleConfig
from model import GPT, GPTConfig
from model.gpt import Decoding, row_generators

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
        (Decoding(top_k=2, top_p=0.6), {1}),  # top_p on what top_k left, renormalised: 0.5/0.8 reaches 0.6
    ],
)
def test_each_cut_off_keeps_the_tokens_its_definition_names(decoding: Decoding, tokens: set[int]) -> None:
    assert kept(decoding) == tokens


def test_top_p_stops_at_the_exact_boundary() -> None:
    cut = Decoding(top_p=0.7).cut(torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1]]).log())
    assert (cut > float("-inf")).sum().item() == 2  # 0.5 + 0.2 reaches 0.7: no third token


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-30])
def test_a_tiny_top_p_keeps_the_likeliest_token_as_greedy_would(top_p: float) -> None:
    """1e-46 and 5e-324 round to 0 in float32: every token was dropped and multinomial raised (sample.py's
    traceback, the server's 500)."""
    rows = torch.tensor([[3.0, 9.5, -2.0, 9.4], [0.0, -1.0, 5.0, 4.0]])
    picked = Decoding(top_p=top_p).next_token(rows, row_generators(7, 2))
    assert picked.tolist() == Decoding(temperature=0).next_token(rows).tolist() == [[1], [2]]


def test_sample_py_decodes_a_tiny_top_p_as_greedy(trained_run: Path, tmp_path: Path) -> None:
    common = [f"out_dir={trained_run}", "start=ROMEO:", "max_new_tokens=12", "num_samples=1", "device=cpu"]
    tiny = run_in_process("sample.py", [*common, "top_p=1e-46"], tmp_path)
    greedy = run_in_process("sample.py", [*common, "temperature=0"], tmp_path)
    assert tiny.returncode == greedy.returncode == 0, tiny.stderr
    assert tiny.stdout == greedy.stdout


def test_half_precision_logits_are_decoded_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    original = Decoding.cut
    monkeypatch.setattr(Decoding, "cut", lambda self, logits: seen.append(logits.dtype) or original(self, logits))
    Decoding(top_p=0.9).next_token(logits().to(torch.bfloat16))
    assert seen == [torch.float32]


def test_min_p_is_relative_to_each_rows_own_most_likely_token() -> None:
    rows = torch.tensor([[0.6, 0.3, 0.1], [0.22, 0.28, 0.5]]).log()  # thresholds 0.24 and 0.2
    keep = Decoding(min_p=0.4).cut(rows) > float("-inf")
    assert keep.tolist() == [[True, True, False], [True, True, True]]


def test_sample_py_passes_top_p_and_min_p_to_the_model(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from common.config import typed_config
    from inference.sampling import load_sampler

    seen = []
    monkeypatch.setattr(Decoding, "cut", lambda self, logits: seen.append((self.top_p, self.min_p)) or logits)
    sampler = load_sampler(typed_config(SampleConfig(out_dir=str(trained_run), device="cpu"), SampleConfig))
    sampler.generate(sampler.encode_prompt("The"), 1, 3, Decoding(1.0, None, 0.9, 0.05))
    assert seen == [(0.9, 0.05)] * 3


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


def test_a_tiny_temperature_is_the_argmax_not_a_crash() -> None:
    """Accepted values never overflow: 1e-40 divides the logits' differences from the largest, so the others go
    to -inf and the largest stays 0 (dividing the logits themselves made it inf, and softmax NaN)."""
    rows = torch.tensor([[3.0, 9.5, -2.0, 9.4], [0.0, -1.0, 5.0, 4.0]])
    generators = row_generators(7, 2)
    for temperature in (1e-40, 1e-300, 5e-324):
        picked = Decoding(temperature, top_p=0.9, min_p=0.5).next_token(rows, generators)
        assert picked.tolist() == [[1], [2]]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("temperature", -0.1, "temperature=-0.1 must be >= 0.0; 0 means greedy decoding"),
        ("top_p", 1.5, "top_p=1.5 must be <= 1.0; null means no cut-off"),
        ("top_p", 0.0, "top_p=0.0 must be > 0.0; null means no cut-off"),
        ("min_p", 2.0, "min_p=2.0 must be <= 1.0"),
        ("seed", -5, "seed=-5 must be >= 0"),
        ("seed", 99999999999999999999, "seed=99999999999999999999 must be <= 9223372036854775807"),
    ],
)
def test_sample_config_refuses_decoding_values_out_of_range(key: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SampleConfig(out_dir="run", **{key: value})


def test_sample_py_at_temperature_0_prints_the_same_sample_whatever_the_seed(trained_run: Path, tmp_path: Path) -> None:
    outputs = []
    for seed in (1, 2):
        args = [f"out_dir={trained_run}", "temperature=0", "top_k=null", "num_samples=2", "max_new_tokens=30"]
        result = run_in_process("sample.py", [*args, f"seed={seed}"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
        assert result.stderr == "warning: greedy decoding: the 2 samples would be the same text, so one is drawn\n"
    assert outputs[0] == outputs[1] and outputs[0].count("---------------\n") == 1  # one sample, not two alike
