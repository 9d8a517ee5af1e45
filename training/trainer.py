"""One training run: its state (model, optimizer, Progress) and its loop, fit(); the optimizer (AdamW, or Muon for
hidden matrices) and the learning rate's schedule (warmup, then cosine or warmup-stable-decay). train.py builds it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import DiskFull, TrainingDiverged, first_line
from common.files import BEST_NAME, CKPT_NAME, METRICS_NAME, RunDir
from common.runtime import Runtime, World, cpu_matmul_flops, full_state, gradient_sync, load_full_state, synchronize
from data.prepare import EVAL_WINDOWS, TRAIN_WINDOWS, PreparedData, batch_generator, every_window, get_batch
from data.tokenizers import Tokenizer
from evals.hellaswag import Example, hellaswag_sums
from evals.perplexity import TextScore, token_sums
from model import GPT
from model.checkpoint import Checkpoint, Progress
from model.gpt import DEFAULT_TEMPERATURE, DEFAULT_TOP_K
from training.muon import MUON_MOMENTUM_START, muon_adamw
from training.resume import resume_command

if TYPE_CHECKING:  # train.py builds the trainer: its schema, for annotations
    from train import TrainConfig, TrainRunConfig, WandbConfig

log = logging.getLogger("train")
MAX_SKIPS_IN_A_ROW = 100  # train.on_nonfinite=skip gives up after so many steps skipped in a row
# The tally's slots: the applied steps' loss and their number since the last log line; the steps skipped since the
# last check and the first one's iteration; the steps skipped in a row until now.
LOSS_SUM, APPLIED, SKIPPED, FIRST_SKIPPED, IN_A_ROW = range(5)


@dataclass
class TrainResult:
    out_dir: Path
    iters: int
    val_loss: float
    best_val_loss: float
    elapsed_s: float
    stopped_by: str | None = None  # the signal that ended the run early, if one did
    dtype: str = "float32"  # the precision it trained in


@dataclass
class StopRequests:
    """Ctrl-C and SIGTERM while the loop runs: noted, so the step under way finishes and a checkpoint is written. A
    second one quits at once, except under torchrun, whose ranks may get two at once (torchrun kills what lingers).
    Python runs a handler only between torch ops: one op that takes minutes holds off both."""

    second_quits: bool
    signal: signal.Signals | None = None  # the first one received

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
    and the log line's tally and timing."""

    config: TrainRunConfig
    world: World
    runtime: Runtime
    run_dir: RunDir  # out_dir: every file the run writes goes through it
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
    started: float  # perf_counter() when the run began, its earlier processes' time (a resumed run's) included
    progress: Progress = field(default_factory=Progress)
    before_step: Callable[[int], None] = lambda it: None  # a test seam: called with the iteration before each step
    # what else an evaluation scores, on the plain model, given it and the iteration: HellaSwagEval, HeadProbe
    extra_scores: list[Callable[[GPT, int], dict[str, Any]]] = field(default_factory=list)
    checkpointed_iter: int | None = None  # the iteration ckpt.pt holds (None: none written yet), for messages
    tally: torch.Tensor | None = None  # sums on the device, so that no step waits for them (LOSS_SUM's slots)
    timed_from: tuple[float, int] | None = None  # perf_counter() and iter where the log line's timing began

    @property
    def out_dir(self) -> Path:
        return self.run_dir.path

    def fit(self) -> TrainResult:
        """nanoGPT's loop; no step waits for the device (under torchrun, only for the ranks' agreement to stop). A
        signal stops the run after the current step, with a checkpoint."""
        progress, train = self.progress, self.config.train
        self.tally = torch.tensor([progress.log_loss_sum, progress.log_steps, 0, 0, 0], device=self.runtime.device)
        accum = train.grad_accum // self.world.size  # this process's share of the step's micro-batches
        eta_from = stopped_by = None  # the ETA's pace is measured from the end of this process's first step
        self.model.train()
        with StopRequests(second_quits=not self.world.distributed) as stop:
            while True:
                lr = set_hyperparameters(self.optimizer, train, progress.iter)
                if self.eval_due():
                    reached_target = self.evaluate_and_save()
                    if reached_target:
                        break
                if progress.iter >= train.max_iters:
                    break
                self.before_step(progress.iter)
                loss = torch.zeros((), device=self.runtime.device)
                for micro in range(accum):
                    x, y = self.train_batch(progress.iter, self.world.rank * accum + micro)
                    with gradient_sync(self.step_model, micro == accum - 1):  # reduce on the last one only
                        with self.runtime.autocast():
                            _, micro_loss = self.step_model(x, y)
                        micro_loss = micro_loss / accum  # DDP/FSDP average over ranks: the mean of all
                        self.scaler.scale(micro_loss).backward()
                    loss += micro_loss.detach()
                # a signal usually arrives during forward and backward: this step is then every rank's last
                loss, stopping = self.world.agree_on_step(loss, stop.signal is not None)
                self.optimizer_step(loss)
                progress.iter += 1
                if eta_from is None:  # the first step (compilation, warm-up) is left out of the timing
                    synchronize(self.runtime.device)
                    eta_from = self.timed_from = (time.perf_counter(), progress.iter)
                if progress.iter % train.log_interval == 0:
                    self.log_line(lr, eta_from)
                if stopping:
                    stopped_by = self.stop(stop.signal)
                    break
        return self.finish(stopped_by)

    def train_batch(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows from the seed, step and micro-batch alone: a resume, or another number of processes, sees the same.
        On CUDA they are pinned: the copy runs while the host draws the next."""
        generator = batch_generator(self.config.seed, TRAIN_WINDOWS, it, micro)
        x, y = get_batch(self.data.train, self.config.train.batch_size, self.model.config.block_size, generator)
        if self.runtime.is_cuda:
            x, y = x.contiguous().pin_memory(), y.contiguous().pin_memory()  # a strided view's copy would not overlap
        return x.to(self.runtime.device, non_blocking=True), y.to(self.runtime.device, non_blocking=True)

    def optimizer_step(self, loss: torch.Tensor) -> None:
        """Clip, step and zero the gradients with no wait for the device: a step whose loss or gradient norm is not
        finite is skipped on the device (found_inf) and counted in the tally."""
        train, tally = self.config.train, self.tally
        self.scaler.unscale_(self.optimizer)  # float16's loss scale out first; a no-op otherwise
        # the norm before clipping (grad_clip=0: max_norm inf, no clipping); an inf gradient makes it inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip or math.inf)
        finite = torch.isfinite(loss)
        if not self.scaler.is_enabled():  # float16's overflows are GradScaler's to skip, lowering its scale
            finite &= torch.isfinite(getattr(norm, "full_tensor", lambda: norm)())  # FSDP2: a DTensor
        # found_inf is the flag GradScaler hands an optimizer: fused AdamW's and MuonAdamW's kernels read it on the
        # device and leave weights, moments and step counts as they were when it is 1. Under float16, GradScaler sets
        # its own (from the gradients, which a NaN loss makes NaN too), and reads it on the host for MuonAdamW.
        self.optimizer.found_inf = (~finite).float()
        if self.runtime.device.type != "mps" or finite:  # MPS's fused kernels ignore found_inf: there, a wait
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        tally[LOSS_SUM] += torch.where(finite, loss, 0.0)
        tally[APPLIED] += finite
        tally[SKIPPED] += ~finite
        tally[FIRST_SKIPPED] = torch.where(~finite & (tally[SKIPPED] == 1), self.progress.iter, tally[FIRST_SKIPPED])
        tally[IN_A_ROW] = (tally[IN_A_ROW] + 1) * ~finite

    def check_skips(self, evaluation: bool = False, tally: list[float] | None = None) -> int:
        """train.on_nonfinite for the steps skipped since the last check; returns the skips in a row up to now.
        tally: the tally as just read (a log line's), else it is read here."""
        skipped, first, in_a_row = (int(v) for v in (tally or self.tally.tolist())[SKIPPED:])
        self.tally[SKIPPED] = 0  # and the next skip overwrites the first one's iteration
        if skipped or in_a_row:
            self.report_skips(skipped, first, in_a_row, evaluation)
        return in_a_row

    def report_skips(self, skipped: int, first: int, in_a_row: int, evaluation: bool) -> None:
        """Stop (ckpt.pt keeps the last good state), or warn and go on, giving up after MAX_SKIPS_IN_A_ROW in a row,
        or at an evaluation none of whose steps since the last applied."""
        progress, train = self.progress, self.config.train
        said = f"the loss or its gradients are not finite at iter {first}"
        said += f" and {skipped - 1} later step(s)" if skipped > 1 else ""
        if skipped and train.on_nonfinite == "stop":
            raise TrainingDiverged(f"{said}; {self.last_checkpoint()}. Lower train.learning_rate (or keep "
                                   "train.grad_clip on), or set train.on_nonfinite=skip to drop such steps")
        none_applied = evaluation and 0 < progress.iter - progress.last_eval_iter <= in_a_row  # since the last eval
        if in_a_row >= MAX_SKIPS_IN_A_ROW or none_applied:
            raise TrainingDiverged(f"the loss or its gradients are not finite at the last {in_a_row} steps, up to "
                                   f"iter {progress.iter - 1}: train.on_nonfinite=skip gives up; "
                                   f"{self.last_checkpoint()}. Lower train.learning_rate")
        if skipped:
            log.warning(f"skipped {skipped} step(s): {said}")

    def last_checkpoint(self) -> str:
        """What the run directory holds now: the words of every message about the last good state."""
        if self.checkpointed_iter is None:
            return f"no {CKPT_NAME} was written before"
        return f"{self.out_dir / CKPT_NAME} keeps iter {self.checkpointed_iter}, the last good state"

    def evaluate_and_save(self) -> bool:
        """An eval line, and a checkpoint unless the val loss is non-finite; True if it reached the target."""
        progress, train = self.progress, self.config.train
        self.check_skips(evaluation=True)
        losses = self.evaluator(self.step_model)
        # against best.pt's own val loss, not best_val_loss: that may come from before keep_best was turned on
        best = train.keep_best and losses.val < progress.kept_best_val_loss
        progress.kept_best_val_loss = losses.val if best else progress.kept_best_val_loss
        progress.val_loss, progress.last_eval_iter = losses.val, progress.iter
        progress.best_val_loss = min(progress.best_val_loss, losses.val)
        record = {"iter": progress.iter, "train_loss": losses.train, "val_loss": losses.val, "val_bpb": losses.val_bpb,
                  "elapsed_s": self.elapsed()}  # before HellaSwag: time_to_target_s is the training's
        for scores in self.extra_scores:  # not compiled: HellaSwag's examples each have their own length
            record |= scores(self.model, progress.iter)
        reached = self.reaches_target(losses.val)
        self.metrics.write(record | ({"time_to_target_s": record["elapsed_s"]} if reached else {}))
        said = f"step {progress.iter}: train loss {losses.train:.4f}, val loss {losses.val:.4f}, "
        said += f"val {losses.val_bpb:.4f} bits/byte"
        if "hellaswag_acc" in record:
            said += f", hellaswag acc {record['hellaswag_acc']:.4f} (acc_norm {record['hellaswag_acc_norm']:.4f})"
        log.info(said)
        if reached:
            log.info(f"reached val loss {losses.val:.4f} <= {train.target_val_loss} at iter {progress.iter}")
        latest = progress.iter > 0 or progress.iter >= train.max_iters  # at iter 0 only best.pt (or max_iters=0's end)
        if not math.isfinite(losses.val):
            log.warning(f"val loss is {losses.val} at iter {progress.iter}: keeping the previous checkpoint")
        elif latest or best:
            self.save(latest, best)
        self.timed_from = (time.perf_counter(), progress.iter)  # the evaluation and the save are left out of the timing
        return reached

    def eval_due(self) -> bool:
        progress, train = self.progress, self.config.train
        scheduled = progress.iter % train.eval_interval == 0 and progress.iter >= train.eval_from
        return (scheduled or progress.iter == train.max_iters) and progress.last_eval_iter != progress.iter

    def reaches_target(self, val_loss: float) -> bool:
        target = self.config.train.target_val_loss
        return target is not None and val_loss <= target

    def log_line(self, lr: float, eta_from: tuple[float, int]) -> None:
        """The mean loss of the steps applied since the last line; tokens/s and MFU over the steps since the line or
        evaluation before (the first step left out); the time left at the pace since eta_from, evaluations and
        checkpoints included. Reading the tally here is the loop's one wait for the device. On a CPU, the first timed
        line is followed by a warning when other processes keep the threads waiting on each other."""
        progress, train = self.progress, self.config.train
        tally = self.tally.tolist()
        self.check_skips(tally=tally)
        loss_sum, applied = tally[LOSS_SUM], tally[APPLIED]
        self.tally[[LOSS_SUM, APPLIED]] = 0
        now, (began, first) = time.perf_counter(), self.timed_from
        self.timed_from = (now, progress.iter)
        if not applied:
            return
        record = {"iter": progress.iter, "train_loss": loss_sum / applied, "lr": lr, "elapsed_s": self.elapsed()}
        said = f"iter {progress.iter}/{train.max_iters}: loss {record['train_loss']:.4f}, lr {lr:.2e}"
        steps, seconds = progress.iter - first, now - began
        if steps:
            tokens_per_sec = train.batch_size * train.grad_accum * self.model.config.block_size * steps / seconds
            record |= {"ms_per_iter": 1000 * seconds / steps, "tokens_per_sec": tokens_per_sec}
            said += f", {record['ms_per_iter']:.1f} ms/iter, {tokens_per_sec:,.0f} tok/s"
            if self.peak_flops is not None:
                record["mfu"] = self.flops_per_token * tokens_per_sec / self.peak_flops
                said += f", mfu {100 * record['mfu']:.1f}%"
            left = max(0, train.max_iters - progress.iter)
            record["eta_s"] = round((now - eta_from[0]) / max(1, progress.iter - eta_from[1]) * left, 1)
            said += f", ETA {_duration(record['eta_s'])}"
        self.metrics.write(record)
        log.info(said if steps else said + " (warm-up, not timed)")
        first_timed = steps and progress.iter - eta_from[1] <= train.log_interval and self.world.is_main
        if first_timed and self.runtime.device.type == "cpu" and (threads := torch.get_num_threads()) > 1:
            slowdown = cpu_matmul_flops(1) / cpu_matmul_flops(threads)  # 0.5 on 2 free cores, 6-42 on busy ones
            self.timed_from = (time.perf_counter(), progress.iter)  # the next line's timing leaves these out
            if slowdown > 2:
                log.warning(f"the CPU is busy: torch's {threads} threads wait on each other (a matmul takes "
                            f"{slowdown:.0f}x as long on them as on one thread); run with no more threads than free "
                            "cores, e.g. OMP_NUM_THREADS=1 python train.py ...")

    def elapsed(self) -> float:
        """The run's wall time, its earlier processes included."""
        return round(time.perf_counter() - self.started, 3)

    def save(self, latest: bool = True, best: bool = False) -> None:
        """best.pt first: a run killed between the two resumes from the previous ckpt.pt and writes it again."""
        model_state, optimizer_state = full_state(self.model, self.optimizer, self.world)
        cuda = [torch.cuda.get_rng_state(self.runtime.device)] if self.runtime.is_cuda else []
        rng = self.world.all_gather({"torch": torch.get_rng_state(), "cuda": cuda})  # each rank's dropout stream
        if not self.world.is_main:
            return
        loss_sum, applied = self.tally[[LOSS_SUM, APPLIED]].tolist()  # the log line under way: resumed, the same mean
        progress = dataclasses.replace(self.progress, elapsed_s=self.elapsed(), log_loss_sum=loss_sum,
                                       log_steps=int(applied))
        checkpoint = Checkpoint(self.model.config, model_state, self.data.meta["tokenizer"],
                                dataclasses.asdict(self.config), progress, optimizer_state, self.scaler.state_dict(),
                                rng, self.runtime.dtype_name)
        try:
            if best:
                self.run_dir.write(BEST_NAME, checkpoint.write)
                log.info(f"{BEST_NAME}: iter {self.progress.iter}, val loss {self.progress.val_loss:.4f}")
            if latest:
                self.run_dir.write(CKPT_NAME, checkpoint.write)
                self.checkpointed_iter = self.progress.iter
        except DiskFull as err:
            then = f"Free space, then resume: {resume_command(self.out_dir)}"
            raise DiskFull(f"{err}; {self.last_checkpoint()}. {then}") from None

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue a saved run exactly, but keep the config's optimizer hyperparameters (resume may change them)."""
        configured = [{k: group[k] for k in FROM_CONFIG if k in group} for group in self.optimizer.param_groups]
        optimizer_state = checkpoint.optimizer_state_for(self.optimizer)
        load_full_state(self.model, self.optimizer, checkpoint.model, optimizer_state)
        for group, hyperparameters in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(hyperparameters)
        if checkpoint.scaler:  # empty when the checkpoint's run didn't use fp16
            self.scaler.load_state_dict(checkpoint.scaler)
        self.progress = dataclasses.replace(checkpoint.progress)
        self.checkpointed_iter = checkpoint.progress.iter
        self.started -= checkpoint.progress.elapsed_s
        if len(checkpoint.rng) != self.world.size:  # each rank's dropout stream; batches and evaluation have their own
            log.warning(f"resuming {len(checkpoint.rng)} processes' run with {self.world.size}: dropout won't repeat "
                        "exactly")
        else:
            state = checkpoint.rng[self.world.rank]
            torch.set_rng_state(state["torch"])
            if state["cuda"] and self.runtime.is_cuda:
                torch.cuda.set_rng_state(state["cuda"][0], self.runtime.device)
        if not self.config.train.keep_best and (self.out_dir / BEST_NAME).is_file() and self.world.is_main:
            log.warning(f"{BEST_NAME} stays as it is: this resume has train.keep_best=false")

    def stop(self, received: signal.Signals | None) -> str:
        """A checkpoint, unless the last step was skipped for a non-finite loss (its weights may be NaN already)."""
        save = self.check_skips() == 0
        if save:
            self.save()
        self.world.barrier()  # none exits before rank 0 has written: torchrun stops the others when one exits
        name = (received or signal.SIGTERM).name  # another rank's signal, forwarded by World.agree_on_step
        where = f"checkpoint {self.out_dir / CKPT_NAME}" if save else self.last_checkpoint()
        then = "Nothing to resume" if self.checkpointed_iter is None else f"Resume with: {resume_command(self.out_dir)}"
        log.warning(f"stopped by {name} at iter {self.progress.iter}; {where}. {then}")
        return name

    def finish(self, stopped_by: str | None) -> TrainResult:
        progress = self.progress
        if self.metrics.wandb_run is not None and stopped_by is None:  # a preempted run has no time to spare
            self.log_samples()
        self.metrics.close()
        if stopped_by is None:
            log.info(f"done: {progress.iter} iters, val loss {progress.val_loss:.4f} (best "
                     f"{progress.best_val_loss:.4f}), {self.elapsed():.1f} s; {self.last_checkpoint()}")
        return TrainResult(self.out_dir, progress.iter, progress.val_loss, progress.best_val_loss, self.elapsed(),
                           stopped_by, self.runtime.dtype_name)

    def log_samples(self) -> None:
        """A few samples to wandb, to see what the numbers mean (generate() can't run on one rank's shards)."""
        if not (self.world.distributed and self.config.train.parallel == "fsdp"):
            import wandb

            first = int(next(every_window(self.data.val, 1, 1))[0][0, 0])  # the val split's first token
            rows = sample_table(self.model, self.tokenizer, first, self.runtime)
            self.metrics.wandb_run.log({"samples": wandb.Table(columns=["prompt", "sample"], data=rows)},
                                       step=self.progress.iter)


FROM_CONFIG = ("lr", "betas", "eps", "weight_decay", "momentum", "nesterov", "ns_steps")  # set by make_optimizer


def make_optimizer(model: nn.Module, train: TrainConfig, runtime: Runtime) -> torch.optim.Optimizer:
    """train.optimizer's, its param groups' hyperparameters from the config (restore() keeps them on resume)."""
    if train.optimizer == "muon":
        return muon_adamw(model, train, runtime.dtype)
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]  # matmuls, embeddings
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]  # biases, norms: no weight decay
    groups = [{"params": matrices, "weight_decay": train.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    # The fused kernel: one pass over all parameters, and it skips a step on the device (the trainer's found_inf).
    return torch.optim.AdamW(groups, lr=train.learning_rate, betas=(train.beta1, train.beta2), fused=True)


def set_hyperparameters(optimizer: torch.optim.Optimizer, train: TrainConfig, step: int) -> float:
    """The step's learning rate, from the step alone; Muon's scaled to muon_lr, and its momentum going in a straight
    line from MUON_MOMENTUM_START to muon_momentum over muon_momentum_warmup steps."""
    lr = lr_at(step, train.learning_rate, train.min_lr, train.warmup_iters, train.decay_iters, train.lr_schedule,
               train.cooldown_frac)
    for group in optimizer.param_groups:
        group["lr"] = lr
        if group.get("muon"):
            frac = min(step / train.muon_momentum_warmup, 1.0) if train.muon_momentum_warmup else 1.0
            group["lr"] = train.muon_lr * lr / train.learning_rate
            group["momentum"] = (1 - frac) * MUON_MOMENTUM_START + frac * train.muon_momentum
    return lr


def lr_at(step: int, learning_rate: float, min_lr: float, warmup_iters: int, decay_iters: int,
          schedule: str = "cosine", cooldown_frac: float = 0.2) -> float:
    """Linear warmup, then to min_lr at decay_iters: a half cosine, or (wsd) flat until a linear cooldown."""
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if step >= decay_iters:
        return min_lr
    if schedule == "wsd":
        cooldown_start = max(warmup_iters, decay_iters - round(cooldown_frac * decay_iters))
        progress = max(0, step - cooldown_start) / max(1, decay_iters - cooldown_start)
        return learning_rate - progress * (learning_rate - min_lr)
    progress = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


SPLIT_KEYS = {"train": 0, "val": 1}  # batch_generator's key for each split's own evaluation windows


@dataclass
class MetricsLog:
    run_dir: RunDir
    active: bool = True  # False on every torchrun rank but 0
    wandb_run: Any = None

    def start_wandb(self, config: WandbConfig, run_config: dict[str, Any]) -> None:
        """A wandb run beside the metrics (wandb is imported only here: it is slow)."""
        import wandb

        try:
            self.wandb_run = wandb.init(  # mode None: wandb follows $WANDB_MODE, online by default
                project=config.project, entity=config.entity, name=config.run_name, mode=config.mode,
                tags=list(config.tags), group=config.group, config=run_config, dir=str(self.run_dir.path),
                settings=wandb.Settings(init_timeout=config.init_timeout))
        except Exception as err:  # no API key, no network, a refused login: the run matters more than its charts
            log.warning(f"wandb did not start ({first_line(err)}); training goes on without it, metrics.jsonl has "
                        "everything")

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.run_dir.append(METRICS_NAME, json.dumps(strict, allow_nan=False))  # NaN and inf as null, read as NaN
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k not in ("iter", "heads")}, step=record["iter"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def sample_table(model: GPT, tokenizer: Tokenizer, first: int, runtime: Runtime, count: int = 3,
                 tokens: int = 200) -> list[list[str]]:
    """log_samples' rows: sample.py-style continuations of `first`, cut at end of text; drawn after the RNG is saved."""
    idx = torch.full((count, 1), first, dtype=torch.long, device=runtime.device)
    model.eval()
    with runtime.autocast():
        rows = model.generate(idx, tokens, DEFAULT_TEMPERATURE, DEFAULT_TOP_K)
    model.train()
    prompt, end = tokenizer.decode([first]), tokenizer.end_of_text
    texts = [tokenizer.decode(row[1:].tolist()) for row in rows]
    return [[prompt, prompt + (text.split(end)[0] if end else text)] for text in texts]


def _duration(seconds: float) -> str:
    """3h05m, 4m12s, 37s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass(frozen=True)
class Losses:
    train: float
    val: float
    val_bpb: float  # val in bits per byte of text: comparable across tokenizers


@dataclass
class Evaluator:
    """Mean loss over the same eval_iters random windows of each split (full_val: every block of val), and val in
    bits per byte of text, as nanochat. Ranks split the batches and sum: the result doesn't depend on their number."""

    data: PreparedData
    train: TrainConfig
    seed: int
    block_size: int
    byte_lengths: torch.Tensor  # UTF-8 bytes of each token id (0: a special token), float64 on the device
    runtime: Runtime
    world: World

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> Losses:
        model.eval()
        train, val = (TextScore.of(self._sums(model, split)) for split in ("train", "val"))
        model.train()
        return Losses(train.loss, val.loss, val.bpb)

    def _sums(self, model: torch.nn.Module, split: str) -> list[float]:
        """Nats and count of all target tokens; nats and UTF-8 bytes of the text ones; over all ranks. full_val's
        batches hold at least 4096 tokens, to keep small models' matmuls efficient (the result doesn't depend on it).
        A file's last batch runs padded with rows of token 0 to the others' size, their logits dropped: one shape, so
        a compiled model compiles its evaluation once."""
        files, batch_size = getattr(self.data, split), self.train.batch_size
        if split == "val" and self.train.full_val:
            batch_size = max(batch_size, 4096 // self.block_size)
            batches = every_window(files, batch_size, self.block_size)
        else:
            generator = batch_generator(self.seed, EVAL_WINDOWS, SPLIT_KEYS[split])
            batches = (get_batch(files, batch_size, self.block_size, generator) for _ in range(self.train.eval_iters))
        sums = torch.zeros(4, dtype=torch.float64, device=self.runtime.device)
        for x, y, counted in split_across_ranks(batches, self.world):
            with self.runtime.autocast():
                logits, _ = model(F.pad(x, (0, 0, 0, batch_size - len(x))).to(self.runtime.device))
            if counted:
                sums += token_sums(logits[: len(y)], y.to(self.runtime.device), self.byte_lengths)
        return self.world.all_reduce_sum(sums).tolist()


def split_across_ranks(items: Iterator[tuple], world: World) -> Iterator[tuple]:
    """This rank's every world.size-th item, flagged True; one repeated, flagged False, to keep FSDP2 in step."""
    while round_ := list(itertools.islice(items, world.size)):
        mine = world.rank < len(round_)
        yield (*round_[world.rank if mine else 0], mine)


@dataclass
class HellaSwagEval:
    """HellaSwag accuracy at evaluations whose iteration is a multiple of `every`; ranks split the examples and sum."""

    examples: list[Example]
    every: int
    block_size: int
    runtime: Runtime
    world: World

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, iter: int) -> dict[str, float]:
        if iter % self.every:
            return {}
        model.eval()
        shares = split_across_ranks(((example,) for example in self.examples), self.world)
        sums = hellaswag_sums(model, shares, self.block_size, self.runtime.device, self.runtime.autocast)
        model.train()
        correct, correct_norm, count = self.world.all_reduce_sum(sums.to(self.runtime.device)).tolist()
        return {"hellaswag_acc": correct / count, "hellaswag_acc_norm": correct_norm / count}
