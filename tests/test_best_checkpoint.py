"""train.keep_best: best.pt holds the state of the lowest val loss, ckpt.pt stays the latest; sample.py ckpt=best."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from common.files import BEST_NAME, CKPT_NAME, RunDir
from conftest import compose_config, refused, run_in_process, tiny_run_overrides
from inference.sampling import load_model
from model.checkpoint import load_checkpoint
from train import train
from training.trainer import Losses, Trainer

SCRIPTED_VAL = {0: 3.0, 2: 2.0, 4: 2.5, 6: 2.2, 8: 2.6, 10: 2.7}  # iteration -> val loss: the best is at 2


@pytest.fixture(autouse=True)
def scripted_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    evaluate_and_save = Trainer.evaluate_and_save

    def scripted(self: Trainer) -> bool:
        val = SCRIPTED_VAL[self.progress.iter]
        self.evaluator = lambda model: Losses(train=val, val=val, val_bpb=val)
        return evaluate_and_save(self)

    monkeypatch.setattr(Trainer, "evaluate_and_save", scripted)


def run(tmp_path: Path, corpus: Path, keep_best: bool, max_iters: int = 6, resume: bool = False) -> Path:
    extra = {"train.max_iters": max_iters, "train.eval_interval": 2, "train.keep_best": keep_best, "resume": resume}
    train(compose_config(tiny_run_overrides(tmp_path, corpus, **extra, resume_with_changes=resume)))  # more iters
    return tmp_path / "run"


def test_best_pt_holds_the_lowest_val_loss_ckpt_pt_the_latest_and_sampling_picks_either(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    saves, write = [], RunDir.write  # (iteration, file) of every checkpoint written, in order
    monkeypatch.setattr(RunDir, "write", lambda run_dir, name, fill: (name.endswith(".pt") and saves.append(
        (fill.__self__.progress.iter, name))) or write(run_dir, name, fill))
    caplog.set_level(logging.INFO, logger="train")
    out = run(tmp_path, corpus_path, keep_best=True)
    best, latest = load_checkpoint(out / BEST_NAME), load_checkpoint(out / CKPT_NAME)
    assert (best.progress.iter, best.progress.val_loss) == (2, 2.0)
    assert (latest.progress.iter, latest.progress.val_loss, latest.progress.best_val_loss) == (6, 2.2, 2.0)
    assert not torch.equal(best.model["lm_head.weight"], latest.model["lm_head.weight"])
    lines = [m for m in caplog.messages if m.startswith(BEST_NAME)]
    assert lines == ["best.pt: iter 0, val loss 3.0000", "best.pt: iter 2, val loss 2.0000"]
    # iter 0: the initial weights as best.pt only; best.pt before ckpt.pt, so a kill between them resumes and redoes it
    assert saves == [(0, "best.pt"), (2, "best.pt"), (2, "ckpt.pt"), (4, "ckpt.pt"), (6, "ckpt.pt")]
    for which, saved in (("best", best), ("latest", latest)):
        weight = load_model(str(out), None, which, None).model.lm_head.weight.detach()
        assert torch.equal(weight, saved.model["lm_head.weight"])


def test_keep_best_turned_on_at_resume_keeps_the_best_of_what_follows(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The best val loss so far (2.0) came before best.pt was kept: best.pt starts at the resumed run's first eval.
    Before it, sample.py ckpt=best says there is none."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / BEST_NAME).write_bytes(b"a dead run's")  # a new run removes what it didn't write
    plain = run(tmp_path, corpus_path, keep_best=False, max_iters=6)
    assert not (plain / BEST_NAME).exists()
    result = run_in_process("sample.py", [f"out_dir={plain}", "ckpt=best"], tmp_path)
    assert f"no best.pt in {plain}: train with train.keep_best=true, or use ckpt=latest" in refused(result)
    if hasattr(os, "mkfifo"):  # a FIFO there is named as one, not taken for no best.pt
        os.mkfifo(plain / BEST_NAME)
        result = run_in_process("sample.py", [f"out_dir={plain}", "ckpt=best"], tmp_path)
        assert f"{plain / BEST_NAME} is not a regular file (a pipe" in refused(result)
        (plain / BEST_NAME).unlink()
    out = run(tmp_path, corpus_path, keep_best=True, max_iters=10, resume=True)
    best = load_checkpoint(out / BEST_NAME)
    assert (best.progress.iter, best.progress.val_loss) == (8, 2.6)
    assert load_checkpoint(out / CKPT_NAME).progress.best_val_loss == 2.0
    caplog.set_level(logging.WARNING, logger="train")
    run(tmp_path, corpus_path, keep_best=False, max_iters=10, resume=True)
    assert "best.pt stays as it is: this resume has train.keep_best=false" in caplog.text
