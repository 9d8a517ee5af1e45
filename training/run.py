"""train(cfg): a run from its config, in the order a reader follows it: the run directory (locked), the data,
the model (new, pretrained or resumed) placed for torchrun and compiled, the optimizer, evaluation and metrics;
then Trainer.fit (training/trainer.py) trains it. The entry point of train.py, bench.py, scripts/gpu_check.py
and the tests: one process's part of the run, all of it alone or one rank's under torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from common.config import typed_config
from common.cpu_threads import SlowdownWatch, use_free_cores
from common.errors import CheckpointError, ConfigError
from common.files import check_writable, discard_temporaries, refuse_links, write_text_atomically
from common.runtime import Runtime, make_runtime
from data.prepare import PreparedData, ensure_prepared, in_use
from data.tokenizers import Tokenizer, tokenizer_from_metadata
from evals.hellaswag import hellaswag_path, load_examples
from model import GPT
from model.checkpoint import BEST_NAME, CKPT_NAME, Checkpoint, load_checkpoint
from model.hf_gpt2 import SETTINGS as PRETRAINED_SETTINGS
from model.hf_gpt2 import load_pretrained
from training.distributed import (
    World,
    world_from_env,
)
from training.errors import RunLocked
from training.evaluation import Evaluator, HellaSwagEval
from training.machine import Peak, choose_cpu_dtype, peak_flops, remember_higher_peak
from training.memory import check_fits
from training.metrics import METRICS_NAME, MetricsLog, forget_metrics
from training.optim import make_optimizer, scheduled_lr
from training.resume import check_resume, check_same_shape
from training.run_lock import (
    HOLDER_NAME,
    LOCK_NAME,
    LOG_NAME,
    Made,
    log_to_run_dir,
    run_lock,
    take_back,
)
from training.schema import OptimConfig, TrainRunConfig
from training.trainer import Trainer, TrainResult

log = logging.getLogger("train")
CONFIG_NAME = "config.yaml"  # the run's resolved config, for reading (plot.py groups runs by it)
# What a run writes in its directory: none of them may be a symbolic link (common.files.refuse_links)
RUN_FILES = (CKPT_NAME, BEST_NAME, METRICS_NAME, CONFIG_NAME, LOG_NAME, LOCK_NAME, HOLDER_NAME, ".hydra", "wandb")


def train(
    cfg: DictConfig | TrainRunConfig,
    before_step: Callable[[int], None] | None = None,
    on_run_opened: Callable[[Path], None] | None = None,
) -> TrainResult:
    """cfg: Hydra's config (typed and checked here, before anything runs) or a TrainRunConfig.
    before_step: called with the iteration before each optimizer step (a seam for tests).
    on_run_opened: called on rank 0 with out_dir once it holds the run and every check passed, just before the
    run's config.yaml is written (train.py writes Hydra's files then). A start that fails before then takes back
    what it made."""
    world = world_from_env()
    if not world.is_main:
        log.setLevel(logging.WARNING)  # one voice: rank 0's
    config = typed_config(cfg, TrainRunConfig)
    check_for_world(config.train, world)
    runtime = make_runtime(config.device, config.train.dtype, world.local_rank if world.distributed else None)
    out_dir = Path(config.out_dir)
    if world.is_main:
        check_writable(out_dir, "out_dir")
    made = Made()
    world.open(runtime.device)
    try:
        with contextlib.ExitStack() as held:
            _lock_run(out_dir, world, held, made)
            trainer = build_trainer(config, world, runtime, before_step)
            held.enter_context(in_use(trainer.data))  # no other run prepares other tokens over these meanwhile
            if world.is_main:
                if on_run_opened is not None:
                    on_run_opened(trainer.out_dir)
                write_text_atomically(trainer.out_dir / CONFIG_NAME, OmegaConf.to_yaml(trainer.resolved))
                trainer.metrics.write_settings(trainer.progress.iter, resolved_settings(trainer))
            made.opened = True
            if config.wandb.enabled and world.is_main:
                trainer.metrics.start_wandb(config.wandb, trainer.resolved)
            result = trainer.fit()
            world.barrier()  # leave together: none tears its process group down while rank 0 still writes
        return result
    except BaseException:  # a user's error, Ctrl-C, a bug
        if not made.opened and world.is_main:
            take_back(made, out_dir)
        raise
    finally:
        world.close()


def build_trainer(
    config: TrainRunConfig, world: World, runtime: Runtime, before_step: Callable[[int], None] | None = None
) -> Trainer:
    """Everything the run needs, restored from ckpt.pt when config.resume. The run's clock starts here."""
    started = time.perf_counter()
    # Each rank's Hydra resolved ${now:} on its own clock: all write to rank 0's directory.
    config = dataclasses.replace(config, out_dir=world.broadcast(config.out_dir))
    out_dir, opt = Path(config.out_dir), config.train
    checkpoint = _open_run_dir(out_dir, config.resume, world)
    if checkpoint is not None:
        check_resume(checkpoint, config)  # before any data is prepared: a refused resume changes nothing
    torch.manual_seed(config.seed)  # the same initial weights on every rank (FSDP2 shards each rank's own)
    data = _prepared_data(config, world)
    tokenizer = tokenizer_from_metadata(data.meta["tokenizer"])
    model = _build_model(config, checkpoint, data, runtime, world)
    if world.rank:  # then each rank its own dropout masks (nanoGPT's seed offset); rank 0's stream goes on
        torch.manual_seed(config.seed + world.rank)
    num_params, flops_per_token = model.num_params(), model.flops_per_token()  # before sharding
    model.activation_checkpointing = opt.activation_checkpointing
    if runtime.device.type == "cpu" and not world.distributed and (note := use_free_cores()):
        log.warning(note)  # before anything is timed: with the threads the run will use
    trained_in = None if checkpoint is None else checkpoint.dtype
    runtime, precision_note = choose_cpu_dtype(model, opt.batch_size, opt.dtype, runtime, world, trained_in)
    wrapped = _place(model, opt.parallel, world, runtime)
    use_compile = compile_by_default(runtime) if opt.compile is None else opt.compile
    byte_lengths = torch.from_numpy(tokenizer.token_byte_lengths()).to(runtime.device, torch.float64)
    peak = None if runtime.emulated else peak_flops(runtime.device, runtime.dtype)
    trainer = Trainer(
        config=config,
        world=world,
        runtime=runtime,
        out_dir=out_dir,
        data=data,
        tokenizer=tokenizer,
        model=model,
        wrapped=wrapped,
        step_model=torch.compile(wrapped) if use_compile else wrapped,
        optimizer=make_optimizer(model, opt, runtime),
        scaler=torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == torch.float16),
        evaluator=Evaluator(data, opt, config.seed, model.config.block_size, byte_lengths, runtime, world),
        hellaswag=_hellaswag(opt, tokenizer, model.config.block_size, runtime, world) if opt.hellaswag_every else None,
        metrics=MetricsLog(out_dir, active=world.is_main, max_iters=opt.max_iters),
        flops_per_token=flops_per_token,
        peak_flops=None if peak is None else peak.flops * world.size,
        remember_peak=_peak_keeper(peak, runtime, world),
        started=started,
        before_step=before_step,
        slowdown=SlowdownWatch() if runtime.device.type == "cpu" and not world.distributed else None,
    )
    if checkpoint is not None:
        trainer.restore(checkpoint)
        if not opt.keep_best and (out_dir / BEST_NAME).is_file() and world.is_main:
            log.warning(f"{BEST_NAME} stays as it is: this resume has train.keep_best=false")
    log.info(
        f"{num_params / 1e6:.2f}M parameters, {data.meta['vocab_size']} tokens in the vocabulary, "
        f"{_machinery(runtime, world, opt.parallel, use_compile)}, out_dir {out_dir}"
    )
    if precision_note is not None:
        log.info(precision_note)
    if opt.max_iters and opt.decay_iters != opt.max_iters:
        log.info(_schedule_note(opt))
    if opt.max_iters and 0 < opt.decay_iters <= opt.warmup_iters:
        log.warning(_warmup_note(opt))
    if peak is not None:
        log.info(f"MFU against {peak.flops / 1e12:.3g} TFLOP/s per process ({peak.source})")
    elif world.is_main:
        log.warning(_emulated_note(runtime))
    return trainer


