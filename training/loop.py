"""The training run: data, model, optimizer, evaluation, logging, checkpoints and exact resume."""

from __future__ import annotations

import itertools
import json
import logging
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from data.batches import every_window, get_batch
from data.prepare import PreparedData, ensure_prepared
from data.tokenizers import tokenizer_from_metadata
from model import GPT, GPTConfig
from model.hf_gpt2 import load_pretrained
from training.checkpoint import CKPT_NAME, load_checkpoint, save_checkpoint
from training.distributed import (
    PARALLEL,
    World,
    agree_on_step,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    close_process_group,
    full_state,
    gradient_sync,
    init_process_group,
    load_full_state,
    world_from_env,
    wrap_model,
)
from training.errors import CheckpointError, ConfigError, TrainingDiverged
from training.metrics import MetricsLog, open_wandb
from training.mfu import peak_flops
from training.optim import lr_at, make_optimizer
from training.preemption import StopRequests
from training.runtime import Runtime, make_runtime
from training.sampling import Sampler
from training.schema import SampleConfig

log = logging.getLogger("train")
ON_NONFINITE = ("stop", "skip")
FREE_MODEL_KEYS = ("attn_impl", "dropout")  # may change on resume: the weights don't depend on them


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
    """One process's part of the run: all of it alone, or one rank's under torchrun."""
    world = world_from_env()
    if not world.is_main:
        log.setLevel(logging.WARNING)  # one voice: rank 0's
    opt = cfg.train
    _check_train_keys(opt, world)
    runtime = make_runtime(cfg.device, opt.dtype, world.local_rank if world.distributed else None)
    init_process_group(world, runtime.device)
    try:
        result = _train(cfg, world, runtime)
        barrier(world)  # leave together: none tears its process group down while rank 0 still writes
        return result
    finally:
        close_process_group()


