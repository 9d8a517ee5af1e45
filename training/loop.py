"""The training run: data, model, optimizer, evaluation, logging and checkpoints."""

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
from training.errors import CheckpointError, ConfigError
from training.metrics import MetricsLog, open_wandb
from training.optim import lr_at, make_optimizer
from training.runtime import Runtime, make_runtime

log = logging.getLogger("train")


@dataclass
class TrainResult:
    out_dir: Path
    iters: int
    val_loss: float
    best_val_loss: float
    elapsed_s: float


def batch_generator(*keys: int) -> torch.Generator:
    """A generator determined by (seed, purpose, step, ...) alone, so batches don't depend on history."""
    seed = int(np.random.SeedSequence(keys).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def train(cfg: DictConfig) -> TrainResult:
    t_start = time.perf_counter()
    opt = cfg.train
    _check_positive(opt)
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
    if ckpt is not None:
        _check_same_shape(ckpt["model_config"], asdict(model_config))

    model = GPT(model_config).to(runtime.device)
    optimizer = make_optimizer(model, opt.learning_rate, opt.weight_decay, (opt.beta1, opt.beta2), runtime.device)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == torch.float16)
    start_iter, best_val = 0, math.inf
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_iter, best_val = ckpt["iter"], ckpt["best_val_loss"]
        log.info(f"resuming {out_dir} at iter {start_iter}")
    use_compile = runtime.is_cuda if opt.compile is None else opt.compile
    step_model = torch.compile(model) if use_compile else model

    resolved = OmegaConf.to_container(cfg, resolve=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    log.info(
        f"{model.num_params() / 1e6:.2f}M parameters, {data.meta['vocab_size']} tokens in the vocabulary, "
        f"device {runtime.device}, {str(runtime.dtype).removeprefix('torch.')}, compile {use_compile}, "
        f"out_dir {out_dir}"
    )
    metrics = MetricsLog(out_dir, open_wandb(**cfg.wandb, config=resolved, out_dir=out_dir))

    tokens_per_iter = opt.batch_size * opt.grad_accum * model_config.block_size
    decay_iters = opt.max_iters if opt.lr_decay_iters is None else opt.lr_decay_iters
    peak = runtime.peak_flops()
    loss_sum, train_s, steps_in_window = torch.zeros((), device=runtime.device), 0.0, 0
    val_loss = math.nan if ckpt is None else ckpt["val_loss"]
    it = start_iter
    model.train()
    while True:
        if (it % opt.eval_interval == 0 or it == opt.max_iters) and not (ckpt is not None and it == start_iter):
            losses = _evaluate(step_model, data, cfg, runtime)
            val_loss = losses["val"]
            best_val = min(best_val, val_loss)
            metrics.write(
                {
                    "iter": it,
                    "train_loss": losses["train"],
                    "val_loss": val_loss,
                    "elapsed_s": round(time.perf_counter() - t_start, 3),
                }
            )
            if it > start_iter:
                save_checkpoint(
                    out_dir / CKPT_NAME,
                    {
                        "model_config": asdict(model_config),
                        "model": model.state_dict(),  # the uncompiled module: no _orig_mod. prefix
                        "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(),
                        "iter": it,
                        "val_loss": val_loss,
                        "best_val_loss": best_val,
                        "tokenizer": data.meta["tokenizer"],
                        "config": resolved,
                    },
                )
        if it >= opt.max_iters:
            break

        t0 = time.perf_counter()
        lr = lr_at(it, opt.learning_rate, opt.min_lr, opt.warmup_iters, decay_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(opt.grad_accum):
            x, y = get_batch(
                data.train_bin, opt.batch_size, model_config.block_size, batch_generator(cfg.seed, 0, it, micro)
            )
            x, y = x.to(runtime.device, non_blocking=True), y.to(runtime.device, non_blocking=True)
            with runtime.autocast():
                _, loss = step_model(x, y)
            loss = loss / opt.grad_accum
            scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if opt.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        it += 1
        steps_in_window += 1
        logging_now = it % opt.log_interval == 0
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

    metrics.close()
    elapsed = time.perf_counter() - t_start
    log.info(
        f"done: {it} iters, val loss {val_loss:.4f} (best {best_val:.4f}), {elapsed:.1f} s; "
        f"checkpoint {out_dir / CKPT_NAME}"
    )
    return TrainResult(out_dir, it, val_loss, best_val, elapsed)


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


def _check_positive(opt: DictConfig) -> None:
    for key in ("batch_size", "grad_accum", "eval_interval", "eval_iters", "log_interval"):
        if opt[key] < 1:
            raise ConfigError(f"train.{key}={opt[key]} must be at least 1")
    if opt.max_iters < 0:
        raise ConfigError(f"train.max_iters={opt.max_iters} must be >= 0")


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
