"""The Trainer's loop and its seams: the schedule, precision, non-finite losses, accumulation, signals, log lines."""

from __future__ import annotations

import json
import logging
import math
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from common.config import typed_config
from common.errors import TrainingDiverged
from common.files import CKPT_NAME
from common.runtime import World, make_runtime
from conftest import compose_config, tiny_run_overrides
from data.prepare import TRAIN_WINDOWS, every_window, get_batch
from model.checkpoint import load_checkpoint
from train import TrainRunConfig, build_trainer, train
from training.trainer import Trainer, lr_at, sample_table


def _trainer(tmp_path: Path, corpus: Path, dtype: str = "float32", **extra: object) -> Trainer:
    """A trainer as train() builds it; its run directory made, as train() makes it once every check has passed."""
    config = typed_config(compose_config(tiny_run_overrides(tmp_path, corpus, **extra)), TrainRunConfig)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    return build_trainer(config, World(), make_runtime("cpu", dtype))


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("schedule", [{}, {"train.lr_schedule": "wsd", "train.cooldown_frac": 0.4}])
def test_each_step_takes_the_learning_rate_of_its_schedule(tmp_path: Path, corpus_path: Path, schedule: dict) -> None:
    keys = {"train.max_iters": 5, "train.eval_interval": 100, "train.log_interval": 1, **schedule}
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
    logged = [(r["iter"], r["lr"]) for r in _records(tmp_path / "run") if "lr" in r]
    kind = schedule.get("train.lr_schedule", "cosine")
    assert logged == [(it + 1, lr_at(it, 1e-3, 1e-4, 2, 5, kind, 0.4)) for it in range(5)]


def test_a_nonfinite_loss_never_touches_the_weights(tmp_path: Path, corpus_path: Path) -> None:
    """on_nonfinite=stop: one line naming the iteration, at the next check; skip: the steps are dropped, and a run
    none of whose steps since the last evaluation applied gives up in one line."""
    trainer = _trainer(tmp_path / "stop", corpus_path, **{"train.max_iters": 3})
    with torch.no_grad():
        trainer.model.lm_head.weight[0, 0] = math.inf
    before = _weights(trainer)
    stopped = rf"gradients are not finite at iter 0 and 2 later step\(s\); no {CKPT_NAME} was written before"
    with pytest.raises(TrainingDiverged, match=stopped):
        trainer.fit()  # the check comes at the evaluation at iter 3, before the first log line
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

    skipping = _trainer(tmp_path / "skip", corpus_path, **{"train.max_iters": 3, "train.on_nonfinite": "skip"})
    forward = skipping.step_model.forward

    def nan_loss(x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, loss = forward(x, y)
        return logits, None if loss is None else loss * math.nan  # finite weights, NaN training losses

    skipping.step_model.forward = nan_loss
    before = _weights(skipping)
    with pytest.raises(TrainingDiverged, match="at the last 3 steps, up to iter 2: train.on_nonfinite=skip gives up"):
        skipping.fit()
    assert all(torch.equal(before[k], v) for k, v in skipping.model.state_dict().items())
    assert not (tmp_path / "skip" / "run" / CKPT_NAME).exists()


def test_skipping_gives_up_after_a_bounded_run_of_skips(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two evaluations far apart, the log lines give up once MAX_SKIPS_IN_A_ROW steps in a row were skipped;
    a NaN step between applied ones is only a warning."""
    import training.trainer

    monkeypatch.setattr(training.trainer, "MAX_SKIPS_IN_A_ROW", 4)
    keys = {"train.max_iters": 100, "train.eval_interval": 100, "train.log_interval": 1, "train.on_nonfinite": "skip"}
    trainer = _trainer(tmp_path, corpus_path, **keys)
    forward = trainer.step_model.forward

    def nan_at_2_then_from_5(x: torch.Tensor, y: torch.Tensor | None = None) -> tuple:
        logits, loss = forward(x, y)
        poisoned = trainer.progress.iter == 2 or trainer.progress.iter >= 5
        return logits, loss * math.nan if poisoned and loss is not None else loss

    trainer.step_model.forward = nan_at_2_then_from_5
    with pytest.raises(TrainingDiverged, match="at the last 4 steps, up to iter 8: train.on_nonfinite=skip gives up"):
        trainer.fit()
    assert trainer.progress.iter == 9


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_optimizer_sees_gradients_clipped_to_train_grad_clip(tmp_path: Path, corpus_path: Path,
                                                                  optimizer: str) -> None:
    """Every step's gradients reach the optimizer with a norm at most train.grad_clip; with 0, as backward left them."""
    norms = {}
    for clip in (0.05, 0.0):
        keys = {"train.optimizer": optimizer, "train.max_iters": 3, "train.grad_clip": clip}
        trainer = _trainer(tmp_path / str(clip), corpus_path, **keys)
        seen = norms[clip] = []
        trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs, seen=seen: seen.append(
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]]))))
        trainer.fit()
    assert len(norms[0.05]) == 3 and all(n <= 0.05 * (1 + 1e-4) for n in norms[0.05])
    assert all(n > 0.05 for n in norms[0.0])  # the tiny model's gradients are larger: the bound above is the clip's