def _train(cfg: DictConfig, world: World, runtime: Runtime) -> TrainResult:
    t_start = time.perf_counter()
    opt = cfg.train
    # Each rank's Hydra resolved ${now:} on its own clock: all write to rank 0's directory.
    cfg.out_dir = broadcast_from_main(cfg.out_dir, world)
    out_dir = Path(cfg.out_dir)
    if cfg.resume:
        ckpt = load_checkpoint(out_dir / CKPT_NAME)
    elif (out_dir / CKPT_NAME).exists():
        raise ConfigError(f"out_dir={out_dir} already holds a run; pass resume=true to continue it, or another out_dir")
    else:
        ckpt = None
    barrier(world)  # every rank has looked for a checkpoint before rank 0 writes anything
    if world.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if ckpt is None:
            (out_dir / "metrics.jsonl").unlink(missing_ok=True)  # from a run that died before its first checkpoint
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (FSDP2 shards each rank's own)

    if world.is_main:  # rank 0 tokenizes; the others then only read the prepared files
        data = ensure_prepared(**cfg.data)
    barrier(world)
    if not world.is_main:
        data = ensure_prepared(**cfg.data, prepare=False)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    model = _build_model(cfg, ckpt, data)
    model_config = model.config
    if ckpt is not None:
        _log_changed_keys(ckpt["config"], resolved)
    if world.rank:  # then each rank its own dropout masks (nanoGPT's seed offset); rank 0's stream goes on
        torch.manual_seed(cfg.seed + world.rank)
    block_size = model_config.block_size  # a finetune's may differ from model.block_size: the weights' own
    _check_data_fits(data, block_size)

    sharded = world.distributed and opt.parallel == "fsdp"
    if not sharded:
        model.to(runtime.device)  # fully_shard moves each rank's shards there itself: no GPU holds the whole model
    num_params, flops_per_token = model.num_params(), model.flops_per_token()  # before sharding
    wrapped = wrap_model(model, opt.parallel, world, runtime.device)  # FSDP2 shards `model` in place
    optimizer = make_optimizer(model, opt.learning_rate, opt.weight_decay, (opt.beta1, opt.beta2), runtime.device)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == torch.float16)
    it, best_val, val_loss, last_eval_iter = 0, math.inf, math.nan, -1
    elapsed_before = 0.0  # wall time of the run before this resume
    if ckpt is not None:
        load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"])
        for group in optimizer.param_groups:  # the config's hyperparameters, not the saved ones
            group["betas"] = (opt.beta1, opt.beta2)
        optimizer.param_groups[0]["weight_decay"] = opt.weight_decay
        if ckpt["scaler"]:  # empty when the checkpoint's run didn't use fp16
            scaler.load_state_dict(ckpt["scaler"])
        elapsed_before = ckpt.get("elapsed_s", 0.0)
        it, best_val, val_loss, last_eval_iter = (
            ckpt["iter"],
            ckpt["best_val_loss"],
            ckpt["val_loss"],
            ckpt["last_eval_iter"],
        )
        _restore_rng(ckpt["rng"], world, runtime)
        if world.is_main:
            _drop_records_after(out_dir / "metrics.jsonl", it)  # written after the checkpoint by a killed run
        log.info(f"resuming {out_dir} at iter {it}")
    use_compile = runtime.is_cuda if opt.compile is None else opt.compile
    step_model = torch.compile(wrapped) if use_compile else wrapped

    if world.is_main:
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    parallel = f", {world.size} processes ({opt.parallel})" if world.distributed else ""
    log.info(
        f"{num_params / 1e6:.2f}M parameters, {data.meta['vocab_size']} tokens in the vocabulary, "
        f"device {runtime.device}, {str(runtime.dtype).removeprefix('torch.')}, compile {use_compile}{parallel}, "
        f"out_dir {out_dir}"
    )
    wandb_run = open_wandb(**cfg.wandb, config=resolved, out_dir=out_dir) if world.is_main else None
    metrics = MetricsLog(out_dir, wandb_run, active=world.is_main)
    tokenizer = tokenizer_from_metadata(data.meta["tokenizer"])
    byte_lengths = torch.from_numpy(tokenizer.token_byte_lengths())
    byte_lengths = byte_lengths.to(runtime.device, torch.float64)

    def elapsed() -> float:
        return round(elapsed_before + time.perf_counter() - t_start, 3)

    def save() -> None:
        model_state, optimizer_state = full_state(model, optimizer, world)  # collective under FSDP2
        rng = all_gather_objects(_rng_state(runtime), world)  # each rank's dropout stream
        if not world.is_main:
            return
        save_checkpoint(
            out_dir / CKPT_NAME,
            {
                "model_config": asdict(model_config),
                "model": model_state,  # the uncompiled, unwrapped module's names
                "optimizer": optimizer_state,
                "scaler": scaler.state_dict(),
                "iter": it,
                "last_eval_iter": last_eval_iter,
                "val_loss": val_loss,
                "best_val_loss": best_val,
                "rng": rng,
                "elapsed_s": elapsed(),
                "tokenizer": data.meta["tokenizer"],
                "config": resolved,
            },
        )

    tokens_per_iter = opt.batch_size * opt.grad_accum * block_size  # all processes together
    local_accum = opt.grad_accum // world.size
    decay_iters = opt.max_iters if opt.lr_decay_iters is None else opt.lr_decay_iters
    peak = peak_flops(runtime.device, runtime.dtype)
    peak_total = peak.flops * world.size
    log.info(f"MFU against {peak.flops / 1e12:.3g} TFLOP/s per process ({peak.source})")
    loss_sum, steps_in_window = torch.zeros((), device=runtime.device), 0
    train_s, timed_steps, first_step = 0.0, 0, it  # the first step compiles and warms up: not timed
    stopped_by = None
    model.train()
    target = opt.target_val_loss
    already_reached = ckpt is not None and target is not None and last_eval_iter == it and val_loss <= target
    if already_reached:
        log.info(f"the run already reached val loss {val_loss:.4f} <= {target} at iter {it}")
    with StopRequests(second_quits=not world.distributed) as stop:
        while not already_reached:
            if (it % opt.eval_interval == 0 or it == opt.max_iters) and last_eval_iter != it:
                losses = _evaluate(step_model, data, cfg, block_size, runtime, world, byte_lengths)
                val_loss, last_eval_iter = losses["val"], it
                best_val = min(best_val, val_loss)
                record = {
                    "iter": it,
                    "train_loss": losses["train"],
                    "val_loss": val_loss,
                    "val_bpb": losses["val_bpb"],
                    "elapsed_s": elapsed(),
                }
                reached = opt.target_val_loss is not None and val_loss <= opt.target_val_loss
                if reached:
                    record["time_to_target_s"] = record["elapsed_s"]
                metrics.write(record)
                if not math.isfinite(val_loss):
                    log.warning(f"val loss is {val_loss} at iter {it}: keeping the previous checkpoint")
                elif it > 0:
                    save()
                if reached:
                    log.info(
                        f"reached val loss {val_loss:.4f} <= {opt.target_val_loss} at iter {it}, "
                        f"{record['elapsed_s']:.1f} s after the start"
                    )
                    break
            if it >= opt.max_iters:
                break

            t0 = time.perf_counter()
            lr = lr_at(it, opt.learning_rate, opt.min_lr, opt.warmup_iters, decay_iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = torch.zeros((), device=runtime.device)
            for local in range(local_accum):
                micro = world.rank * local_accum + local  # the step's micro-batches, split between the ranks
                generator = batch_generator(cfg.seed, 0, it, micro)
                x, y = get_batch(data.train, opt.batch_size, block_size, generator)
                x, y = x.to(runtime.device, non_blocking=True), y.to(runtime.device, non_blocking=True)
                with gradient_sync(wrapped, local == local_accum - 1):
                    with runtime.autocast():
                        _, loss = step_model(x, y)
                    loss = loss / local_accum  # and DDP/FSDP average over the ranks: the mean of all micro-batches
                    scaler.scale(loss).backward()
                step_loss += loss.detach()
            step_loss, stop_now = agree_on_step(step_loss, stop.signal is not None, world)
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
                    torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)  # global norm, also sharded
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                loss_sum += step_loss
                steps_in_window += 1
            it += 1
            logging_now = it % opt.log_interval == 0 and steps_in_window > 0
            if logging_now:
                train_loss = loss_sum.item() / steps_in_window  # .item() waits for the GPU: timed as training
            if it - 1 != first_step:
                train_s += time.perf_counter() - t0
                timed_steps += 1
            if logging_now:
                record: dict[str, Any] = {"iter": it, "train_loss": train_loss, "lr": lr, "elapsed_s": elapsed()}
                if timed_steps:
                    record["ms_per_iter"] = 1000 * train_s / timed_steps
                    record["tokens_per_sec"] = tokens_per_iter * timed_steps / train_s
                    record["mfu"] = flops_per_token * record["tokens_per_sec"] / peak_total
                metrics.write(record)
                loss_sum.zero_()
                steps_in_window, train_s, timed_steps = 0, 0.0, 0
            if stop_now:  # some rank was signalled: all stop at this same step
                save()
                barrier(world)  # none exits before rank 0 has written: torchrun stops the others when one exits
                stopped_by = (stop.signal or signal.SIGTERM).name
                log.warning(
                    f"stopped by {stopped_by} at iter {it}; checkpoint {out_dir / CKPT_NAME}. "
                    f"Resume with: python train.py out_dir={out_dir} resume=true (and the same overrides)"
                )
                break

    # generate() can't run on one rank's shards, and a preempted run has no time to spare
    if metrics.wandb_run is not None and stopped_by is None and not sharded:
        metrics.log_samples(it, _samples(Sampler(model, tokenizer, runtime), data))
    metrics.close()
    if stopped_by is None:
        log.info(
            f"done: {it} iters, val loss {val_loss:.4f} (best {best_val:.4f}), {elapsed():.1f} s; "
            f"checkpoint {out_dir / CKPT_NAME}"
        )
    return TrainResult(out_dir, it, val_loss, best_val, elapsed(), stopped_by)


