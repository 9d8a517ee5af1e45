"""No NaN or inf ever replaces a good checkpoint, whether the run stops on a non-finite loss or skips the step."""

from __future__ import annotations

import json
import logging
import math
import signal
from pathlib import Path

import pytest
import torch

from common.config import typed_config
from common.files import BEST_NAME, CKPT_NAME, read_records
from common.runtime import World, make_runtime
from conftest import compose_config, run_in_process, tiny_run_overrides
from model.checkpoint import load_checkpoint
from train import TrainRunConfig, build_trainer, train


def test_a_diverging_resume_stops_in_one_line_keeping_the_good_checkpoints(tmp_path: Path, corpus_path: Path) -> None:
    """An exploding learning rate's NaN weights stop the run in one line, ckpt.pt and best.pt untouched and usable."""
    first = {"train.max_iters": 40, "train.eval_interval": 20, "train.keep_best": True}
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **first)))
    run = tmp_path / "run"
    good = {name: (run / name).read_bytes() for name in (CKPT_NAME, BEST_NAME)}
    explode = {"resume": True, "resume_with_changes": True, "train.keep_best": True, "train.learning_rate": 1e3,
               "train.warmup_iters": 0, "train.max_iters": 400, "train.eval_interval": 100}  # no evaluation between
    result = run_in_process("train.py", tiny_run_overrides(tmp_path, corpus_path, **explode), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert f"{run / CKPT_NAME} keeps iter 40, the last good state" in message, message
    assert "Lower train.learning_rate" in message and "train.on_nonfinite=skip" in message
    assert {name: (run / name).read_bytes() for name in good} == good
    kept = load_checkpoint(run / CKPT_NAME)
    assert math.isfinite(kept.progress.val_loss) and all(t.isfinite().all() for t in kept.model.values())
    sampled = run_in_process("sample.py", [f"out_dir={run}", "num_samples=1", "max_new_tokens=5"], tmp_path)
    assert sampled.returncode == 0, sampled.stderr


@pytest.mark.parametrize("stopped", [False, True])
def test_weights_gone_nan_under_skip_never_replace_the_last_good_checkpoint(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture, stopped: bool
) -> None:
    """Weights gone NaN at iter 4: neither the evaluation at 6 nor a SIGTERM's stop writes over ckpt.pt (iter 3)."""
    extra = {"train.max_iters": 6, "train.eval_interval": 3, "train.on_nonfinite": "skip"}
    config = typed_config(compose_config(tiny_run_overrides(tmp_path, corpus_path, **extra)), TrainRunConfig)
    (tmp_path / "run").mkdir()
    trainer = build_trainer(config, World(), make_runtime("cpu", "float32"))  # as train() builds it

    def poison(it: int) -> None:
        if it == 4:
            with torch.no_grad():
                trainer.model.lm_head.weight.fill_(math.nan)
            if stopped:
                signal.raise_signal(signal.SIGTERM)

    trainer.before_step = poison
    with caplog.at_level(logging.WARNING, logger="train"):
        result = trainer.fit()
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 3
    if stopped:
        assert result.stopped_by == "SIGTERM" and result.iters == 5
        assert any(m.startswith("stopped by SIGTERM at iter 5;") and "keeps iter 3, the last good state" in m
                   for m in caplog.messages), caplog.messages
        return
    assert result.iters == 6 and math.isnan(result.val_loss)
    assert any("val loss is nan at iter 6: keeping the previous checkpoint" in m for m in caplog.messages)
    skipped = [m for m in caplog.messages if m.startswith("skipped")]  # one warning at each check after a skip
    assert skipped == [f"skipped 1 step(s): the loss or its gradients are not finite at iter {it}" for it in (4, 5)]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()  # strict JSON: NaN written null
    evals = [json.loads(line, parse_constant=pytest.fail) for line in lines if '"val_loss"' in line]
    assert evals[-1]["val_loss"] is None and math.isnan(read_records(tmp_path / "run")[0][-1]["val_loss"])