def test_float16s_overflows_are_gradscalers_to_skip_not_a_diverged_run(tmp_path: Path, corpus_path: Path) -> None:
    """Under float16 an inf gradient is GradScaler's overflow (its first steps have them at a scale of 65536): it skips
    the step and lowers the scale, and the run trains on, though on_nonfinite=stop would stop a non-finite one."""
    trainer = _trainer(tmp_path, corpus_path, "float16", **{"train.max_iters": 6})
    weight, scales = trainer.model.transformer.h[0].mlp.c_fc.weight, []
    weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf) if trainer.progress.iter == 3 else g)
    trainer.before_step = lambda it: scales.append(trainer.scaler.get_scale())
    result = trainer.fit()
    assert result.iters == 6 and math.isfinite(result.val_loss) and scales[4] < scales[3]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bfloat16_trains_to_float32s_val_loss(tmp_path: Path, corpus_path: Path, optimizer: str) -> None:
    """On CPU within 1 % after 40 iterations (measured: 1e-5); exact resume in bfloat16: tests/test_crash_safety.py."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        extra = {"train.dtype": dtype, "train.optimizer": optimizer, "train.max_iters": 40, "train.eval_interval": 20}
        losses[dtype] = train(compose_config(tiny_run_overrides(tmp_path / dtype, corpus_path, **extra))).val_loss
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.01)
    assert losses["bfloat16"] != losses["float32"]  # bfloat16 really ran: not the very same numbers


def _state(trainer: Trainer) -> list[torch.Tensor]:
    """Weights, and every optimizer state tensor (moments, momentum buffers, step counts), copied."""
    optimizer = trainer.optimizer.state_dict()["state"]
    return [*_weights(trainer).values(), *(v.clone() for s in optimizer.values() for v in s.values())]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_an_inf_gradient_with_a_finite_loss_skips_the_step_whole(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture, optimizer: str
) -> None:
    """Clipping would turn one inf gradient into NaNs everywhere: the step is skipped instead, on the device, and the
    weights, moments and step counts come out of it bit for bit as they went in; the next step applies."""
    keys = {"train.optimizer": optimizer, "train.max_iters": 5, "train.on_nonfinite": "skip", "train.log_interval": 1}
    trainer = _trainer(tmp_path, corpus_path, **keys)
    weight = trainer.model.transformer.h[0].mlp.c_fc.weight  # Muon's under muon, AdamW's under adamw
    weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf) if trainer.progress.iter == 3 else g)
    states = {}
    trainer.before_step = lambda it: states.setdefault(it, _state(trainer))
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(states[3], states[4], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(states[2], states[3], strict=True))  # the others applied
    assert all(t.isfinite().all() for t in _state(trainer))
    assert "skipped 1 step(s): the loss or its gradients are not finite at iter 3" in caplog.messages


def test_a_full_val_evaluation_runs_one_shape_and_scores_every_window(tmp_path: Path, corpus_path: Path) -> None:
    """The split's last batch of windows runs padded to the others' size (a compiled model compiles once), and the
    loss is every window's, the padding's left out."""
    trainer = _trainer(tmp_path, corpus_path, **{"train.full_val": True})
    shapes = []
    trainer.model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    val = trainer.evaluator(trainer.model).val
    assert set(shapes) == {(8, 32), (128, 32)}  # train's batches, val's 4096-token ones
    nats = count = 0
    with torch.no_grad():
        for x, y in every_window(trainer.data.val, 128, 32):
            nats += F.cross_entropy(trainer.model(x)[0].flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    assert count % (128 * 32) and val == pytest.approx(nats / count, rel=1e-5)


class HostReads(TorchDispatchMode):
    """Counts what would make the host wait for a GPU: a float or bool tensor's value read into Python (item, bool,
    float, tolist) and operations whose output's shape depends on the values."""

    WAITING_OPS = (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default)

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.count = 0
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor: torch.Tensor) -> object:
            self.count += tensor.dtype.is_floating_point or tensor.dtype == torch.bool
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        read = func is torch.ops.aten._local_scalar_dense.default and (
            args[0].dtype.is_floating_point or args[0].dtype == torch.bool)
        self.count += read or func in self.WAITING_OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_steady_state_step_reads_nothing_from_the_device(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    """Between log lines and evaluations a step never waits for the device: the non-finite check, clipping, the
    optimizer's step (its step counts too), the loss tally and the learning rate stay there or in Python."""
    keys = {"train.optimizer": optimizer, "train.max_iters": 6, "train.eval_interval": 100, "train.log_interval": 100,
            "train.grad_accum": 2}
    trainer = _trainer(tmp_path, corpus_path, **keys)
    reads = HostReads(monkeypatch)
    reads_before_step = {}
    trainer.before_step = lambda it: reads_before_step.setdefault(it, reads.count)
    with reads:
        trainer.fit()
    assert reads_before_step[5] - reads_before_step[2] == 0  # steps 2, 3 and 4
    assert reads.count > reads_before_step[5]  # the evaluation at the end reads its sums: the count sees reads


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
    def batch(self: training.trainer.Trainer, it: int, micro: int) -> tuple[torch.Tensor, ...]:
        size = self.config.train.batch_size
        return tuple(t[micro * size : (micro + 1) * size] for t in windows[it])

    monkeypatch.setattr(training.trainer.Trainer, "train_batch", batch)
    accumulating = _trainer(
        tmp_path / "acc", corpus_path, **{"train.batch_size": 4, "train.grad_accum": 2, "train.optimizer": optimizer}
    )
    for trainer in (big, accumulating):
        trainer.config.train.max_iters = 3
        trainer.fit()
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


@pytest.mark.parametrize("peak_tflops", [None, 0.5])
def test_log_lines_give_the_mean_loss_speed_and_eta_and_mfu_only_against_a_peak(
    tmp_path: Path, corpus_path: Path, peak_tflops: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    """train.dtype=auto trains a CPU run in float32; MFU is the model's FLOPs at the logged speed over the peak. The
    console says what metrics.jsonl holds; the first step (compilation, warm-up) is not timed."""
    keys = {"train.dtype": "auto", "train.max_iters": 6, "train.eval_interval": 100, "train.log_interval": 1}
    if peak_tflops:
        keys["train.peak_tflops"] = peak_tflops
    with caplog.at_level(logging.INFO, logger="train"):
        result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
    checkpoint = load_checkpoint(result.out_dir / CKPT_NAME)
    assert result.dtype == checkpoint.dtype == "float32"
    records = _records(result.out_dir)
    settings = records[0]["settings"]
    assert {"device": "cpu", "train.dtype": "float32", "train.compile": False}.items() <= settings.items()
    assert settings["threads"] == torch.get_num_threads()
    lines = [r for r in records if "lr" in r]
    untimed = {"iter", "train_loss", "lr", "elapsed_s"}
    assert [r["iter"] for r in lines] == [1, 2, 3, 4, 5, 6] and set(lines[0]) == untimed
    timed = untimed | {"ms_per_iter", "tokens_per_sec", "eta_s"} | ({"mfu"} if peak_tflops else set())
    assert all(set(r) == timed and math.isfinite(r["train_loss"]) and r["tokens_per_sec"] > 0 for r in lines[1:])
    assert lines[-1]["eta_s"] == 0
    if peak_tflops:
        flops_per_token, peak = checkpoint.build_model().flops_per_token(), peak_tflops * 1e12
        assert all(r["mfu"] == pytest.approx(flops_per_token * r["tokens_per_sec"] / peak) for r in lines[1:])
    said = [m for m in caplog.messages if m.startswith(("iter ", "step "))]
    first, last, evaluation = lines[0], lines[-1], records[-1]
    mfu = f", mfu {100 * last['mfu']:.1f}%" if peak_tflops else ""
    assert said[1:] == [
        f"iter 1/6: loss {first['train_loss']:.4f}, lr {first['lr']:.2e} (warm-up, not timed)",
        *said[2:6],
        f"iter 6/6: loss {last['train_loss']:.4f}, lr {last['lr']:.2e}, {last['ms_per_iter']:.1f} ms/iter, "
        f"{last['tokens_per_sec']:,.0f} tok/s{mfu}, ETA 0s",
        f"step 6: train loss {evaluation['train_loss']:.4f}, val loss {evaluation['val_loss']:.4f}, val "
        f"{evaluation['val_bpb']:.4f} bits/byte",
    ]


@pytest.mark.parametrize(("on_two_threads", "said"), [(5e9, True), (180e9, False)])
def test_the_first_timed_log_line_says_when_a_busy_cpu_keeps_the_threads_waiting(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    on_two_threads: float, said: bool
) -> None:
    """Beside two busy processes the CPU recipe took 8-11x longer a step on two threads than on one, and nothing said
    so. Matmuls on the run's threads far slower than on one thread (rates given here, not timed): one line, after the
    first timed log line, naming the fix."""
    monkeypatch.setattr("training.trainer.cpu_matmul_flops", lambda threads: 100e9 if threads == 1 else on_two_threads)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # said, not used: the run itself keeps one thread
    keys = {"train.max_iters": 15, "train.eval_interval": 100, "train.log_interval": 5}
    with caplog.at_level(logging.INFO, logger="train"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
    lines = [m for m in caplog.messages if m.startswith(("iter ", "the CPU is busy"))]
    busy = ("the CPU is busy: torch's 2 threads wait on each other (a matmul takes 20x as long on them as on one "
            "thread); run with no more threads than free cores, e.g. OMP_NUM_THREADS=1 python train.py ...")
    assert [line.partition(":")[0] for line in lines] == ["iter 5/15", *["the CPU is busy"] * said, "iter 10/15",
                                                          "iter 15/15"]
    assert not said or lines[1] == busy


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


def test_a_checkpoint_saved_with_unfused_adamw_resumes_with_the_fused_kernel(tmp_path: Path, corpus_path: Path) -> None:
    """An older MPS run saved its AdamW groups unfused; loaded as saved, every step refused the skip's found_inf."""
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})))
    path = tmp_path / "run" / CKPT_NAME
    raw = torch.load(path, weights_only=True)
    for group in raw["optimizer"]["param_groups"]:
        group["fused"] = None
    for state in raw["optimizer"]["state"].values():  # unfused AdamW keeps its step count on the CPU, in float32
        state["step"] = state["step"].cpu().float()
    torch.save(raw, path)
    more = {"resume": True, "resume_with_changes": True, "train.max_iters": 4}
    assert train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **more))).iters == 4