@torch.no_grad()
def _evaluate(
    model: torch.nn.Module,
    data: PreparedData,
    cfg: DictConfig,
    block_size: int,
    runtime: Runtime,
    world: World,
    byte_lengths: torch.Tensor,
) -> dict[str, float]:
    """Mean loss over the same eval_iters random windows of each split at every evaluation, or over
    every block of the val split with train.full_val; and val in bits per byte: the nats of the tokens that
    are text over their UTF-8 bytes, special tokens such as <|endoftext|> left out of both (as nanochat).

    The batches are the same whatever the number of processes: each rank takes every world.size-th one and
    the sums are reduced, so the result is the whole set's (not rank 0's share).
    """
    model.eval()
    out = {}
    for split_index, (split, files) in enumerate((("train", data.train), ("val", data.val))):
        if split == "val" and cfg.train.full_val:
            # The result doesn't depend on the batch size; bigger batches keep small models' matmuls efficient.
            windows = max(cfg.train.batch_size, 4096 // block_size)  # at least 4096 tokens a batch
            batches = every_window(files, windows, block_size)
        else:
            generator = batch_generator(cfg.seed, 1, split_index)
            batches = (
                get_batch(files, cfg.train.batch_size, block_size, generator) for _ in range(cfg.train.eval_iters)
            )
        # nats and count of all target tokens; nats and UTF-8 bytes of the text ones
        sums = torch.zeros(4, dtype=torch.float64, device=runtime.device)
        for x, y, counted in _share_of(batches, world):
            y = y.to(runtime.device).flatten()
            with runtime.autocast():
                logits, _ = model(x.to(runtime.device))
            nats = F.cross_entropy(logits.flatten(0, 1).float(), y, reduction="none").double()
            n_bytes = byte_lengths[y]
            if counted:
                sums += torch.stack((nats.sum(), nats.new_tensor(y.numel()), nats[n_bytes > 0].sum(), n_bytes.sum()))
        total, tokens, text_nats, text_bytes = all_reduce_sum(sums, world).tolist()
        out[split] = total / tokens
        if split == "val":
            out["val_bpb"] = text_nats / (math.log(2) * text_bytes) if text_bytes else math.nan
    model.train()
    return out


def _share_of(
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]], world: World
) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Every world.size-th batch, starting at this rank's. All ranks run the same number of forward passes
    (FSDP2 gathers weights collectively): a rank with no batch left in the last round repeats one, uncounted."""
    while True:
        round_ = list(itertools.islice(batches, world.size))
        if not round_:
            return
        if world.rank < len(round_):
            yield (*round_[world.rank], True)
        else:
            yield (*round_[0], False)


def _samples(sampler: Sampler, data: PreparedData, count: int = 3, tokens: int = 200) -> list:
    """Continuations of the val split's first token, with sample.py's default temperature and top_k."""
    first = int(next(every_window(data.val, 1, 1))[0][0, 0])
    defaults = SampleConfig()
    sampler.model.eval()
    ids = sampler.generate([first], count, tokens, defaults.temperature, defaults.top_k, use_cache=True)
    texts = [sampler.tokenizer.decode(sample) for sample in ids]  # after the last checkpoint: its RNG is saved
    sampler.model.train()
    return [[sampler.tokenizer.decode([first]), text] for text in texts]


def _rng_state(runtime: Runtime) -> dict[str, Any]:
    """Dropout draws from torch's global generators; batches and evaluation use their own (above)."""
    cuda = [torch.cuda.get_rng_state(runtime.device)] if runtime.is_cuda else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def _restore_rng(saved: list[dict[str, Any]] | dict[str, Any], world: World, runtime: Runtime) -> None:
    """Each rank's own stream; with another number of processes than saved, dropout streams start afresh."""
    states = saved if isinstance(saved, list) else [saved]  # a dict: written before torchrun support
    if len(states) != world.size:
        log.warning(f"resuming {len(states)} processes' run with {world.size}: dropout masks won't repeat exactly")
        return
    state = states[world.rank]
    torch.set_rng_state(state["torch"])
    if state["cuda"] and runtime.is_cuda:
        torch.cuda.set_rng_state(state["cuda"][0], runtime.device)


