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
from training.metrics import Evaluator, HellaSwagEval, LogWindow, MetricsLog, sample_table
from training.optim import group_hyperparameters, set_hyperparameters
from training.resume import resume_command
from training.schema import TrainRunConfig

log = logging.getLogger("train")


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
    """A run's parts; only progress and the model, optimizer, GradScaler and RNG states change: what save() writes."""

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
    window: LogWindow | None = None  # the log line under way: its losses so far are saved with progress
    paced_from: tuple[float, int] | None = None  # perf_counter() and iter at the first timed log line: the ETA's

    def fit(self) -> TrainResult:
        """nanoGPT's loop. A signal stops the run after the current step, with a checkpoint."""
        p, train = self.progress, self.config.train
        if p.last_eval_iter == p.iter and self.reaches_target(p.val_loss):  # a resumed run that had stopped there
            return self.finish(None)
        tokens_per_iter = train.batch_size * train.grad_accum * self.model.config.block_size  # all processes'
        self.window = LogWindow(p, tokens_per_iter, self.flops_per_token, self.peak_flops)
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
                began = time.perf_counter()
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
                if torch.isfinite(loss):  # never a non-finite loss into the weights
                    if train.grad_clip > 0:
                        self.scaler.unscale_(self.optimizer)
                        torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip)
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                    self.window.add(loss)
                else:
                    self.stop_or_skip(loss, p.iter)
                self.optimizer.zero_grad(set_to_none=True)
                p.iter += 1
                self.log_step(began, lr)
                if stopping:
                    stopped_by = self.stop(stop.signal, save=bool(torch.isfinite(loss)))
                    break
        return self.finish(stopped_by)

    def train_batch(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows from (seed, step, micro-batch) alone: a resumed run, or another number of processes, sees these."""
        generator = batch_generator(self.config.seed, TRAIN_WINDOWS, it, micro)
        x, y = get_batch(self.data.train, self.config.train.batch_size, self.model.config.block_size, generator)
        return x.to(self.runtime.device, non_blocking=True), y.to(self.runtime.device, non_blocking=True)

    def stop_or_skip(self, loss: torch.Tensor, it: int) -> None:
        """train.on_nonfinite for a NaN or inf loss: stop (ckpt.pt keeps the last good state) or skip the step."""
        if self.config.train.on_nonfinite == "stop":
            raise TrainingDiverged(
                f"the loss is {loss.item()} at iter {it}; {self.last_checkpoint()}. Lower train.learning_rate (or keep "
                "train.grad_clip on), or set train.on_nonfinite=skip to drop such steps"
            )
        log.warning(f"skipped iter {it}: the loss is {loss.item()}")

    def last_checkpoint(self) -> str:
        """What the run directory holds now: the words of every message about the last good state."""
        if self.checkpointed_iter is None:
            return f"no {CKPT_NAME} was written before"
        return f"{self.out_dir / CKPT_NAME} keeps iter {self.checkpointed_iter}, the last good state"

    def evaluate_and_save(self) -> bool:
        """An eval line, and a checkpoint unless the val loss is non-finite; True if it reached the target."""
        p, train = self.progress, self.config.train
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

    def log_step(self, began: float, lr: float) -> None:
        """Every train.log_interval steps: the mean loss since the last line, speed, MFU, the time left."""
        due = self.progress.iter % self.config.train.log_interval == 0
        line = self.window.end_step(self.progress.iter - 1, began, due)
        if line is None:
            return
        train_loss, throughput = line
        record = {"iter": self.progress.iter, "train_loss": train_loss, "lr": lr, "elapsed_s": self.elapsed()}
        if "ms_per_iter" in throughput:
            record["eta_s"] = self.eta(throughput["ms_per_iter"])
        self.metrics.write({**record, **throughput})

    def eta(self, ms_per_iter: float) -> float:
        """Seconds to max_iters at the pace since the first timed log line, evaluations and checkpoints included."""
        now, left = time.perf_counter(), max(0, self.config.train.max_iters - self.progress.iter)
        if self.paced_from is None:
            self.paced_from = (now, self.progress.iter)
            return round(left * ms_per_iter / 1000, 1)
        began, first = self.paced_from
        return round((now - began) / max(1, self.progress.iter - first) * left, 1)

    def elapsed(self) -> float:
        """The run's wall time, its earlier processes included."""
        return round(self.elapsed_before + time.perf_counter() - self.started, 3)

    def save(self, latest: bool = True, best: bool = False) -> None:
        """best.pt first: a run killed between the two resumes from the previous ckpt.pt and writes it again."""
        model_state, optimizer_state = full_state(self.model, self.optimizer, self.world)
        rng = self.world.all_gather(self.rng_state())  # each rank's dropout stream
        if not self.world.is_main:
            return
        line_so_far = self.window.saved() if self.window else {}
        checkpoint = Checkpoint(
            model_config=self.model.config, model=model_state, tokenizer=self.data.meta["tokenizer"],
            config=self.resolved, progress=dataclasses.replace(self.progress, elapsed_s=self.elapsed(), **line_so_far),
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
        log.info(f"resuming {self.out_dir} at iter {self.progress.iter}")
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

    def stop(self, received: signal.Signals | None, save: bool) -> str:
        """A checkpoint, unless the last step was skipped for a non-finite loss (its weights may be NaN already)."""
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
