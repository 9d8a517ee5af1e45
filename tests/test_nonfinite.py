"""No NaN or inf ever replaces a good checkpoint: a diverging run stops before its weights take a non-finite loss, an
evaluation with a non-finite val loss saves nothing."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from common.config import typed_config
from common.runtime import make_runtime
from conftest import compose_config, run_in_process, tiny_run_overrides
from model.gpt import BEST_NAME, CKPT_NAME, Checkpoint, load_checkpoint
from training.distributed import World
from training.run import build_trainer, train
from training.schema import TrainRunConfig
from training.trainer import Trainer


def _all_finite(checkpoint: Checkpoint) -> bool:
    weights_finite = all(t.isfinite().all() for t in checkpoint.model.values())
    return weights_finite and math.isfinite(checkpoint.progress.val_loss)


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Path:
    """A 40-iteration run with a good ckpt.pt and best.pt, to copy and then push over the edge."""
    root = tmp_path_factory.mktemp("good")
    extra = {"train.max_iters": 40, "train.eval_interval": 20, "train.keep_best": True}
    train(compose_config(tiny_run_overrides(root, corpus_path, **extra)))
    return root


def _copy_run(good_run: Path, tmp_path: Path) -> Path:
    for name in ("run", "data"):
        source = good_run / name
        for path in source.rglob("*"):
            if path.is_file() and ".lock" not in path.name:
                target = tmp_path / name / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
    return tmp_path / "run"


def test_a_diverging_resume_stops_in_one_line_with_the_good_checkpoints_intact(
    good_run: Path, tmp_path: Path, corpus_path: Path
) -> None:
    """Resume with an exploding learning rate: a step with a finite loss leaves NaN or inf weights; the run stops at
    the next step with one line and exit 2, ckpt.pt and best.pt untouched and usable."""
    run = _copy_run(good_run, tmp_path)
    good = {name: (run / name).read_bytes() for name in (CKPT_NAME, BEST_NAME)}
    explode = {
        "resume": True,
        "resume_with_changes": True,
        "train.keep_best": True,
        "train.learning_rate": 1e3,
        "train.warmup_iters": 0,
        "train.max_iters": 400,
        "train.eval_interval": 100,  # no evaluation in between: the state is only saved on the way out
    }
    result = run_in_process("train.py", tiny_run_overrides(tmp_path, corpus_path, **explode), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert f"{run / CKPT_NAME} keeps iter 40, the last good state" in message, message
    assert "Lower train.learning_rate" in message and "train.on_nonfinite=skip" in message
    assert {name: (run / name).read_bytes() for name in good} == good
    assert _all_finite(load_checkpoint(run / CKPT_NAME))
    sampled = run_in_process("sample.py", [f"out_dir={run}", "num_samples=1", "max_new_tokens=5", "device=cpu"],
                             tmp_path)
    assert sampled.returncode == 0, sampled.stderr


def _skipping_trainer(tmp_path: Path, corpus_path: Path, max_iters: int, eval_interval: int) -> Trainer:
    """A trainer with on_nonfinite=skip as train() builds it, its run directory made."""
    extra = {"train.max_iters": max_iters, "train.eval_interval": eval_interval, "train.on_nonfinite": "skip"}
    config = typed_config(compose_config(tiny_run_overrides(tmp_path, corpus_path, **extra)), TrainRunConfig)
    (tmp_path / "run").mkdir()
    return build_trainer(config, World(), make_runtime("cpu", "float32"))


def test_an_evaluation_with_a_nonfinite_val_loss_keeps_the_previous_checkpoint(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Weights gone NaN under on_nonfinite=skip: each later step is skipped (reported at the log line at 5 and the
    evaluation at 6), and the evaluation at the end saves nothing, so ckpt.pt stays the last good state."""
    trainer = _skipping_trainer(tmp_path, corpus_path, max_iters=6, eval_interval=3)

    def poison(it: int) -> None:
        if it == 4:
            with torch.no_grad():
                trainer.model.lm_head.weight.fill_(math.nan)

    trainer.before_step = poison
    with caplog.at_level(logging.WARNING, logger="train"):
        result = trainer.fit()
    assert result.iters == 6 and math.isnan(result.val_loss)
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 3
    assert any("val loss is nan at iter 6: keeping the previous checkpoint" in m for m in caplog.messages)
    skipped = [m for m in caplog.messages if m.startswith("skipped")]  # one warning at each check after a skip
    assert skipped == [f"skipped 1 step(s): the loss is not finite at iter {it}" for it in (4, 5)]


def test_a_signal_after_a_skipped_step_keeps_the_last_good_checkpoint(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under on_nonfinite=skip the weights may already be NaN when a signal comes: the stop writes nothing over
    ckpt.pt when its step was skipped, and says what ckpt.pt holds."""
    import signal

    trainer = _skipping_trainer(tmp_path, corpus_path, max_iters=100, eval_interval=2)

    def poison_then_signal(it: int) -> None:
        if it == 3:
            with torch.no_grad():
                trainer.model.lm_head.weight.fill_(math.nan)
            signal.raise_signal(signal.SIGTERM)

    trainer.before_step = poison_then_signal
    with caplog.at_level(logging.WARNING, logger="train"):
        result = trainer.fit()
    assert result.stopped_by == "SIGTERM" and result.iters == 4
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 2
    assert any(m.startswith("stopped by SIGTERM at iter 4;") and "keeps iter 2, the last good state" in m
               for m in caplog.messages)