def _check_train_keys(opt: DictConfig, world: World) -> None:
    for key in ("batch_size", "grad_accum", "eval_interval", "eval_iters", "log_interval"):
        if opt[key] < 1:
            raise ConfigError(f"train.{key}={opt[key]} must be at least 1")
    if opt.max_iters < 0:
        raise ConfigError(f"train.max_iters={opt.max_iters} must be >= 0")
    if opt.on_nonfinite not in ON_NONFINITE:
        raise ConfigError(f"train.on_nonfinite={opt.on_nonfinite} is unknown; use {' or '.join(ON_NONFINITE)}")
    if opt.parallel not in PARALLEL:
        raise ConfigError(f"train.parallel={opt.parallel} is unknown; use {' or '.join(PARALLEL)}")
    if opt.grad_accum % world.size:
        raise ConfigError(
            f"train.grad_accum={opt.grad_accum} (micro-batches per step, all processes together) is not divisible "
            f"by the {world.size} processes; use a multiple of {world.size}"
        )


def _build_model(cfg: DictConfig, ckpt: dict[str, Any] | None, data: PreparedData) -> GPT:
    """A new model from model.*, init_from's pretrained one, or (resume) one of the checkpoint's shape."""
    if cfg.init_from is not None and ckpt is None:
        return _pretrained_model(cfg, data.meta["vocab_size"])
    if cfg.init_from is not None:  # resuming a finetune: the shape is the pretrained model's, as saved
        model_config = GPTConfig(**{**ckpt["model_config"], **_free_model_keys(cfg.model)})
    else:
        try:
            model_config = GPTConfig(vocab_size=data.meta["vocab_size"], **cfg.model)
        except ValueError as err:
            raise ConfigError(f"model.{err}") from None
    if ckpt is not None:
        _check_same_shape(ckpt["model_config"], asdict(model_config))
        if ckpt["tokenizer"] != data.meta["tokenizer"]:
            raise CheckpointError("resume=true with data tokenized differently from the checkpoint's; use its data")
    return GPT(model_config)


