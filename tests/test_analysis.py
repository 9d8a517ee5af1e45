"""Attention maps and the causality demonstration, on a real (tiny) trained checkpoint."""

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

import model.attention
from analysis.attention_maps import save_attention_maps
from analysis.causality import check_causality, format_report
from conftest import run_in_process
from model.gpt import CKPT_NAME, load_checkpoint


@pytest.fixture(scope="module")
def trained_model(trained_run: Path) -> model.GPT:
    return load_checkpoint(trained_run / CKPT_NAME).build_model().eval()


def test_attention_maps_are_causal_softmax_rows(trained_model: model.GPT, tmp_path: Path) -> None:
    ids = list(range(10, 30))
    tokens = [f"t{i}" for i in ids]
    pngs = save_attention_maps(trained_model, ids, tokens, tmp_path)
    saved = np.load(tmp_path / "attention.npz")
    weights = saved["weights"]
    c = trained_model.config
    assert weights.dtype == np.float32 and weights.shape == (c.n_layer, c.n_head, 20, 20)
    assert list(saved["tokens"]) == tokens
    upper = np.triu(np.ones((20, 20), dtype=bool), k=1)
    assert np.all(weights[..., upper] == 0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(weights[..., ~upper] > 0)
    assert [p.name for p in pngs] == [f"attention_layer{i}.png" for i in range(c.n_layer)]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(png).shape[0] > 200


def test_causality_check_finds_no_leak_in_a_trained_model(trained_model: model.GPT) -> None:
    ids = list(range(5, 35))
    report = check_causality(trained_model, ids)
    assert report.position == 15 and set(report.changes) == {"flash", "math"}
    assert report.mask_held and report.information_flows
    text = format_report(report, [str(i) for i in ids], "x", positions=True)
    assert text.splitlines()[-1].startswith("mask held: positions 0-14 are unchanged on flash and math")
    assert len(text.splitlines()) == 2 + len(ids) + 1
    summary = format_report(report, [str(i) for i in ids], "x").splitlines()
    assert summary[1:3] == ["  positions 0-14 (before it): flash 0, math 0", summary[2]]
    assert summary[2].startswith("  positions 15-29 (from it on): flash ") and len(summary) == 4
    assert summary[-1] == text.splitlines()[-1]


def test_causality_check_reports_a_leak_when_the_mask_is_removed(
    trained_model: model.GPT, monkeypatch: pytest.MonkeyPatch
) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def no_mask(n_queries: int, n_keys: int, device: object = None, window: int | None = None) -> torch.Tensor:
        return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)

    monkeypatch.setattr(model.attention, "causal_mask", no_mask)
    monkeypatch.setattr(
        model.attention.F, "scaled_dot_product_attention", lambda *a, **kw: sdpa(*a, **{**kw, "is_causal": False})
    )
    report = check_causality(trained_model, list(range(5, 35)))
    assert not report.mask_held
    assert all(bool((c[: report.position] > 0).any()) for c in report.changes.values())
    assert "MASK LEAKED" in format_report(report, [str(i) for i in range(30)], "x")


def test_sample_py_draws_attention_maps_and_proves_causality(trained_run: Path, tmp_path: Path) -> None:
    args = [
        f"out_dir={trained_run}",
        "start=The",
        "num_samples=1",
        "max_new_tokens=20",
        "seed=3",
        f"attention_dir={tmp_path / 'maps'}",
        "check_causal=true",
    ]
    result = run_in_process("sample.py", args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    sample, report = result.stdout.split("\n---------------\n")
    assert sample.startswith("The") and len(sample) == 23
    assert "causality check: token 11" in report and report.rstrip().splitlines()[-1].startswith("mask held")
    weights = np.load(tmp_path / "maps" / "attention.npz")["weights"]
    assert weights.shape[-2:] == (23, 23)
    assert len(list((tmp_path / "maps").glob("attention_layer*.png"))) == weights.shape[0]
    page = (tmp_path / "maps" / "index.html").read_text(encoding="utf-8")
    assert '"steps":{"first":3,' in page and '"verdict":"mask held' in page  # "The": 3 tokens run as the prompt


def test_the_causality_check_refuses_to_replace_a_token_by_itself() -> None:
    """A one-token vocabulary (or the same token asked for) changes nothing: 'the mask held' would prove nothing."""
    one = model.GPT(model.GPTConfig(vocab_size=1, block_size=8, n_layer=1, n_head=1, n_embd=8)).eval()
    with pytest.raises(ValueError, match="token 2 would be replaced by itself"):
        check_causality(one, [0] * 6, position=2)
    two = model.GPT(model.GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=8)).eval()
    with pytest.raises(ValueError, match="token 1 would be replaced by itself"):
        check_causality(two, [1, 3, 2], position=1, replacement=3)
    assert check_causality(two, [1, 3, 2], position=1, replacement=4).position == 1
