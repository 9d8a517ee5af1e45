"""One training run: its state (model, optimizer, Progress) and its loop, fit(); training/run.py builds it."""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.errors import DiskFull, TrainingDiverged
from common.runtime import Runtime
from data.prepare import TRAIN_WINDOWS, PreparedData, batch_generator, every_window, get_batch
from data.tokenizers import Tokenizer
from model import GPT
from model.checkpoint import BEST_NAME, CKPT_NAME, Checkpoint, Progress, save_checkpoint
from training.distributed import World, full_state, gradient_sync, load_full_state
from training.metrics import Evaluator, HellaSwagEval, MetricsLog, sample_table
from training.optim import group_hyperparameters, set_hyperparameters
from training.resume import resume_command
from training.schema import TrainRunConfig

log = logging.getLogger("train")
MAX_SKIPS_IN_A_ROW = 100  # train.on_nonfinite=skip gives up after so many steps skipped in a row


@dataclass
class TrainResult:
    out_dir: Path
    iters: int
    val_loss: float
    best_val_loss: float
    elapsed_s: float
    stopped_by: str | None = None  # the signal that ended the run early, if one did
    dtype: str = "float32"  # the precision it trained in


class StopRequests:
    """Ctrl-C and SIGTERM while the loop runs: noted, so the step under way finishes and a checkpoint is written. A
    second one quits at once, except under torchrun, whose ranks may get two at once (torchrun kills what lingers)."""

    def __init__(self, second_quits: bool) -> None:
        self.signal: signal.Signals | None = None
        self.second_quits = second_quits

    def __enter__(self) -> StopRequests:
        self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum: int, frame: object) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum)
            log.warning(f"{self.signal.name}: finishing this step and writing a checkpoint (again to quit at once)")
        elif self.second_quits:
            raise KeyboardInterrupt


