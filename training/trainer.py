"""One training run: its state (model, optimizer, Progress) and its loop, fit(). training/run.py's train() makes a
Trainer from the config and runs it."""

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

from common.cpu_threads import SlowdownWatch
from common.errors import DiskFull, NonFiniteState
from common.runtime import Runtime
from data.batches import TRAIN_WINDOWS, batch_generator, every_window, get_batch
from data.prepare import PreparedData
from data.tokenizers import Tokenizer
from model import GPT
from model.checkpoint import BEST_NAME, CKPT_NAME, Checkpoint, Progress, save_checkpoint
from training.distributed import World, full_state, gradient_sync, load_full_state
from training.errors import TrainingDiverged
from training.evaluation import Evaluator, HellaSwagEval, Losses
from training.metrics import LogWindow, MetricsLog, drop_records_after, sample_table
from training.optim import group_hyperparameters, set_hyperparameters
from training.preemption import StopRequests
from training.resume import resume_command
from training.run_lock import still_held
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
    dtype: str = "float32"  # the precision it trained in (train.dtype=auto decides it at start)


@dataclass
class StepOutcome:
    loss: torch.Tensor | None  # the step's mean loss over all micro-batches and ranks (0-dim); None if skipped
    lr: float
    stop: bool  # some rank was asked to stop: every rank stops after this step