def resolved_settings(trainer: Trainer) -> dict[str, Any]:
    """What the config leaves to the machine, as this process resolved it: train.dtype=auto's precision,
    train.compile=null's choice, the device's type and the CPU threads (which change float sums' order)."""
    return {
        "device": trainer.runtime.device.type,
        "train.dtype": trainer.runtime.dtype_name,
        "train.compile": trainer.step_model is not trainer.wrapped,
        "threads": torch.get_num_threads(),
    }


def check_for_world(opt: OptimConfig, world: World) -> None:
    """The checks that need the number of processes."""
    if opt.grad_accum % world.size:
        raise ConfigError(
            f"train.grad_accum={opt.grad_accum} (micro-batches per step, all processes together) is not divisible "
            f"by the {world.size} processes; use a multiple of {world.size}"
        )
    if world.distributed and opt.parallel == "fsdp" and opt.optimizer == "muon":
        raise ConfigError(
            "train.optimizer=muon needs each hidden matrix whole, and train.parallel=fsdp shards them; "
            "use train.parallel=ddp (or train.optimizer=adamw)"
        )


def _lock_run(out_dir: Path, world: World, held: contextlib.ExitStack, made: Made) -> None:
    """Rank 0 writes the run, so it alone holds the lock; if it can't (or fails trying), every rank stops. Then
    no other writer is mid-save: a killed one's checkpoint temporaries go."""
    error = None
    if world.is_main:
        try:
            refuse_links(out_dir, RUN_FILES, "out_dir")  # before the lock: opening .lock truncates it
            held.enter_context(run_lock(out_dir, made))
            held.enter_context(log_to_run_dir(out_dir, made))
            for name in (CKPT_NAME, BEST_NAME):
                discard_temporaries(out_dir / name)
        except Exception as err:
            error = err
    message = world.broadcast(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:  # the other ranks
        raise RunLocked(message)


def _open_run_dir(out_dir: Path, resume: bool, world: World) -> Checkpoint | None:
    """The checkpoint to resume, or None for a new run; a new run never writes over another's."""
    if resume:
        checkpoint = load_checkpoint(out_dir / CKPT_NAME)
    elif (out_dir / CKPT_NAME).exists():
        raise ConfigError(f"out_dir={out_dir} already holds a run; pass resume=true to continue it, or another out_dir")
    else:
        checkpoint = None
    world.barrier()  # every rank has looked for a checkpoint before rank 0 writes anything
    if world.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if checkpoint is None:
            forget_metrics(out_dir)
            (out_dir / BEST_NAME).unlink(missing_ok=True)  # a run that died before its first ckpt.pt: not ours
    return checkpoint


def _prepared_data(config: TrainRunConfig, world: World) -> PreparedData:
    """Rank 0 tokenizes; the others then only read the prepared files."""
    if world.is_main:
        data = ensure_prepared(config.data)
    world.barrier()
    if not world.is_main:
        data = ensure_prepared(config.data, prepare=False)
    return data


def _build_model(
    config: TrainRunConfig, checkpoint: Checkpoint | None, data: PreparedData, runtime: Runtime, world: World
) -> GPT:
    """A new model from model.*, init_from's pretrained one, or (resume) one of the checkpoint's shape."""
    if config.init_from is not None and checkpoint is None:
        model = _pretrained_model(config, data.meta["vocab_size"])
        _check_data_fits(data, model.config.block_size)
        return model
    if config.init_from is not None:  # resuming a finetune: the shape is the pretrained model's, as saved
        # What init_from took from the config: a change of those that shape the model is refused below.
        settings = {k: getattr(config.model, k) for k in ("block_size", *PRETRAINED_SETTINGS)}
        model_config = dataclasses.replace(checkpoint.model_config, **settings)
    else:
        model_config = config.model.gpt_config(data.meta["vocab_size"])
    if checkpoint is not None:
        check_same_shape(checkpoint.model_config, model_config)
        if checkpoint.tokenizer_for_decoding(Path(config.out_dir) / CKPT_NAME) != data.meta["tokenizer"]:
            raise CheckpointError("resume=true with data tokenized differently from the checkpoint's; use its data")
    _check_data_fits(data, model_config.block_size)  # the plainer mistake first
    check_fits(model_config, config.train, runtime.device, world)  # before allocating it
    return GPT(model_config)


def _pretrained_model(config: TrainRunConfig, vocab_size: int) -> GPT:
    """init_from's weights and shape; block_size (cropped) and the settings the weights leave open (dropout,
    attn_impl, the sliding window) from the config."""
    keys = config.model
    settings = {name: getattr(keys, name) for name in PRETRAINED_SETTINGS}
    model = load_pretrained(config.init_from, block_size=keys.block_size, **settings)
    if model.config.vocab_size != vocab_size:
        raise ConfigError(
            f"init_from={config.init_from} has a vocabulary of {model.config.vocab_size} tokens, the data's has "
            f"{vocab_size}; use data tokenized like the model (GPT-2: data.tokenizer=r50k_base, e.g. data=shakespeare)"
        )
    shape = {k: getattr(model.config, k) for k in ("n_layer", "n_head", "n_embd", "bias", "activation", "pos_emb")}
    if model.config.attn_window is not None:
        shape["layer_windows"] = model.config.layer_windows()
    log.info(f"init_from={config.init_from}: {shape}, block_size {model.config.block_size}")
    return model


def _check_data_fits(data: PreparedData, block_size: int) -> None:
    for split, files in (("train", data.train), ("val", data.val)):
        n = max(files.lengths)  # windows don't span files
        if n <= block_size:
            if data.meta.get("sharded"):
                more = " (or raise data.shard_tokens)"
            else:
                more = f" (or {'raise' if split == 'val' else 'lower'} data.val_fraction)"
            raise ConfigError(
                f"the {split} split's longest token file has {n} tokens, too few for model.block_size={block_size}; "
                f"lower model.block_size or train on more text{more}"
            )


def _place(model: GPT, parallel: str, world: World, runtime: Runtime) -> torch.nn.Module:
    """On the device, wrapped for DDP; or sharded in place by FSDP2, which moves each rank's shards to its device
    itself (no GPU ever holds the whole model)."""
    if not (world.distributed and parallel == "fsdp"):
        model.to(runtime.device)
    return world.wrap(model, parallel, runtime.device)


def compile_by_default(runtime: Runtime) -> bool:
    """train.compile=null: on for CUDA, where it pays, if torch.compile can run there. On Windows its GPU
    backend needs triton, which PyTorch doesn't bring: off without it, saying so."""
    if not runtime.is_cuda:
        return False
    if sys.platform == "win32" and importlib.util.find_spec("triton") is None:
        log.info("train.compile: off (torch.compile on Windows needs triton: pip install triton-windows)")
        return False
    return True


def _hellaswag(
    opt: OptimConfig, tokenizer: Tokenizer, block_size: int, runtime: Runtime, world: World
) -> HellaSwagEval:
    """train.hellaswag_every's examples, read at start so a missing file stops the run before it trains. Rank 0
    downloads them (once, into the cache) while the others wait, then read its copy."""
    if world.is_main:
        path = hellaswag_path(opt.hellaswag_file, "train.hellaswag_file")
    world.barrier()
    if not world.is_main:
        path = hellaswag_path(opt.hellaswag_file, "train.hellaswag_file")
    examples = load_examples(path, tokenizer)
    log.info(f"HellaSwag: {len(examples):,} examples from {path}, every {opt.hellaswag_every} iterations")
    return HellaSwagEval(examples, opt.hellaswag_every, block_size, runtime, world)


def _peak_keeper(peak: Peak | None, runtime: Runtime, world: World) -> Callable[[float], None] | None:
    """A measured peak that training passes is raised to what it reached, and remembered by rank 0 (per process);
    a datasheet's stands."""
    if peak is None or not peak.measured:
        return None
    return lambda flops: (
        remember_higher_peak(runtime.device, runtime.dtype, flops / world.size) if world.is_main else None
    )


def _machinery(runtime: Runtime, world: World, parallel: str, use_compile: bool) -> str:
    processes = f", {world.size} processes ({parallel})" if world.distributed else ""
    return f"device {runtime.device}, {runtime.dtype_name}, compile {use_compile}{processes}"


def _schedule_note(opt: OptimConfig) -> str:
    """One line when the decay is set apart from max_iters: the learning rate then doesn't end at min_lr with the
    run (shorter: it stays at min_lr for the last iterations; longer: it is still high when the run stops)."""
    end = scheduled_lr(opt, opt.max_iters - 1)
    where = "before" if opt.decay_iters < opt.max_iters else "after"
    return (
        f"train.lr_decay_iters={opt.decay_iters} ends {where} train.max_iters={opt.max_iters}: the last step's "
        f"learning rate is {end:.3g} (min_lr {opt.min_lr:.3g}); lr_decay_iters=null follows max_iters"
    )


def _warmup_note(opt: OptimConfig) -> str:
    """A warm-up as long as the schedule (nanoGPT's 100 iterations in a 60-iteration run) never decays: said."""
    end = "train.max_iters" if opt.lr_decay_iters is None else "train.lr_decay_iters"
    return (
        f"train.warmup_iters={opt.warmup_iters} is not below {end}={opt.decay_iters}: the learning rate only warms "
        f"up (to {scheduled_lr(opt, opt.max_iters - 1):.3g} at the last step) and never decays; use a "
        f"train.warmup_iters below {opt.decay_iters}"
    )


def _emulated_note(runtime: Runtime) -> str:
    name = runtime.dtype_name
    return (
        f"dtype={name}: this CPU has no {name} arithmetic, so torch emulates it, many times slower than float32 "
        "(and MFU is left out); use dtype=float32"
    )