@dataclass(eq=False, repr=False)
class Trainer:
    """A run's parts. What changes is what save() writes (progress, the model, optimizer, GradScaler and RNG states)
    and the log line's tally and clock."""

    config: TrainRunConfig
    world: World
    runtime: Runtime
    out_dir: Path
    data: PreparedData
    tokenizer: Tokenizer
    model: GPT  # the plain module: checkpoints hold its names (sharded in place under FSDP2)
    step_model: nn.Module  # what forward passes run through: the model under DDP, compiled or not
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # float16's loss scaling; a no-op otherwise
    evaluator: Evaluator
    metrics: MetricsLog
    flops_per_token: float  # the whole model's, forward and backward, for MFU
    peak_flops: float | None  # all processes together; None: MFU left out
    started: float  # perf_counter() when this process's part of the run began
    progress: Progress = field(default_factory=Progress)
    elapsed_before: float = 0.0  # the run's wall time before this process (a resumed run's)
    before_step: Callable[[int], None] | None = None  # a test seam: called with the iteration before each step
    hellaswag: HellaSwagEval | None = None  # train.hellaswag_every > 0
    checkpointed_iter: int | None = None  # the iteration ckpt.pt holds (None: none written yet), for messages
    # Sums on the device, so that no step waits for them: the applied steps' loss and their number since the last
    # log line; the steps skipped since the last check, the first one's iteration; the skips in a row until now.
    tally: torch.Tensor | None = None
    clock: tuple[float, int] | None = None  # perf_counter() and iter where the log line's timing began

    def fit(self) -> TrainResult:
        """nanoGPT's loop, in which a step never waits for the device: NaN and inf losses are skipped there and
        reported at log lines and evaluations. A signal stops the run after the current step, with a checkpoint."""
        p, train = self.progress, self.config.train
        if p.last_eval_iter == p.iter and self.reaches_target(p.val_loss):  # a resumed run that had stopped there
            return self.finish(None)
        self.tally = torch.tensor([p.log_loss_sum, p.log_steps, 0, 0, 0], device=self.runtime.device)
        self.clock = paced_from = None  # the ETA's pace: from the end of this process's first step
        accum = train.grad_accum // self.world.size  # this process's share of the step's micro-batches
        stopped_by = None
        self.model.train()
        with StopRequests(second_quits=not self.world.distributed) as stop:
            while True:
                lr = set_hyperparameters(self.optimizer, train, p.iter)
                if self.eval_due() and self.evaluate_and_save():
                    break  # the target is reached
                if p.iter >= train.max_iters:
                    break
                if self.before_step is not None:
                    self.before_step(p.iter)
                loss = torch.zeros((), device=self.runtime.device)
                for micro in range(accum):
                    x, y = self.train_batch(p.iter, self.world.rank * accum + micro)
                    with gradient_sync(self.step_model, micro == accum - 1):  # reduce on the last one only
                        with self.runtime.autocast():
                            _, micro_loss = self.step_model(x, y)
                        micro_loss = micro_loss / accum  # DDP/FSDP average over ranks: the mean of all
                        self.scaler.scale(micro_loss).backward()
                    loss += micro_loss.detach()
                # a signal usually arrives during forward and backward: this step is then every rank's last
                loss, stopping = self.world.agree_on_step(loss, stop.signal is not None)
                self.optimizer_step(loss)
                p.iter += 1
                if paced_from is None:  # the first step (compilation, warm-up) is left out of the timing
                    self.runtime.synchronize()
                    paced_from = self.clock = (time.perf_counter(), p.iter)
                if p.iter % train.log_interval == 0:
                    self.log_line(lr, paced_from)
                if stopping:
                    stopped_by = self.stop(stop.signal)
                    break
        return self.finish(stopped_by)

    def train_batch(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows depend only on the seed, the step and the micro-batch, so a resumed run, or another number of
        processes, sees the same ones. On CUDA they are pinned: the copy runs while the host draws the next."""
        generator = batch_generator(self.config.seed, TRAIN_WINDOWS, it, micro)
        x, y = get_batch(self.data.train, self.config.train.batch_size, self.model.config.block_size, generator)
        if self.runtime.is_cuda:
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.runtime.device, non_blocking=True), y.to(self.runtime.device, non_blocking=True)

    def optimizer_step(self, loss: torch.Tensor) -> None:
        """Clip, step and zero the gradients, with no wait for the device: a step whose loss is NaN or inf is skipped
        on the device, by the optimizer's found_inf, and counted in the tally."""
        train, t = self.config.train, self.tally
        finite = torch.isfinite(loss)
        if train.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip)
        # Fused AdamW and MuonAdamW read found_inf on the device. Under float16, GradScaler sets its own (from the
        # gradients, which a NaN loss makes NaN too), and for MuonAdamW reads it on the host: a wait a step.
        self.optimizer.found_inf = (~finite).float()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        t[0] += torch.where(finite, loss, 0.0)
        t[1] += finite
        t[2] += ~finite
        t[3] = torch.where(~finite & (t[2] == 1), self.progress.iter, t[3])
        t[4] = (t[4] + 1) * ~finite

    def check_skips(self, evaluation: bool = False) -> int:
        """train.on_nonfinite for the steps skipped since the last check: stop (ckpt.pt keeps the last good state), or
        warn and go on, giving up after MAX_SKIPS_IN_A_ROW in a row, or at an evaluation none of whose steps since
        the last applied. Returns the skips in a row up to now."""
        skipped, first, in_a_row = (int(v) for v in self.tally[2:].tolist())
        p, train = self.progress, self.config.train
        self.tally[2] = 0  # and the next skip overwrites the first one's iteration
        said = f"the loss is not finite at iter {first}" + (f" and {skipped - 1} later step(s)" if skipped > 1 else "")
        if skipped and train.on_nonfinite == "stop":
            raise TrainingDiverged(f"{said}; {self.last_checkpoint()}. Lower train.learning_rate (or keep "
                                   "train.grad_clip on), or set train.on_nonfinite=skip to drop such steps")
        if in_a_row >= MAX_SKIPS_IN_A_ROW or (evaluation and 0 < p.iter - p.last_eval_iter <= in_a_row):
            raise TrainingDiverged(f"the loss is not finite at the last {in_a_row} steps, up to iter {p.iter - 1}: "
                                   f"train.on_nonfinite=skip gives up; {self.last_checkpoint()}. Lower "
                                   "train.learning_rate")
        if skipped:
            log.warning(f"skipped {skipped} step(s): {said}")
        return in_a_row

    def last_checkpoint(self) -> str:
        """What the run directory holds now: the words of every message about the last good state."""
        if self.checkpointed_iter is None:
            return f"no {CKPT_NAME} was written before"
        return f"{self.out_dir / CKPT_NAME} keeps iter {self.checkpointed_iter}, the last good state"

    def evaluate_and_save(self) -> bool:
        """An eval line, and a checkpoint unless the val loss is non-finite; True if it reached the target."""
        p, train = self.progress, self.config.train
        self.check_skips(evaluation=True)
        losses = self.evaluator(self.step_model)
        # against best.pt's own val loss, not best_val_loss: that may come from before keep_best was turned on
        best = train.keep_best and losses.val < p.kept_best_val_loss
        if best:
            p.kept_best_val_loss = losses.val
        p.val_loss, p.last_eval_iter = losses.val, p.iter
        p.best_val_loss = min(p.best_val_loss, losses.val)
        reached = self.reaches_target(losses.val)
        record = {"iter": p.iter, "train_loss": losses.train, "val_loss": losses.val, "val_bpb": losses.val_bpb,
                  "elapsed_s": self.elapsed()}  # before HellaSwag: time_to_target_s is the training's
        if self.hellaswag is not None and self.hellaswag.due(p.iter):
            record |= self.hellaswag(self.model)  # not compiled: each example has its own length
        if reached:
            record["time_to_target_s"] = record["elapsed_s"]
        self.metrics.write(record)
        if reached:
            log.info(f"reached val loss {losses.val:.4f} <= {train.target_val_loss} at iter {p.iter}")
        if not math.isfinite(losses.val):
            log.warning(f"val loss is {losses.val} at iter {p.iter}: keeping the previous checkpoint")
        elif p.iter > 0 or p.iter >= train.max_iters or best:  # at iter 0 only best.pt (or max_iters=0's end)
            self.save(latest=p.iter > 0 or p.iter >= train.max_iters, best=best)
        if self.clock is not None:  # the evaluation and the save are left out of the log line's timing
            self.clock = (time.perf_counter(), p.iter)
        return reached

    def eval_due(self) -> bool:
        p, train = self.progress, self.config.train
        scheduled = p.iter % train.eval_interval == 0 and p.iter >= train.eval_from
        return (scheduled or p.iter == train.max_iters) and p.last_eval_iter != p.iter

    def reaches_target(self, val_loss: float) -> bool:
        target = self.config.train.target_val_loss
        return target is not None and val_loss <= target

    @property
    def resolved(self) -> dict[str, Any]:
        """The config as config.yaml and the checkpoint hold it."""
        return dataclasses.asdict(self.config)

    def log_line(self, lr: float, paced_from: tuple[float, int]) -> None:
        """The mean loss of the steps applied since the last line; tokens/s and MFU over the steps since the line or
        evaluation before (the first step left out); the time left at the pace since paced_from, evaluations and
        checkpoints included. Reading the tally here is the loop's one wait for the device."""
        p, train = self.progress, self.config.train
        self.check_skips()
        loss_sum, applied = self.tally[:2].tolist()
        self.tally[:2] = 0
        now, (began, first) = time.perf_counter(), self.clock
        self.clock = (now, p.iter)
        if not applied:
            return
        record = {"iter": p.iter, "train_loss": loss_sum / applied, "lr": lr, "elapsed_s": self.elapsed()}
        steps, seconds = p.iter - first, now - began
        if steps:
            tokens_per_sec = train.batch_size * train.grad_accum * self.model.config.block_size * steps / seconds
            record |= {"ms_per_iter": 1000 * seconds / steps, "tokens_per_sec": tokens_per_sec}
            if self.peak_flops is not None:
                record["mfu"] = self.flops_per_token * tokens_per_sec / self.peak_flops
            left = max(0, train.max_iters - p.iter)
            record["eta_s"] = round((now - paced_from[0]) / max(1, p.iter - paced_from[1]) * left, 1)
        self.metrics.write(record)

    def elapsed(self) -> float:
        """The run's wall time, its earlier processes included."""
        return round(self.elapsed_before + time.perf_counter() - self.started, 3)

    def save(self, latest: bool = True, best: bool = False) -> None:
        """best.pt first: a run killed between the two resumes from the previous ckpt.pt and writes it again."""
        model_state, optimizer_state = full_state(self.model, self.optimizer, self.world)
        rng = self.world.all_gather(self.rng_state())  # each rank's dropout stream
        if not self.world.is_main:
            return
        progress = dataclasses.replace(self.progress, elapsed_s=self.elapsed())
        if self.tally is not None:  # the log line under way: a resumed run logs the same mean
            progress.log_loss_sum, applied = self.tally[:2].tolist()
            progress.log_steps = int(applied)
        checkpoint = Checkpoint(
            model_config=self.model.config, model=model_state, tokenizer=self.data.meta["tokenizer"],
            config=self.resolved, progress=progress,
            optimizer=optimizer_state, scaler=self.scaler.state_dict(), rng=rng, dtype=self.runtime.dtype_name,
        )
        try:
            if best:
                save_checkpoint(self.out_dir / BEST_NAME, checkpoint)
                log.info(f"{BEST_NAME}: iter {self.progress.iter}, val loss {self.progress.val_loss:.4f}")
            if latest:
                save_checkpoint(self.out_dir / CKPT_NAME, checkpoint)
                self.checkpointed_iter = self.progress.iter
        except DiskFull as err:
            then = f"Free space, then resume: {resume_command(self.out_dir)}"
            raise DiskFull(f"{err}; {self.last_checkpoint()}. {then}") from None

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue a saved run exactly, but keep the config's optimizer hyperparameters (resume may change them)."""
        configured = group_hyperparameters(self.optimizer)  # make_optimizer's, from this run's config
        optimizer_state = checkpoint.optimizer_state_for(self.model, self.optimizer)
        load_full_state(self.model, self.optimizer, checkpoint.model, optimizer_state)
        for group, hyperparameters in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(hyperparameters)
        if checkpoint.scaler:  # empty when the checkpoint's run didn't use fp16
            self.scaler.load_state_dict(checkpoint.scaler)
        self.progress = dataclasses.replace(checkpoint.progress)
        self.checkpointed_iter = checkpoint.progress.iter
        self.elapsed_before = checkpoint.progress.elapsed_s
        self.restore_rng(checkpoint.rng)
        if not self.config.train.keep_best and (self.out_dir / BEST_NAME).is_file() and self.world.is_main:
            log.warning(f"{BEST_NAME} stays as it is: this resume has train.keep_best=false")

    def rng_state(self) -> dict[str, Any]:
        """Dropout draws from torch's global generators; batches and evaluation use their own."""
        cuda = [torch.cuda.get_rng_state(self.runtime.device)] if self.runtime.is_cuda else []
        return {"torch": torch.get_rng_state(), "cuda": cuda}

    def restore_rng(self, states: list[dict[str, Any]]) -> None:
        """Each rank's own stream; with another number of processes than saved, dropout streams start afresh."""
        if len(states) != self.world.size:
            log.warning(f"resuming {len(states)} processes' run with {self.world.size}: dropout won't repeat exactly")
            return
        state = states[self.world.rank]
        torch.set_rng_state(state["torch"])
        if state["cuda"] and self.runtime.is_cuda:
            torch.cuda.set_rng_state(state["cuda"][0], self.runtime.device)

    def stop(self, received: signal.Signals | None) -> str:
        """A checkpoint, unless the last step was skipped for a non-finite loss (its weights may be NaN already)."""
        save = self.check_skips() == 0
        if save:
            self.save()
        self.world.barrier()  # none exits before rank 0 has written: torchrun stops the others when one exits
        name = (received or signal.SIGTERM).name  # another rank's signal, forwarded by World.agree_on_step
        where = f"checkpoint {self.out_dir / CKPT_NAME}" if save else self.last_checkpoint()
        resume = "Nothing to resume"
        if self.checkpointed_iter is not None:
            resume = f"Resume with: {resume_command(self.out_dir)}"
        log.warning(f"stopped by {name} at iter {self.progress.iter}; {where}. {resume}")
        return name

    def finish(self, stopped_by: str | None) -> TrainResult:
        p = self.progress
        if self.metrics.wandb_run is not None and stopped_by is None:  # a preempted run has no time to spare
            self.log_samples()
        self.metrics.close()
        if stopped_by is None:
            log.info(f"done: {p.iter} iters, val loss {p.val_loss:.4f} (best {p.best_val_loss:.4f}), "
                     f"{self.elapsed():.1f} s; {self.last_checkpoint()}")
        return TrainResult(self.out_dir, p.iter, p.val_loss, p.best_val_loss, self.elapsed(), stopped_by,
                           self.runtime.dtype_name)

    def log_samples(self) -> None:
        """A few samples to wandb, to see what the numbers mean (generate() can't run on one rank's shards)."""
        if not (self.world.distributed and self.config.train.parallel == "fsdp"):
            first = int(next(every_window(self.data.val, 1, 1))[0][0, 0])  # the val split's first token
            self.metrics.log_samples(self.progress.iter, sample_table(self.model, self.tokenizer, first, self.runtime))