@dataclass(eq=False, repr=False)
class Trainer:
    """What a run is made of. Only `progress`, the model's and optimizer's state, the GradScaler's and the random
    state change as it trains, and they are exactly what save() writes and restore() reads."""

    config: TrainRunConfig
    world: World
    runtime: Runtime
    out_dir: Path
    data: PreparedData
    tokenizer: Tokenizer
    model: GPT  # the plain module: checkpoints hold its names
    wrapped: nn.Module  # the model under DDP (or the model itself, sharded in place by FSDP2)
    step_model: nn.Module  # what forward passes call: `wrapped`, compiled or not
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    evaluator: Evaluator
    metrics: MetricsLog
    flops_per_token: float  # the whole model's, forward and backward, for MFU
    peak_flops: float | None  # all processes together; None: MFU left out
    remember_peak: Callable[[float], None] | None  # for a measured peak (LogWindow); None: a datasheet's
    started: float  # perf_counter() when this process's part of the run began
    progress: Progress = field(default_factory=Progress)
    elapsed_before: float = 0.0  # the run's wall time before this process (a resumed run's)
    before_step: Callable[[int], None] | None = None  # a test seam: called with the iteration before each step
    hellaswag: HellaSwagEval | None = None  # train.hellaswag_every > 0
    # For messages only, not the run's state: the iteration ckpt.pt holds (None: none written yet), and the
    # steps skipped in a row by train.on_nonfinite=skip in this process
    checkpointed_iter: int | None = None
    skipped_in_a_row: int = 0
    slowdown: SlowdownWatch | None = None  # on one CPU process: steps slowing down as another takes a core
    window: LogWindow | None = None  # the log line under way (fit's): its losses so far are saved with progress
    paced_from: tuple[float, int] | None = None  # perf_counter() and iter at the first timed log line: the ETA's

    def fit(self) -> TrainResult:
        """Evaluate (and checkpoint) when due, stop when done or the target is reached, step, log. A signal
        stops the run after the current step, with a checkpoint."""
        p, opt = self.progress, self.config.train
        if self._target_reached():
            log.info(f"the run already reached val loss {p.val_loss:.4f} <= {opt.target_val_loss} at iter {p.iter}")
            return self._finish(None)
        window = LogWindow(p, self._tokens_per_iter(), self.flops_per_token, self.peak_flops, self.remember_peak)
        self.window = window
        stopped_by = None
        self.model.train()
        with StopRequests(second_quits=not self.world.distributed) as stop:
            while True:
                if self._eval_due() and self._evaluate_and_save():
                    break  # the target is reached
                if p.iter >= opt.max_iters:
                    break
                if self.before_step is not None:
                    self.before_step(p.iter)
                step_began = time.perf_counter()
                outcome = self.step(stop_requested=lambda: stop.signal is not None)
                window.add(outcome.loss)
                log_now = p.iter % opt.log_interval == 0
                self._log_step(window.end_step(p.iter - 1, step_began, log_now), outcome.lr, step_began)
                if outcome.stop:
                    stopped_by = self._stop(stop.signal)
                    break
        return self._finish(stopped_by)

    def step(self, stop_requested: Callable[[], bool] | None = None) -> StepOutcome:
        """One optimizer step over train.grad_accum micro-batches, this rank's share of them. The windows depend
        only on the seed and the iteration. A non-finite loss never reaches the weights. stop_requested is asked
        once the gradients are in (a signal usually arrives during forward and backward): then this step is the
        run's last, on every rank."""
        it = self.progress.iter
        lr = set_hyperparameters(self.optimizer, self.config.train, it)
        local_loss = self._accumulate_gradients(it)
        asked = stop_requested is not None and stop_requested()
        loss, stop = self.world.agree_on_step(local_loss, asked)
        applied = self._apply_gradients(loss, it)
        self.progress.iter += 1
        return StepOutcome(loss if applied else None, lr, stop)

    def _accumulate_gradients(self, it: int) -> torch.Tensor:
        local_accum = self.config.train.grad_accum // self.world.size
        device = self.runtime.device
        step_loss = torch.zeros((), device=device)
        for local in range(local_accum):
            micro = self.world.rank * local_accum + local  # the step's micro-batches, split between the ranks
            generator = batch_generator(self.config.seed, TRAIN_WINDOWS, it, micro)
            x, y = get_batch(self.data.train, self.config.train.batch_size, self.model.config.block_size, generator)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with gradient_sync(self.wrapped, local == local_accum - 1):  # reduce on the last micro-batch only
                with self.runtime.autocast():
                    _, loss = self.step_model(x, y)
                loss = loss / local_accum  # and DDP/FSDP average over the ranks: the mean of all micro-batches
                self.scaler.scale(loss).backward()
            step_loss += loss.detach()
        return step_loss

    def _apply_gradients(self, loss: torch.Tensor, it: int) -> bool:
        """Checked before the step, so a non-finite loss never reaches the weights; False when the step was
        skipped (_refuse_nonfinite)."""
        if not torch.isfinite(loss):
            self._refuse_nonfinite(loss, it)
            return False
        self.skipped_in_a_row = 0
        if self.config.train.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)  # also sharded
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _refuse_nonfinite(self, loss: torch.Tensor, it: int) -> None:
        """train.on_nonfinite: stop, or skip the step. A finite loss can still step the weights to NaN or inf: then
        every later loss is non-finite, and skipping can't help, so the run stops, as it does after
        train.max_consecutive_skips skips in a row."""
        opt = self.config.train
        self.optimizer.zero_grad(set_to_none=True)
        diverged = not self._weights_finite()
        weights = " and the weights hold NaN or inf (the step before made them so)" if diverged else ""
        fix = "Lower train.learning_rate (or keep train.grad_clip on)"
        if opt.on_nonfinite == "stop":
            raise TrainingDiverged(
                f"the loss is {loss.item()} at iter {it}{weights}; {self._kept()}. {fix}, or set "
                "train.on_nonfinite=skip to drop such steps"
            )
        self.skipped_in_a_row += 1
        if diverged:
            raise TrainingDiverged(
                f"the loss is {loss.item()} at iter {it}{weights}: skipping steps can't undo that; "
                f"{self._kept()}. {fix}"
            )
        if self.skipped_in_a_row >= opt.max_consecutive_skips:
            first = it - self.skipped_in_a_row + 1
            raise TrainingDiverged(
                f"the loss is {loss.item()} at iter {it}, {self.skipped_in_a_row} steps skipped in a row since "
                f"iter {first} (train.max_consecutive_skips={opt.max_consecutive_skips}); {self._kept()}. {fix}"
            )
        log.warning(f"skipped iter {it}: the loss is {loss.item()}")

    def _weights_finite(self) -> bool:
        """On every rank alike (one reduction; each FSDP2 rank checks its shards)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        bad = sum(int(not t.isfinite().all()) for t in local)
        return self.world.all_reduce_sum(torch.tensor(float(bad), device=self.runtime.device)).item() == 0

    def _kept(self) -> str:
        """What the run directory holds now: the words of every message about the last good state."""
        if self.checkpointed_iter is None:
            return f"no {CKPT_NAME} was written before"
        return f"{self.out_dir / CKPT_NAME} keeps iter {self.checkpointed_iter}, the last good state"

    def evaluate(self) -> Losses:
        return self.evaluator(self.step_model)

    def _evaluate_and_save(self) -> bool:
        """An eval line, and a checkpoint unless the val loss is non-finite; True if it reached the target."""
        p, target = self.progress, self.config.train.target_val_loss
        losses = self.evaluate()
        # against best.pt's own val loss, not best_val_loss: that may come from before keep_best was turned on
        best = self.config.train.keep_best and losses.val < p.kept_best_val_loss
        if best:
            p.kept_best_val_loss = losses.val
        p.val_loss, p.last_eval_iter = losses.val, p.iter
        p.best_val_loss = min(p.best_val_loss, losses.val)
        reached = self._reaches_target(losses.val)
        record = {
            "iter": p.iter,
            "train_loss": losses.train,
            "val_loss": losses.val,
            "val_bpb": losses.val_bpb,
            "elapsed_s": self.elapsed(),  # before HellaSwag: time_to_target_s is the training's (the next has it)
        }
        if self.hellaswag is not None and self.hellaswag.due(p.iter):
            record |= self.hellaswag(self.wrapped)  # not compiled: each example has its own length
        if reached:
            record["time_to_target_s"] = record["elapsed_s"]
        self.metrics.write(record)
        if not math.isfinite(losses.val):
            log.warning(f"val loss is {losses.val} at iter {p.iter}: keeping the previous checkpoint")
        else:
            # at iter 0 only best.pt, if kept (the initial weights); ckpt.pt too if max_iters=0 ends the run there
            latest = p.iter > 0 or p.iter >= self.config.train.max_iters
            if (latest or best) and not self.save(latest=latest, best=best):
                raise TrainingDiverged(  # finite losses, but NaN or inf in the optimizer state: the next step's
                    f"the state at iter {p.iter} holds NaN or inf, though its val loss is {losses.val:.4f}; "
                    f"{self._kept()}. Lower train.learning_rate (or keep train.grad_clip on)"
                )
        if reached:
            elapsed = record["elapsed_s"]
            log.info(f"reached val loss {losses.val:.4f} <= {target} at iter {p.iter}, {elapsed:.1f} s after the start")
        return reached

    def _eval_due(self) -> bool:
        p, opt = self.progress, self.config.train
        scheduled = p.iter % opt.eval_interval == 0 and p.iter >= opt.eval_from
        return (scheduled or p.iter == opt.max_iters) and p.last_eval_iter != p.iter

    def _target_reached(self) -> bool:
        """A resumed run that stopped at its target, evaluated at its last iteration."""
        p = self.progress
        return p.last_eval_iter == p.iter and self._reaches_target(p.val_loss)

    def _reaches_target(self, val_loss: float) -> bool:
        target = self.config.train.target_val_loss
        return target is not None and val_loss <= target

    @property
    def resolved(self) -> dict[str, Any]:
        """The config as config.yaml and the checkpoint hold it."""
        return dataclasses.asdict(self.config)

    def _log_step(self, window: tuple[float, dict[str, float]] | None, lr: float, step_began: float) -> None:
        if self.slowdown is not None and (note := self.slowdown.notice(time.perf_counter() - step_began)):
            log.warning(note)
        if window is not None:
            train_loss, throughput = window
            record = {"iter": self.progress.iter, "train_loss": train_loss, "lr": lr, "elapsed_s": self.elapsed()}
            if "ms_per_iter" in throughput:
                record["eta_s"] = self._eta(throughput["ms_per_iter"])
            self.metrics.write({**record, **throughput})

    def _eta(self, ms_per_iter: float) -> float:
        """Seconds to max_iters: at the pace since this process's first timed log line, evaluations and checkpoints
        included (the first evaluation and warm-up come before it); at that line, the steps' own pace."""
        now, left = time.perf_counter(), max(0, self.config.train.max_iters - self.progress.iter)
        if self.paced_from is None:
            self.paced_from = (now, self.progress.iter)
            return round(left * ms_per_iter / 1000, 1)
        began, first = self.paced_from
        return round((now - began) / max(1, self.progress.iter - first) * left, 1)

    def elapsed(self) -> float:
        """The run's wall time, its earlier processes included."""
        return round(self.elapsed_before + time.perf_counter() - self.started, 3)

    def _tokens_per_iter(self) -> int:
        opt = self.config.train
        return opt.batch_size * opt.grad_accum * self.model.config.block_size  # all processes together

    def save(self, latest: bool = True, best: bool = False) -> bool:
        """ckpt.pt (latest) and/or best.pt (best) from the run's named state; best.pt first, so a run killed in
        between resumes from the previous ckpt.pt and writes best.pt again. A state holding NaN or inf is not
        written (False on every rank, with a warning): the files keep the last good one. Collective (every rank
        gathers under FSDP2, and hears rank 0's answer); rank 0 writes."""
        model_state, optimizer_state = full_state(self.model, self.optimizer, self.world)
        rng = self.world.all_gather(self._rng_state())  # each rank's dropout stream
        saved = self._write(model_state, optimizer_state, rng, latest, best) if self.world.is_main else True
        return self.world.broadcast(saved)

    def _write(self, model_state: dict, optimizer_state: dict | None, rng: list, latest: bool, best: bool) -> bool:
        still_held(self.out_dir)
        self.progress.elapsed_s = self.elapsed()
        checkpoint = Checkpoint(
            model_config=self.model.config,
            model=model_state,
            tokenizer=self.data.meta["tokenizer"],
            config=self.resolved,
            progress=dataclasses.replace(self.progress, **self.window.saved() if self.window else {}),
            optimizer=optimizer_state,
            scaler=self.scaler.state_dict(),
            rng=rng,
            dtype=self.runtime.dtype_name,
        )
        try:
            if best:
                save_checkpoint(self.out_dir / BEST_NAME, checkpoint)
                log.info(f"{BEST_NAME}: iter {self.progress.iter}, val loss {self.progress.val_loss:.4f}")
            if latest:
                save_checkpoint(self.out_dir / CKPT_NAME, checkpoint)
                self.checkpointed_iter = self.progress.iter
        except NonFiniteState as err:
            log.warning(f"{err}; {self._kept()}")
            return False
        except DiskFull as err:
            raise DiskFull(f"{err}; {self._kept()}. Free space, then resume: {resume_command(self.out_dir)}") from None
        return True

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue a saved run exactly: weights, optimizer and GradScaler, progress, random state, metrics. The
        optimizer's hyperparameters stay the config's (they may change on resume), not the saved ones."""
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
        self._restore_rng(checkpoint.rng)
        if self.world.is_main:
            drop_records_after(self.out_dir, self.progress.iter)  # written after the checkpoint by a killed run
        log.info(f"resuming {self.out_dir} at iter {self.progress.iter}")

    def _rng_state(self) -> dict[str, Any]:
        """Dropout draws from torch's global generators; batches and evaluation use their own."""
        cuda = [torch.cuda.get_rng_state(self.runtime.device)] if self.runtime.is_cuda else []
        return {"torch": torch.get_rng_state(), "cuda": cuda}

    def _restore_rng(self, states: list[dict[str, Any]]) -> None:
        """Each rank's own stream; with another number of processes than saved, dropout streams start afresh."""
        if len(states) != self.world.size:
            log.warning(f"resuming {len(states)} processes' run with {self.world.size}: dropout won't repeat exactly")
            return
        state = states[self.world.rank]
        torch.set_rng_state(state["torch"])
        if state["cuda"] and self.runtime.is_cuda:
            torch.cuda.set_rng_state(state["cuda"][0], self.runtime.device)

    def _stop(self, received: signal.Signals | None) -> str:
        saved = self.save()
        self.world.barrier()  # none exits before rank 0 has written: torchrun stops the others when one exits
        name = (received or signal.SIGTERM).name  # another rank's signal, forwarded by World.agree_on_step
        where = f"checkpoint {self.out_dir / CKPT_NAME}" if saved else self._kept()
        resume = resume_command(self.out_dir)
        log.warning(
            f"stopped by {name} at iter {self.progress.iter}; {where}. "
            + (f"Resume with: {resume}" if self.checkpointed_iter is not None else "Nothing to resume")
        )
        return name

    def _finish(self, stopped_by: str | None) -> TrainResult:
        p = self.progress
        sharded = self.world.distributed and self.config.train.parallel == "fsdp"
        # generate() can't run on one rank's shards, and a preempted run has no time to spare
        if self.metrics.wandb_run is not None and stopped_by is None and not sharded:
            first = int(next(every_window(self.data.val, 1, 1))[0][0, 0])  # the val split's first token
            self.metrics.log_samples(p.iter, sample_table(self.model, self.tokenizer, first, self.runtime))
        self.metrics.close()
        if stopped_by is None:
            if self.checkpointed_iter is None:
                where = "no checkpoint written"
            elif self.checkpointed_iter == p.iter:
                where = f"checkpoint {self.out_dir / CKPT_NAME}"
            else:
                where = self._kept()
            log.info(
                f"done: {p.iter} iters, val loss {p.val_loss:.4f} (best {p.best_val_loss:.4f}), "
                f"{self.elapsed():.1f} s; {where}"
            )
        dtype = self.runtime.dtype_name
        return TrainResult(self.out_dir, p.iter, p.val_loss, p.best_val_loss, self.elapsed(), stopped_by, dtype)
