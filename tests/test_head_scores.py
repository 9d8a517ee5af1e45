"""train.head_scores: every head scored at each evaluation, as analysis/diagnostics.py scores one checkpoint; plot.py
--heads drawing them, with each head's formation; the explorer showing the open head's scores over training."""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_experiments import plot_ok, plot_refused

from analysis.diagnostics import DIAGNOSTIC_NAMES, HeadProbe, head_diagnostics
from common.errors import ConfigError
from common.files import METRICS_NAME
from common.runtime import World
from conftest import compose_config, sample_py, tiny_run_overrides
from inference.sampling import load_model
from model import GPT, GPTConfig
from train import TrainConfig, check_for_world, train

# lr 1e-2: within 20 steps the heads move apart from the even spread they start with, and from each other
SCORED = {"train.head_scores": True, "train.max_iters": 20, "train.eval_interval": 10, "train.learning_rate": 1e-2}


def _heads(run: Path) -> dict[int, dict[str, list]]:
    records = [json.loads(line) for line in (run / METRICS_NAME).read_text().splitlines()]
    return {r["iter"]: r["heads"] for r in records if "heads" in r}


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Path:
    """A tiny run (2 layers x 2 heads, block 32) scored at iterations 0, 10 and 20."""
    tmp = tmp_path_factory.mktemp("scored")
    train(compose_config(tiny_run_overrides(tmp, corpus_path, **SCORED)))
    return tmp / "run"


def test_the_logged_scores_are_the_diagnostics_of_the_saved_weights_on_the_val_splits_first_block(
        scored_run: Path) -> None:
    heads = _heads(scored_run)
    assert list(heads) == [0, 10, 20] and list(heads[20]) == list(DIAGNOSTIC_NAMES) and heads[20] != heads[10]
    model = load_model(str(scored_run), None, "ckpt.pt", None).model.eval()  # iter 20's weights
    val = np.fromfile(scored_run.parent / "data" / "val.bin", dtype=np.uint16)
    weights = model.attention_weights(torch.tensor(val[None, :32].astype(np.int64)))[:, 0].numpy()
    direct = head_diagnostics(model, weights)  # (n_layer, n_head, 5)
    logged = np.stack([np.array(heads[20][name]) for name in DIAGNOSTIC_NAMES], axis=-1)
    assert logged.shape == (2, 2, 5) and np.abs(logged - direct).max() <= 5e-4 + 1e-6  # rounded to 3 decimals


def test_a_head_built_to_look_at_the_previous_token_scores_1_there_and_the_others_stay_low() -> None:
    """Positions one-hot in the residual (rmsnorm leaves them so, times sqrt(32)); head 0's queries are the keys
    shifted by one position, so query i matches key i - 1 alone; head 1 has no query weights: it spreads evenly."""
    T, C = 16, 32
    model = GPT(GPTConfig(vocab_size=8, block_size=T, n_layer=1, n_head=2, n_embd=C, norm="rmsnorm", bias=False))
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.copy_(torch.eye(T, C))
        c_attn = model.transformer.h[0].attn.c_attn.weight  # rows: the queries, the keys, the values
        c_attn.zero_()
        c_attn[:T - 1, 1:T] = 10 * torch.eye(T - 1)  # head 0's query dim d reads position d + 1
        c_attn[C:C + T, :T] = torch.eye(T)  # head 0's key dim d: position d
    probe = HeadProbe(torch.arange(T)[None] % 8)
    scores = probe(model)["heads"]  # through the model's own forward, in eval mode
    assert model.training  # and training goes on in training mode
    assert scores["previous_token"][0][0] > 0.99 and scores["previous_token"][0][1] < 0.25
    assert scores["induction"][0][0] < 0.05 and scores["mean_distance"][0][0] == pytest.approx(15 / 16, abs=0.01)


def test_a_resumed_run_logs_the_scores_the_uninterrupted_one_logs(
        scored_run: Path, tmp_path: Path, corpus_path: Path) -> None:
    def stop_at_12(it: int) -> None:
        if it == 12:
            signal.raise_signal(signal.SIGTERM)

    stopped = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **SCORED)), before_step=stop_at_12)
    assert stopped.stopped_by == "SIGTERM" and stopped.iters == 13
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, **SCORED)))
    assert _heads(tmp_path / "run") == _heads(scored_run)  # iterations 0, 10, 20: the same probe, the same numbers


def test_fsdp_is_refused_with_head_scores_in_one_line() -> None:
    with pytest.raises(ConfigError, match="train.head_scores needs each head's whole weights"):
        check_for_world(TrainConfig(head_scores=True, parallel="fsdp", grad_accum=2), World(rank=1, size=2))


