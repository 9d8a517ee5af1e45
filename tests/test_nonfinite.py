"""No NaN or inf ever replaces a good checkpoint: not by an evaluation, not by a step that left the weights
non-finite, not by the SIGTERM/Ctrl-C save, not through best.pt; and a skipping run can't skip forever."""

from __future__ import annotations

import logging
import math
import signal
from pathlib import Path

import pytest
import torch

from common.config import typed_config
from common.errors import CheckpointError, NonFiniteState
from common.runtime import make_runtime
from conftest import compose_config, run_script, tiny_run_overrides
from model import GPTConfig
from model.checkpoint import BEST_NAME, CKPT_NAME, Checkpoint, load_checkpoint, save_checkpoint
from training.distributed import World
from training.errors import TrainingDiverged
from training.run import build_trainer, train
from training.schema import TrainRunConfig
from training.trainer import Trainer


def _trainer(tmp_path: Path, corpus: Path, **extra: object) -> Trainer:
    config = typed_config(compose_config(tiny_run_overrides(tmp_path, corpus, **extra)), TrainRunConfig)
    return build_trainer(config, World(), make_runtime("cpu", "float32"))


def _all_finite(checkpoint: Checkpoint) -> bool:
    return not checkpoint.nonfinite() and math.isfinite(checkpoint.progress.val_loss)


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


def test_the_issues_reproduction_stops_with_the_good_checkpoint_intact(
    good_run: Path, tmp_path: Path, corpus_path: Path
) -> None:
    """Resume with an exploding learning rate and on_nonfinite=skip: a step with a finite loss leaves NaN or inf
    weights; the run stops at the next step with one line and exit 2, ckpt.pt and best.pt untouched and usable."""
    run = _copy_run(good_run, tmp_path)
    good = {name: (run / name).read_bytes() for name in (CKPT_NAME, BEST_NAME)}
    explode = {
        "resume": True,
        "resume_with_changes": True,
        "train.keep_best": True,
        "train.learning_rate": 1e3,
        "train.warmup_iters": 0,
        "train.on_nonfinite": "skip",
        "train.max_iters": 400,
        "train.eval_interval": 100,  # no evaluation in between: the state is only saved on the way out
    }
    result = run_script("train.py", tiny_run_overrides(tmp_path, corpus_path, **explode), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert f"{run / CKPT_NAME} keeps iter 40, the last good state" in message, message
    assert "the weights hold NaN or inf (the step before made them so): skipping steps can't undo" in message
    assert {name: (run / name).read_bytes() for name in good} == good
    assert _all_finite(load_checkpoint(run / CKPT_NAME))
    sampled = run_script("sample.py", [f"out_dir={run}", "num_samples=1", "max_new_tokens=5", "device=cpu"], tmp_path)
    assert sampled.returncode == 0, sampled.stderr


def test_the_signal_save_of_a_nonfinite_state_keeps_the_last_good_checkpoint(
    good_run: Path, tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM/Ctrl-C saves without evaluating: with NaN weights the save is refused and the message says what
    the run directory really holds."""
    run = _copy_run(good_run, tmp_path)
    good = {name: (run / name).read_bytes() for name in (CKPT_NAME, BEST_NAME)}
    trainer = _trainer(tmp_path, corpus_path, resume=True, resume_with_changes=True, **{"train.max_iters": 60})
    trainer.step()
    with torch.no_grad():
        trainer.model.transformer.h[0].mlp.c_fc.weight[0, 0] = math.nan
    with caplog.at_level(logging.WARNING, logger="train"):
        assert trainer._stop(signal.SIGTERM) == "SIGTERM"
        assert not trainer.save(latest=True, best=True)
    assert {name: (run / name).read_bytes() for name in good} == good
    refused = f"{CKPT_NAME} not written: NaN or inf in model.transformer.h.0.mlp.c_fc.weight"
    assert any(refused in m for m in caplog.messages)
    stopped = [m for m in caplog.messages if m.startswith("stopped by SIGTERM")]
    assert stopped == [f"stopped by SIGTERM at iter 41; {run / CKPT_NAME} keeps iter 40, the last good state. "
                       f"Resume with: python train.py out_dir={run} resume=true"]


def test_nonfinite_optimizer_state_is_never_written(tmp_path: Path) -> None:
    """Weights can be finite while AdamW's second moment is inf: the next step would make them NaN."""
    path = tmp_path / CKPT_NAME
    good = Checkpoint(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=5), {"w": torch.ones(3)}, {})
    save_checkpoint(path, good)
    before = path.read_bytes()
    for model, optimizer in (
        ({"w": torch.tensor([1.0, math.nan, 1.0])}, None),
        ({"w": torch.ones(3)}, {"state": {"w": {"exp_avg_sq": torch.tensor([math.inf])}}, "param_groups": []}),
    ):
        bad = Checkpoint(good.model_config, model, {}, optimizer=optimizer)
        with pytest.raises(NonFiniteState, match=r"ckpt.pt not written: NaN or inf in (model\.w|optimizer\.state)"):
            save_checkpoint(path, bad)
        assert path.read_bytes() == before
    assert not list(tmp_path.glob("*.tmp"))


def test_a_nonfinite_checkpoint_on_disk_is_refused_by_every_reader(tmp_path: Path) -> None:
    """One written before the guard (or by hand): sample.py, eval.py, export and resume all read through
    load_checkpoint, which names it in one line instead of sampling garbage or crashing."""
    path = tmp_path / CKPT_NAME
    config = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=5)
    raw = Checkpoint(config, {"w": torch.tensor([math.inf])}, {"kind": "char"}).to_dict()
    torch.save(raw, path)
    with pytest.raises(CheckpointError, match=rf"{path} holds NaN or inf \(model.w\): a run that diverged wrote it"):
        load_checkpoint(path)


