"""The training run: data, model, optimizer, evaluation, logging, checkpoints and exact resume."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from data.batches import get_batch, num_tokens
from data.prepare import PreparedData, ensure_prepared
from model import GPT, GPTConfig
from training.checkpoint import CKPT_NAME, load_checkpoint, save_checkpoint
from training.errors import CheckpointError, ConfigError, TrainingDiverged
from training.metrics import MetricsLog, open_wandb
from training.optim import lr_at, make_optimizer
from training.preemption import StopRequests
from training.runtime import Runtime, make_runtime

log = logging.getLogger("train")
ON_NONFINITE = ("stop", "skip")


@dataclass
class TrainResult:
    out_dir: Path
    iters: int
    val_loss: float
    best_val_loss: float
    elapsed_s: float
    stopped_by: str | None = None  # the signal that ended the run early, if one did


def batch_generator(*keys: int) -> torch.Generator:
    """A generator determined by (seed, purpose, step, ...) alone, so batches don't depend on history:
    a resumed run sees exactly the windows the uninterrupted one would."""
    seed = int(np.random.SeedSequence(keys).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def train(cfg: DictConfig) -> TrainResult:
    t_start = time.perf_counter()
    opt = cfg.train
    _check_train_keys(opt)
    runtime = make_runtime(cfg.device, opt.dtype)
    out_dir = Path(cfg.out_dir)
    ckpt = load_checkpoint(out_dir / CKPT_NAME) if cfg.resume else None
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)

    data = ensure_prepared(**cfg.data)
    _check_data_fits(data, cfg.model.block_size)
    try:
        model_config = GPTConfig(vocab_size=data.meta["vocab_size"], **cfg.model)
    except ValueError as err:
        raise ConfigError(f"model.{err}") from None
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if ckpt is not None:
        _check_same_shape(ckpt["model_config"], asdict(model_config))
        _log_changed_keys(ckpt["config"], resolved)

    model = GPT(model_config).to(runtime.device)
    optimizer = make_optimizer(model, opt.learning_rate, opt.weight_decay, (opt.beta1, opt.beta2), runtime.device)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == torch.float16)
    it, best_val, val_loss, last_eval_iter = 0, math.inf, math.nan, -1
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        it, best_val, val_loss, last_eval_iter = (
            ckpt["iter"],
            ckpt["best_val_loss"],
            ckpt["val_loss"],
            ckpt["last_eval_iter"],
        )
        _restore_rng(ckpt["rng"])
        log.info(f"resuming {out_dir} at iter {it}")
    use_compile = runtime.is_cuda if opt.compile is None else opt.compile
    step_model = torch.compile(model) if use_compile else model

    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    log.info(
        f"{model.num_params() / 1e6:.2f}M parameters, {data.meta['vocab_size']} tokens in the vocabulary, "
        f"device {runtime.device}, {str(runtime.dtype).removeprefix('torch.')}, compile {use_compile}, "
        f"out_dir {out_dir}"
    )
    metrics = MetricsLog(out_dir, open_wandb(**cfg.wandb, config=resolved, out_dir=out_dir))

    def save() -> None:
        save_checkpoint(
            out_dir / CKPT_NAME,
            {
                "model_config": asdict(model_config),
                "model": model.state_dict(),  # the uncompiled module: no _orig_mod. prefix
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "iter": it,
                "last_eval_iter": last_eval_iter,
                "val_loss": val_loss,
                "best_val_loss": best_val,
                "rng": _rng_state(),
                "tokenizer": data.meta["tokenizer"],
                "config": resolved,
            },
        )

    tokens_per_iter = opt.batch_size * opt.grad_accum * model_config.block_size
    decay_iters = opt.max_iters if opt.lr_decay_iters is None else opt.lr_decay_iters
    peak = runtime.peak_flops()
    loss_sum, train_s, steps_in_window = torch.zeros((), device=runtime.device), 0.0, 0
    stopped_by = None
    model.train()
    with StopRequests() as stop:
        while True:
            if (it % opt.eval_interval == 0 or it == opt.max_iters) and last_eval_iter != it:
                losses = _evaluate(step_model, data, cfg, runtime)
                val_loss, last_eval_iter = losses["val"], it
                best_val = min(best_val, val_loss)
                metrics.write(
                    {
                        "iter": it,
                        "train_loss": losses["train"],
                        "val_loss": val_loss,
                        "elapsed_s": round(time.perf_counter() - t_start, 3),
                    }
                )
                if not math.isfinite(val_loss):
                    log.warning(f"val loss is {val_loss} at iter {it}: keeping the previous checkpoint")
                elif it > 0:
                    save()
            if it >= opt.max_iters:
                break

            t0 = time.perf_counter()
            lr = lr_at(it, opt.learning_rate, opt.min_lr, opt.warmup_iters, decay_iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = torch.zeros((), device=runtime.device)
            for micro in range(opt.grad_accum):
                generator = batch_generator(cfg.seed, 0, it, micro)
                x, y = get_batch(data.train_bin, opt.batch_size, model_config.block_size, generator)
                x, y = x.to(runtime.device, non_blocking=True), y.to(runtime.device, non_blocking=True)
                with runtime.autocast():
                    _, loss = step_model(x, y)
                loss = loss / opt.grad_accum
                scaler.scale(loss).backward()
                step_loss += loss.detach()
            if not torch.isfinite(step_loss):  # checked before the step: the weights stay finite
                optimizer.zero_grad(set_to_none=True)
                if opt.on_nonfinite == "stop":
                    raise TrainingDiverged(
                        f"the loss is {step_loss.item()} at iter {it}; {CKPT_NAME} keeps the last good state. "
                        "Lower train.learning_rate, or set train.on_nonfinite=skip to drop such steps"
                    )
                log.warning(f"skipped iter {it}: the loss is {step_loss.item()}")
            else:
                if opt.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                loss_sum += step_loss
                steps_in_window += 1
            it += 1
            logging_now = it % opt.log_interval == 0 and steps_in_window > 0
            if logging_now:
                train_loss = loss_sum.item() / steps_in_window  # .item() waits for the GPU: timed as training
                runtime.synchronize()
            train_s += time.perf_counter() - t0
            if logging_now:
                record: dict[str, Any] = {
                    "iter": it,
                    "train_loss": train_loss,
                    "lr": lr,
                    "ms_per_iter": 1000 * train_s / steps_in_window,
                    "tokens_per_sec": tokens_per_iter * steps_in_window / train_s,
                    "elapsed_s": round(time.perf_counter() - t_start, 3),
                }
                if peak is not None:
                    record["mfu"] = model.flops_per_token() * record["tokens_per_sec"] / peak
                metrics.write(record)
                loss_sum.zero_()
                train_s, steps_in_window = 0.0, 0
            if stop.signal is not None:
                save()
                stopped_by = stop.signal.name
                log.warning(
                    f"stopped by {stopped_by} at iter {it}; checkpoint {out_dir / CKPT_NAME}. "
                    f"Resume with: python train.py out_dir={out_dir} resume=true (and the same overrides)"
                )
                break

    metrics.close()
    elapsed = time.perf_counter() - t_start
    if stopped_by is None:
        log.info(
            f"done: {it} iters, val loss {val_loss:.4f} (best {best_val:.4f}), {elapsed:.1f} s; "
            f"checkpoint {out_dir / CKPT_NAME}"
        )
    return TrainResult(out_dir, it, val_loss, best_val, elapsed, stopped_by)


@torch.no_grad()
def _evaluate(model: torch.nn.Module, data: PreparedData, cfg: DictConfig, runtime: Runtime) -> dict[str, float]:
    """Mean loss over the same eval_iters random windows of each split at every evaluation."""
    model.eval()
    out = {}
    for split_index, (split, path) in enumerate((("train", data.train_bin), ("val", data.val_bin))):
        generator = batch_generator(cfg.seed, 1, split_index)
        total = torch.zeros((), device=runtime.device)
        for _ in range(cfg.train.eval_iters):
            x, y = get_batch(path, cfg.train.batch_size, cfg.model.block_size, generator)
            with runtime.autocast():
                _, loss = model(x.to(runtime.device), y.to(runtime.device))
            total += loss.float()
        out[split] = total.item() / cfg.train.eval_iters
    model.train()
    return out


def _rng_state() -> dict[str, Any]:
    """Dropout draws from torch's global generators; batches and evaluation use their own (above)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_train_keys(opt: DictConfig) -> None:
    for key in ("batch_size", "grad_accum", "eval_interval", "eval_iters", "log_interval"):
        if opt[key] < 1:
            raise ConfigError(f"train.{key}={opt[key]} must be at least 1")
    if opt.max_iters < 0:
        raise ConfigError(f"train.max_iters={opt.max_iters} must be >= 0")
    if opt.on_nonfinite not in ON_NONFINITE:
        raise ConfigError(f"train.on_nonfinite={opt.on_nonfinite} is unknown; use {' or '.join(ON_NONFINITE)}")


def _check_data_fits(data: PreparedData, block_size: int) -> None:
    for split, path in (("train", data.train_bin), ("val", data.val_bin)):
        n = num_tokens(path)
        if n <= block_size:
            raise ConfigError(
                f"the {split} split has {n} tokens, too few for model.block_size={block_size}; "
                "lower model.block_size or train on more text"
            )


def _check_same_shape(saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = [k for k in saved if k != "attn_impl" and saved[k] != current.get(k)]
    if changed:
        diffs = ", ".join(f"{k}: {saved[k]} -> {current.get(k)}" for k in changed)
        raise CheckpointError(
            f"resume=true with a model that differs from the checkpoint's ({diffs}); drop those overrides"
        )


def _log_changed_keys(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> None:
    """Training keys may change on resume (more iterations, another learning rate): say which did."""
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            _log_changed_keys(old, new, f"{prefix}{key}.")
        elif old != new and f"{prefix}{key}" not in ("resume", "out_dir"):
            log.info(f"resume: {prefix}{key} changed from {old} to {new}")
