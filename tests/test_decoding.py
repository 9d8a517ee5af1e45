"""Decoding controls: greedy at temperature 0, and the top_k / top_p / min_p cut-offs keep exactly the tokens their
definitions name, the most likely one always."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_in_process
from model.gpt import Decoding, row_generators

LOGITS = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()  # token 1 most likely, then 3, 2, 0


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
    assert {i for i, value in enumerate(decoding.cut(LOGITS)[0].tolist()) if value > float("-inf")} == tokens


def test_top_p_stops_at_the_exact_boundary_and_min_p_is_relative_to_each_rows_own_best() -> None:
    cut = Decoding(top_p=0.7).cut(torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1]]).log())
    assert (cut > float("-inf")).sum().item() == 2  # 0.5 + 0.2 reaches 0.7: no third token
    rows = torch.tensor([[0.6, 0.3, 0.1], [0.22, 0.28, 0.5]]).log()  # thresholds 0.24 and 0.2
    assert (Decoding(min_p=0.4).cut(rows) > float("-inf")).tolist() == [[True, True, False], [True, True, True]]


@pytest.mark.parametrize(
    "decoding",
    [Decoding(top_p=p) for p in (1e-46, 5e-324, 1e-30)]
    + [Decoding(t, top_p=0.9, min_p=0.5) for t in (0, 1e-40, 5e-324)]
    + [Decoding(top_k=1)],
)
def test_temperature_0_top_k_1_or_a_vanishing_top_p_or_temperature_draws_the_argmax_not_a_crash(
    decoding: Decoding,
) -> None:
    """top_p 1e-46 is 0 in float32, yet the most likely token stays; a temperature of 1e-40 divides the logits'
    differences from the largest, so the others go to -inf and the largest stays 0 (not inf, and softmax NaN)."""
    rows = torch.tensor([[3.0, 9.5, -2.0, 9.4], [0.0, -1.0, 5.0, 4.0]])
    assert decoding.next_token(rows, row_generators(7, 2)).tolist() == [[1], [2]]


def test_half_precision_logits_are_decoded_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    original = Decoding.cut
    monkeypatch.setattr(Decoding, "cut", lambda self, logits: seen.append(logits.dtype) or original(self, logits))
    Decoding(top_p=0.9).next_token(LOGITS.to(torch.bfloat16))
    assert seen == [torch.float32]


def test_draws_never_leave_the_nucleus_and_follow_its_renormalised_probabilities() -> None:
    torch.manual_seed(0)
    draws = torch.cat([Decoding(top_p=0.7).next_token(LOGITS.expand(2000, -1)) for _ in range(5)]).flatten()
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.5 / 0.8) < 0.02


def test_sample_py_decodes_greedily_whatever_the_seed_and_passes_top_p_and_min_p_on(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """temperature=0 draws one sample, not several alike, the same for any seed."""
    args = [f"out_dir={trained_run}", "top_k=null", "max_new_tokens=30", "num_samples=2"]
    greedy = [run_in_process("sample.py", [*args, "temperature=0", f"seed={s}"], tmp_path) for s in (1, 2)]
    for result in greedy:
        assert result.stderr == "warning: greedy decoding: the 2 samples would be the same text, so one is drawn\n"
    assert greedy[0].stdout == greedy[1].stdout and greedy[0].stdout.count("---------------\n") == 1

    seen = []
    monkeypatch.setattr(Decoding, "cut", lambda self, logits: seen.append((self.top_p, self.min_p)) or logits)
    result = run_in_process("sample.py", [*args[:2], "top_p=0.9", "min_p=0.05", "max_new_tokens=3"], tmp_path)
    assert result.returncode == 0 and seen == [(0.9, 0.05)] * 3, result.stderr