def test_skipped_steps_in_a_row_are_bounded(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Finite weights, non-finite losses (as from bad batches): skipped, counted, reset by a good step, and the
    run stops at train.max_consecutive_skips naming the first skipped iteration and what ckpt.pt holds."""
    trainer = _trainer(tmp_path, corpus_path, **{"train.on_nonfinite": "skip", "train.max_consecutive_skips": 3})
    accumulate = trainer._accumulate_gradients
    bad_iters = {0, 1, 3, 4}  # then 5 is the third in a row

    def accumulate_or_nan(it: int) -> torch.Tensor:
        loss = accumulate(it)
        return loss * math.nan if it in bad_iters or it >= 5 else loss

    monkeypatch.setattr(trainer, "_accumulate_gradients", accumulate_or_nan)
    with caplog.at_level(logging.WARNING, logger="train"):
        outcomes = [trainer.step() for _ in range(5)]
        assert [o.loss is None for o in outcomes] == [True, True, False, True, True]
        with pytest.raises(TrainingDiverged) as info:
            trainer.step()
    assert str(info.value) == (
        "the loss is nan at iter 5, 3 steps skipped in a row since iter 3 (train.max_consecutive_skips=3); "
        f"no {CKPT_NAME} was written before. Lower train.learning_rate (or keep train.grad_clip on)"
    )
    assert sum(m.startswith("skipped iter") for m in caplog.messages) == 4


def test_skipping_stops_at_once_when_the_weights_are_nonfinite(tmp_path: Path, corpus_path: Path) -> None:
    trainer = _trainer(tmp_path, corpus_path, **{"train.on_nonfinite": "skip"})
    with torch.no_grad():
        trainer.model.lm_head.weight[0, 0] = math.inf
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(TrainingDiverged, match=r"at iter 0 and the weights hold NaN or inf .*: skipping steps can't"):
        trainer.step()
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_a_finite_loss_over_nonfinite_optimizer_state_stops_the_run_at_its_next_save(
    tmp_path: Path, corpus_path: Path
) -> None:
    """AdamW's second moment at inf makes every update 0: losses stay finite, but no save can take the state.
    The run stops there (never 'done' with nothing written), best.pt's record unchanged."""
    extra = {"train.max_iters": 9, "train.eval_interval": 3, "train.keep_best": True}
    trainer = _trainer(tmp_path, corpus_path, **extra)

    def poison(it: int) -> None:
        if it == 4:
            for state in trainer.optimizer.state.values():
                state["exp_avg_sq"].fill_(math.inf)

    trainer.before_step = poison
    with pytest.raises(TrainingDiverged) as info:
        trainer.fit()
    run = tmp_path / "run"
    assert str(info.value).startswith("the state at iter 6 holds NaN or inf, though its val loss is ")
    assert f"{run / CKPT_NAME} keeps iter 3, the last good state" in str(info.value)
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 3
    assert load_checkpoint(run / BEST_NAME).progress.iter <= 3