def test_plot_py_heads_draws_the_scores_and_says_when_a_run_has_none(
        scored_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stdout, _ = plot_ok(capsys, str(scored_run), "--heads", "-o", str(tmp_path / "heads.png"))
    assert "previous_token >= 0.5" in stdout and (tmp_path / "heads.png").stat().st_size > 20_000
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / METRICS_NAME).write_text(json.dumps({"iter": 0, "train_loss": 4.0, "val_loss": 4.0, "elapsed_s": 1.0}))
    err = plot_refused(capsys, str(bare), "--heads", "-o", str(tmp_path / "bare.png"))
    assert err.startswith("error: ") and "train.head_scores=true" in err and len(err.strip().splitlines()) == 1
    wider = tmp_path / "wider"  # another shape, and no config.yaml to tell the runs apart
    wider.mkdir()
    heads = {"previous_token": [[0.1, 0.2, 0.3]], "induction": [[0.0, 0.0, 0.0]]}
    (wider / METRICS_NAME).write_text(json.dumps({"iter": 0, "train_loss": 4.0, "val_loss": 4.0, "heads": heads}))
    (plain := tmp_path / "plain").mkdir()
    lines = (scored_run / METRICS_NAME).read_text().splitlines()
    (plain / METRICS_NAME).write_text("".join(line + "\n" for line in lines if '"heads"' in line))  # no settings
    err = plot_refused(capsys, str(plain), str(wider), "--heads", "-o", str(tmp_path / "both.png"))
    assert err.startswith("error: --heads averages runs of one model's shape") and err.count("\n") == 1, err


def test_plot_py_heads_gives_each_heads_formation_as_the_mean_and_interval_over_seeds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Head 0.1 crosses previous_token 0.5 at iteration 100, 200 and 300 in three seeds' runs; head 0.0 never."""
    for seed, formed in ((1, 100), (2, 200), (3, 300)):
        run = tmp_path / "sweep" / str(seed)
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(OmegaConf.to_yaml({"seed": seed, "model": {"n_layer": 1}}))
        lines = []
        for it in range(0, 400, 100):
            previous = [[0.1, 0.9 if it >= formed else 0.2]]
            heads = {"previous_token": previous, "induction": [[0.0, None]]}  # None: undefined, as a run writes it
            lines.append({"iter": it, "train_loss": 3.0, "val_loss": 3.0 - it / 1000, "elapsed_s": 1.0, "heads": heads})
        (run / METRICS_NAME).write_text("".join(json.dumps(line) + "\n" for line in lines))
    stdout, _ = plot_ok(capsys, str(tmp_path / "sweep"), "--heads")
    half = 4.302653 * 100 / math.sqrt(3)  # Student t, 2 degrees of freedom
    assert re.search(rf"previous_token >= 0.5 +0.#1 +3/3 runs +200 ± {half:.0f}", stdout), stdout
    assert re.search(r"induction >= 0.3 +none +0/3 runs", stdout), stdout
    assert (tmp_path / "sweep" / "heads.png").is_file()


@pytest.fixture(scope="module")
def explorer_page(scored_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sample.py's attention explorer on the scored run."""
    maps = tmp_path_factory.mktemp("maps")
    sample_py([f"out_dir={scored_run}", "start=ROMEO:", "max_new_tokens=5", "num_samples=1", "device=cpu",
               f"attention_dir={maps}"])
    return maps / "index.html"


def test_the_explorer_page_of_a_scored_run_holds_each_heads_scores_over_training(
        scored_run: Path, explorer_page: Path) -> None:
    page = explorer_page.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script id="explorer-data"[^>]*>(.*?)</script>', page, re.S).group(1))
    heads = _heads(scored_run)
    assert data["history"] == {"iters": list(heads), "scores": {name: [h[name] for h in heads.values()]
                                                                for name in DIAGNOSTIC_NAMES}}


def test_the_open_heads_page_charts_each_score_over_the_evaluations(explorer_page: Path, browser) -> None:
    browser.get(explorer_page.as_uri())
    browser.execute_script("window.attentionExplorer.open(1, 0)")
    points = browser.execute_script("return Array.from(document.querySelectorAll('#history polyline'))"
                                    ".map(l => l.getAttribute('points').trim().split(/ +/).length)")
    assert points == [3] * len(DIAGNOSTIC_NAMES)  # a chart per score, a point per evaluation
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_a_head_formed_before_scoring_began_is_said_to_have_formed_by_then(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scores turned on at a resume start late: a head over its threshold at the first of them formed at or before."""
    run = tmp_path / "run"
    run.mkdir()
    heads = {"previous_token": [[0.9, 0.1]], "induction": [[0.0, 0.0]]}
    lines = [{"iter": it, "train_loss": 3.0, "val_loss": 3.0, "heads": heads} for it in (100, 200)]
    (run / METRICS_NAME).write_text("".join(json.dumps(line) + "\n" for line in lines))
    stdout, _ = plot_ok(capsys, str(run), "--heads")
    assert re.search(r"previous_token >= 0.5 +0.0 +1/1 runs +<= 100", stdout), stdout
