"""train.keep_best: best.pt holds the state of the lowest val loss, ckpt.pt stays the latest; sample.py ckpt=best."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from common.config import typed_config
from common.errors import CheckpointError
from conftest import compose_config, tiny_run_overrides
from inference.sampling import SampleConfig, load_sampler
from model.gpt import BEST_NAME, CKPT_NAME, load_checkpoint
from training.run import train
from training.trainer import Losses, Trainer

SCRIPTED_VAL = {0: 3.0, 2: 2.0, 4: 2.5, 6: 2.2, 8: 2.6, 10: 2.7}  # iteration -> val loss: the best is at 2


@pytest.fixture
def scripted_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    evaluate_and_save = Trainer.evaluate_and_save

    def scripted(self: Trainer) -> bool:
        val = SCRIPTED_VAL[self.progress.iter]
        self.evaluator = lambda model: Losses(train=val, val=val, val_bpb=val)
        return evaluate_and_save(self)

    monkeypatch.setattr(Trainer, "evaluate_and_save", scripted)


def run(tmp_path: Path, corpus: Path, keep_best: bool, max_iters: int = 6, resume: bool = False) -> Path:
    extra = {"train.max_iters": max_iters, "train.eval_interval": 2, "train.keep_best": keep_best, "resume": resume}
    extra["resume_with_changes"] = resume  # to more iterations
    train(compose_config(tiny_run_overrides(tmp_path, corpus, **extra)))
    return tmp_path / "run"


@pytest.fixture
def saves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(iteration, file) of every checkpoint written, in order."""
    import training.trainer

    written: list[tuple[int, str]] = []
    save = training.trainer.save_checkpoint
    monkeypatch.setattr(
        training.trainer,
        "save_checkpoint",
        lambda path, c: written.append((c.progress.iter, path.name)) or save(path, c),
    )
    return written


def test_best_pt_holds_the_lowest_val_loss_and_ckpt_pt_the_latest(
    tmp_path: Path,
    corpus_path: Path,
    scripted_evaluations: None,
    saves: list[tuple[int, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="train")
    out = run(tmp_path, corpus_path, keep_best=True)
    best, latest = load_checkpoint(out / BEST_NAME), load_checkpoint(out / CKPT_NAME)
    assert (best.progress.iter, best.progress.val_loss) == (2, 2.0)
    assert (latest.progress.iter, latest.progress.val_loss, latest.progress.best_val_loss) == (6, 2.2, 2.0)
    assert not torch.equal(best.model["lm_head.weight"], latest.model["lm_head.weight"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(BEST_NAME)]
    assert lines == ["best.pt: iter 0, val loss 3.0000", "best.pt: iter 2, val loss 2.0000"]
    # iter 0: the initial weights as best.pt only; best.pt before ckpt.pt, so a kill between them resumes and redoes it
    assert saves == [(0, "best.pt"), (2, "best.pt"), (2, "ckpt.pt"), (4, "ckpt.pt"), (6, "ckpt.pt")]


def test_keep_best_turned_on_at_resume_keeps_the_best_of_what_follows(
    tmp_path: Path, corpus_path: Path, scripted_evaluations: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's best val loss so far (2.0) came before best.pt was kept: its weights are gone, so best.pt starts
    with the resumed run's first evaluation."""
    run(tmp_path, corpus_path, keep_best=False, max_iters=6)
    out = run(tmp_path, corpus_path, keep_best=True, max_iters=10, resume=True)
    best = load_checkpoint(out / BEST_NAME)
    assert (best.progress.iter, best.progress.val_loss) == (8, 2.6)
    assert load_checkpoint(out / CKPT_NAME).progress.best_val_loss == 2.0
    caplog.set_level(logging.WARNING, logger="train")
    run(tmp_path, corpus_path, keep_best=False, max_iters=10, resume=True)
    assert "best.pt stays as it is: this resume has train.keep_best=false" in caplog.text


def test_a_new_run_removes_a_best_pt_it_did_not_write(tmp_path: Path, corpus_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / BEST_NAME).write_bytes(b"a dead run's")
    out = run(tmp_path, corpus_path, keep_best=False, max_iters=2)
    assert not (out / BEST_NAME).exists()


def test_sample_py_picks_best_or_latest_and_says_when_there_is_no_best(
    tmp_path: Path, corpus_path: Path, scripted_evaluations: None
) -> None:
    out = run(tmp_path / "kept", corpus_path, keep_best=True)
    for which, name in (("best", BEST_NAME), ("latest", CKPT_NAME)):
        sampler = load_sampler(typed_config(SampleConfig(out_dir=str(out), ckpt=which, device="cpu"), SampleConfig))
        saved = load_checkpoint(out / name).model["lm_head.weight"]
        assert torch.equal(sampler.model.lm_head.weight.detach(), saved)
    plain = run(tmp_path / "plain", corpus_path, keep_best=False)
    assert not (plain / BEST_NAME).exists()
    with pytest.raises(CheckpointError, match="no best.pt in .*: train with train.keep_best=true, or use ckpt=latest"):
        load_sampler(typed_config(SampleConfig(out_dir=str(plain), ckpt="best", device="cpu"), SampleConfig))
