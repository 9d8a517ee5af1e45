"""The Trainer's seams, without running the whole loop: step() on its own, save() and restore()."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from common.config import typed_config
from common.runtime import make_runtime
from conftest import compose_config, tiny_run_overrides
from data.batches import TRAIN_WINDOWS, get_batch
from model.checkpoint import CKPT_NAME, load_checkpoint
from training.distributed import World
from training.errors import TrainingDiverged
from training.metrics import sample_table
from training.optim import lr_at
from training.run import build_trainer, train
from training.schema import TrainRunConfig
from training.trainer import Trainer


def _trainer(tmp_path: Path, corpus: Path, **extra: object) -> Trainer:
    config = typed_config(compose_config(tiny_run_overrides(tmp_path, corpus, **extra)), TrainRunConfig)
    return build_trainer(config, World(), make_runtime("cpu", "float32"))


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_five_steps_are_the_weights_of_a_five_iteration_run(tmp_path: Path, corpus_path: Path) -> None:
    keys = {"train.max_iters": 5, "train.eval_interval": 100}
    trainer = _trainer(tmp_path / "a", corpus_path, **keys)
    losses = []
    for it in range(5):
        outcome = trainer.step()
        assert trainer.progress.iter == it + 1 and not outcome.stop
        assert outcome.lr == lr_at(it, 1e-3, 1e-4, 2, 5)  # the config's schedule
        losses.append(outcome.loss.item())
    assert all(math.isfinite(loss) for loss in losses)
    wsd = _trainer(tmp_path / "wsd", corpus_path, **keys, **{"train.lr_schedule": "wsd", "train.cooldown_frac": 0.4})
    assert [wsd.step().lr for _ in range(5)] == [lr_at(it, 1e-3, 1e-4, 2, 5, "wsd", 0.4) for it in range(5)]

    train(compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, **keys)))
    run = load_checkpoint(tmp_path / "b" / "run" / CKPT_NAME)
    assert all(torch.equal(run.model[k], v) for k, v in trainer.model.state_dict().items())  # bit for bit


def test_a_step_with_a_nonfinite_loss_never_touches_the_weights(tmp_path: Path, corpus_path: Path) -> None:
    trainer = _trainer(tmp_path, corpus_path)
    with torch.no_grad():
        trainer.model.lm_head.weight[0, 0] = math.inf
    before = _weights(trainer)
    with pytest.raises(TrainingDiverged, match="at iter 0"):
        trainer.step()
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

    with torch.no_grad():
        trainer.model.lm_head.weight[0, 0] = before["lm_head.weight"][0, 1]  # finite weights again
    trainer.config.train.on_nonfinite = "skip"
    accumulate = trainer._accumulate_gradients
    trainer._accumulate_gradients = lambda it: accumulate(it) * math.nan  # finite weights, a NaN loss
    before = _weights(trainer)
    outcome = trainer.step()
    assert outcome.loss is None and trainer.progress.iter == 1  # counted as an iteration, not applied
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_save_then_restore_gives_back_the_named_state(tmp_path: Path, corpus_path: Path) -> None:
    first = _trainer(tmp_path, corpus_path, **{"model.dropout": 0.1})
    for _ in range(3):
        first.step()
    first.progress.val_loss, first.progress.best_val_loss, first.progress.last_eval_iter = 2.5, 2.25, 3
    first.save()
    after_save = torch.rand(3)  # the dropout stream goes on from the saved state

    second = _trainer(tmp_path, corpus_path, **{"model.dropout": 0.1, "resume": True})
    p = second.progress
    assert (p.iter, p.last_eval_iter, p.val_loss, p.best_val_loss) == (3, 3, 2.5, 2.25)
    assert p.elapsed_s > 0
    restored = torch.get_rng_state()
    assert torch.equal(torch.rand(3), after_save)
    assert all(torch.equal(first.model.state_dict()[k], v) for k, v in second.model.state_dict().items())
    torch.set_rng_state(restored)
    loss = first.step().loss
    torch.set_rng_state(restored)
    assert torch.equal(second.step().loss, loss)  # the same weights, the same dropout masks
    # and the same optimizer state: the same step (Muon's: test_crash_safety's exact resume)
    assert all(torch.equal(first.model.state_dict()[k], v) for k, v in second.model.state_dict().items())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_accumulated_micro_batches_step_as_one_batch_twice_the_size(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    import training.trainer

    big = _trainer(tmp_path / "big", corpus_path, **{"train.batch_size": 8, "train.optimizer": optimizer})
    windows = {}
    for it in range(3):  # each step's 8 windows; the accumulating run takes micro-batch i's half of them
        generator = training.trainer.batch_generator(big.config.seed, TRAIN_WINDOWS, it, 0)
        windows[it] = get_batch(big.data.train, 8, big.model.config.block_size, generator)
    monkeypatch.setattr(training.trainer, "batch_generator", lambda seed, purpose, it, micro: (it, micro))
    monkeypatch.setattr(
        training.trainer,
        "get_batch",
        lambda files, size, block, key: tuple(t[key[1] * size : (key[1] + 1) * size] for t in windows[key[0]]),
    )
    accumulating = _trainer(
        tmp_path / "acc", corpus_path, **{"train.batch_size": 4, "train.grad_accum": 2, "train.optimizer": optimizer}
    )
    for _ in range(3):
        losses = big.step().loss, accumulating.step().loss
        torch.testing.assert_close(*losses, atol=1e-6, rtol=0)
    for name, tensor in big.model.state_dict().items():
        torch.testing.assert_close(accumulating.model.state_dict()[name], tensor, atol=1e-5, rtol=0)


def test_a_signal_during_a_step_stops_the_run_after_that_step(tmp_path: Path, corpus_path: Path) -> None:
    """Preemption arrives while a step computes (forward, backward): that step completes, then a checkpoint."""
    trainer = _trainer(tmp_path, corpus_path, **{"train.max_iters": 1000, "train.eval_interval": 500})
    forwards = 0

    def signal_on_the_eighth_training_forward(module: torch.nn.Module, inputs: tuple) -> None:
        nonlocal forwards
        forwards += module.training
        if module.training and forwards == 8:  # the forward of step 7 (one micro-batch a step)
            signal.raise_signal(signal.SIGTERM)

    trainer.model.register_forward_pre_hook(signal_on_the_eighth_training_forward)
    result = trainer.fit()
    assert result.stopped_by == "SIGTERM" and result.iters == 8
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 8


def test_eval_from_skips_the_early_evaluations_but_never_the_last(tmp_path: Path, corpus_path: Path) -> None:
    keys = {"train.max_iters": 13, "train.eval_interval": 3, "train.eval_from": 7}
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records if "val_loss" in r] == [9, 12, 13]


def test_the_wandb_sample_table_continues_the_val_splits_first_token(tmp_path: Path, corpus_path: Path) -> None:
    trainer = _trainer(tmp_path, corpus_path)
    torch.manual_seed(0)
    first = int(trainer.data.val.open(0)[0])
    rows = sample_table(trainer.model, trainer.tokenizer, first, trainer.runtime, count=2, tokens=12)
    prompt = trainer.tokenizer.decode([first])
    assert len(rows) == 2 and all(row[0] == prompt and row[1].startswith(prompt) for row in rows)
    assert all(len(row[1]) == 1 + 12 for row in rows)  # characters: the prompt's one and twelve drawn
    assert trainer.model.training  # back to training after drawing