def _pretrained_model(cfg: DictConfig, vocab_size: int) -> GPT:
    """init_from's weights and shape; block_size (cropped), dropout and attn_impl from the config."""
    model = load_pretrained(
        cfg.init_from, block_size=cfg.model.block_size, dropout=cfg.model.dropout, attn_impl=cfg.model.attn_impl
    )
    if model.config.vocab_size != vocab_size:
        raise ConfigError(
            f"init_from={cfg.init_from} has a vocabulary of {model.config.vocab_size} tokens, the data's has "
            f"{vocab_size}; use data tokenized like the model (GPT-2: data.tokenizer=r50k_base, e.g. data=shakespeare)"
        )
    shape = {k: getattr(model.config, k) for k in ("n_layer", "n_head", "n_embd", "bias", "activation", "pos_emb")}
    log.info(f"init_from={cfg.init_from}: {shape}, block_size {model.config.block_size}")
    return model


def _check_data_fits(data: PreparedData, block_size: int) -> None:
    for split, files in (("train", data.train), ("val", data.val)):
        n = max(files.lengths)  # windows don't span files
        if n <= block_size:
            raise ConfigError(
                f"the {split} split's longest token file has {n} tokens, too few for model.block_size={block_size}; "
                "lower model.block_size or train on more text (or raise data.shard_tokens)"
            )


def _check_same_shape(saved: dict[str, Any], current: dict[str, Any]) -> None:
    saved = {**asdict(GPTConfig()), **saved}  # keys added since the checkpoint was written: their defaults
    changed = [k for k in current if k not in FREE_MODEL_KEYS and saved[k] != current[k]]
    if changed:
        diffs = ", ".join(f"{k}: {saved[k]} -> {current[k]}" for k in changed)
        raise CheckpointError(
            f"resume=true with a model that differs from the checkpoint's ({diffs}); drop those overrides"
        )


def _free_model_keys(model_cfg: DictConfig) -> dict[str, Any]:
    return {k: model_cfg[k] for k in FREE_MODEL_KEYS}


def _drop_records_after(path: Path, last_iter: int) -> None:
    """Also drops a line cut short by the kill."""

    def kept(line: str) -> bool:
        try:
            return json.loads(line)["iter"] <= last_iter
        except (json.JSONDecodeError, KeyError, TypeError):
            return False

    if path.is_file():
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True) if kept(line)))


def _log_changed_keys(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> None:
    """Training keys may change on resume (more iterations, another learning rate): say which did."""
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            _log_changed_keys(old, new, f"{prefix}{key}.")
        elif old != new and f"{prefix}{key}" not in ("resume", "out_dir"):
            log.info(f"resume: {prefix}{key} changed from {old} to {new}")
