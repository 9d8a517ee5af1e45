"""Train a GPT: `python train.py experiment=shakespeare_char_cpu`; --help: settings; torchrun: docs/scaling.md.

The run's typed config (TrainRunConfig: `model.*` is model/gpt.py's ModelConfig, `data.*` data/prepare.py's
DataConfig), then train(cfg): one process's part of a run, built by build_trainer (which writes nothing) and checked;
then the run directory opened and training/trainer.py's Trainer.fit, the loop."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from analysis.diagnostics import HeadProbe
from common.config import SEED_MAX, check_fields, keys_help, option, presets, run_hydra, typed_config
from common.errors import ConfigError, UserError
from common.files import BEST_NAME, CKPT_NAME, CONFIG_NAME, HYDRA_NAME, METRICS_NAME, RunDir, make_directory
from common.runtime import (
    DEVICES,
    DTYPES,
    Runtime,
    World,
    check_memory,
    cpu_matmul_flops,
    datasheet_peak,
    make_runtime,
    world_from_env,
)
from data.prepare import DataConfig, PreparedData, ensure_prepared
from data.tokenizers import Tokenizer, tokenizer_from_metadata
from evals.hellaswag import hellaswag_path, load_examples
from model import GPT, GPTConfig, ModelConfig
from model.checkpoint import Checkpoint, load_checkpoint
from model.hf_gpt2 import SETTINGS as PRETRAINED_SETTINGS
from model.hf_gpt2 import load_pretrained
from training.resume import CONFIG_GROUPS, check_resume, resumed_config, resumed_model_config
from training.trainer import (
    Evaluator,
    HellaSwagEval,
    MetricsLog,
    Trainer,
    TrainResult,
    _duration,
    make_optimizer,
)

log = logging.getLogger("train")

OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "wsd")  # after warmup: a half cosine, or warmup-stable-decay
ON_NONFINITE = ("stop", "skip")
MAX_GRAD_ACCUM = 65536  # micro-batches per step: past any recipe (GPT-2 on one GPU: 40), short of endless
PARALLEL = ("ddp", "fsdp")


@dataclass
class TrainConfig:
    """`train.*`: the optimizer, its schedule, evaluation, logging and the step's machinery."""

    batch_size: int = option(12, at_least=1)  # sequences per micro-batch, in each process
    # micro-batches per optimizer step, all processes together; a larger step wants a larger batch_size
    grad_accum: int = option(1, at_least=1, at_most=MAX_GRAD_ACCUM, hint="raise train.batch_size instead")
    learning_rate: float = option(1e-3, above=0.0)  # the peak, reached after warmup_iters
    min_lr: float = option(1e-4, at_least=0.0)  # the schedule (cosine or wsd) ends at this
    max_iters: int = option(2000, at_least=0)  # optimizer steps; the learning rate decays to min_lr over them
    lr_decay_iters: int | None = option(None, at_least=0)  # default: max_iters
    lr_schedule: str = option("cosine", choices=LR_SCHEDULES)  # after warmup: cosine | wsd (plateau, then cooldown)
    cooldown_frac: float = option(0.2, above=0.0, at_most=1.0)  # wsd's: the share of lr_decay_iters cooling down
    warmup_iters: int = option(100, at_least=0)  # steps of linear warmup to learning_rate
    weight_decay: float = option(0.1, at_least=0.0)  # decoupled, on 2-D weights (and Muon's matrices)
    beta1: float = option(0.9, at_least=0.0, below=1.0)  # AdamW's momentum
    beta2: float = option(0.99, at_least=0.0, below=1.0)  # AdamW's second-moment decay
    grad_clip: float = option(1.0, at_least=0.0)  # 0 disables clipping
    # adamw: AdamW for every parameter (nanoGPT's) | muon: Muon for the blocks' nn.Linear weights, AdamW for the rest
    optimizer: str = option("adamw", choices=OPTIMIZERS)
    # Muon's keys, read with optimizer=muon only (a preset may set them and still sweep the optimizer)
    muon_lr: float = option(0.02, above=0.0)  # Muon's peak lr; follows learning_rate's schedule (scaled by the ratio)
    muon_momentum: float = option(0.95, at_least=0.0, below=1.0)  # Muon's Nesterov momentum, after its warmup
    muon_momentum_warmup: int = option(300, at_least=0)  # iterations to go from 0.85 to muon_momentum; 0: none
    muon_ns_steps: int = option(5, at_least=1)  # Newton-Schulz iterations per update: fewer are cheaper, rougher
    eval_interval: int = option(250, at_least=1)  # evaluate, log and write ckpt.pt every this many steps
    # evaluate (and write ckpt.pt) only from this iteration on, and after the last step: a timed run skips early ones
    eval_from: int = option(0, at_least=0)
    eval_iters: int = option(100, at_least=1)  # batches per split in each evaluation
    full_val: bool = False  # evaluate val on every block of the split, in order, instead of eval_iters batches
    head_scores: bool = False  # score every head at each evaluation (metrics.jsonl's "heads"; plot.py RUN --heads)
    target_val_loss: float | None = None  # stop once an evaluation reaches it; metrics get time_to_target_s
    keep_best: bool = False  # also keep best.pt, the checkpoint of the lowest val loss (ckpt.pt stays the latest)
    log_interval: int = option(10, at_least=1)  # a log line (loss, ms/iter, tokens/s, ETA) every this many steps
    compile: bool | None = None  # default: on for CUDA, off elsewhere
    # recompute each block's activations in backward: far less memory, ~one more forward's compute (bench.py memory)
    activation_checkpointing: bool = False
    dtype: str = option("auto", choices=DTYPES)  # auto: bfloat16 on CUDA GPUs that have it, else float32
    peak_tflops: float | None = option(None, above=0.0)  # MFU's denominator per process; null: datasheet peak or no MFU
    on_nonfinite: str = option("stop", choices=ON_NONFINITE)  # a NaN/Inf loss: stop (ckpt.pt stays) | skip the step
    parallel: str = option("ddp", choices=PARALLEL)  # under torchrun: ddp (replicas) | fsdp (FSDP2: sharded)
    # HellaSwag at the evaluations whose iteration is a multiple of this, itself a multiple of eval_interval (BPE data
    # only); 0: never
    hellaswag_every: int = option(0, at_least=0, hint="0 means never; use a multiple of train.eval_interval")
    hellaswag_file: str | None = option(None, path=True)  # a hellaswag_val.jsonl; null: data/cache/hellaswag's

    def __post_init__(self) -> None:
        check_fields(self, "train.")
        if self.hellaswag_every % self.eval_interval:
            raise ConfigError(f"train.hellaswag_every={self.hellaswag_every} is not a multiple of "
                              f"train.eval_interval={self.eval_interval}: HellaSwag runs at evaluations")
        if self.hellaswag_file is not None and not self.hellaswag_every:
            raise ConfigError(f"train.hellaswag_file={self.hellaswag_file} is read only with train.hellaswag_every > 0")

    @property
    def decay_iters(self) -> int:
        return self.max_iters if self.lr_decay_iters is None else self.lr_decay_iters


@dataclass
class WandbConfig:
    enabled: bool = False  # also log to Weights & Biases (pip ".[wandb]"); metrics.jsonl is written either way
    project: str = "gpt"  # the wandb project
    entity: str | None = None  # the wandb team or user; null: your default
    run_name: str | None = None  # null: wandb's own name
    mode: str | None = option(None, choices=("online", "offline", "disabled"))  # default: $WANDB_MODE, else online
    tags: list[str] = field(default_factory=list)  # wandb tags, e.g. [baseline,cpu]
    group: str | None = None  # runs wandb shows together, e.g. a sweep
    init_timeout: float = option(30.0, above=0.0)  # seconds wandb may take to start; then training goes on without it

    def __post_init__(self) -> None:
        check_fields(self, "wandb.")


@dataclass
class TrainRunConfig:
    # the run directory (ckpt.pt, metrics.jsonl, config.yaml); a new run needs a new or empty one
    out_dir: str = option("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}", path=True)
    device: str = option("auto", choices=DEVICES)  # auto: cuda, else mps, else cpu
    seed: int = option(1337, at_least=0, at_most=SEED_MAX)  # initial weights, batches and dropout
    resume: bool = False  # continue the run in out_dir from its ckpt.pt, with its saved settings
    resume_with_changes: bool = False  # resume=true: overrides may change what is trained (schedule, data, model...)
    init_from: str | None = option(None, path=True)  # gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a HF GPT-2 dir
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        check_fields(self)  # its own keys; the groups checked themselves as they were built
        if self.train.hellaswag_every and self.data.tokenizer == "char":
            raise ConfigError(f"train.hellaswag_every={self.train.hellaswag_every} needs a BPE model (HellaSwag is "
                              "scored in GPT-2's tokens); this run's data.tokenizer is char (try data=shakespeare)")


ConfigStore.instance().store(name="train_schema", node=TrainRunConfig)  # configs/config.yaml's defaults name it


def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    task = hydra_cfg.overrides.task
    if hydra_cfg.mode == RunMode.MULTIRUN:  # a job's run directory is its own, under the sweep's, unless out_dir is set
        if not any(o.lstrip("+").startswith("out_dir=") for o in task):
            cfg.out_dir = hydra_cfg.runtime.output_dir
    elif not task:  # `python train.py` alone runs something: said, so that nobody mistakes it for a chosen recipe
        choices = hydra_cfg.runtime.choices
        log.info(f"no settings given: configs/config.yaml's defaults, model={choices.model} on data={choices.data} for "
                 f"{cfg.train.max_iters:,} iterations into out_dir {cfg.out_dir} (the log lines' ETA says how long); "
                 "python train.py --help lists the experiments")
    if cfg.resume:
        cfg = resumed_config(cfg, list(task), TrainRunConfig)
    # Hydra's record of the command (interpolations unresolved), written once the run holds out_dir
    records = {"config.yaml": cfg, "hydra.yaml": {"hydra": hydra_cfg}, "overrides.yaml": hydra_cfg.overrides.task}
    result = train(cfg, hydra_record={name: OmegaConf.to_yaml(record) for name, record in records.items()})
    if result.stopped_by is not None:
        sys.exit(128 + signal.Signals[result.stopped_by].value)  # the shell's convention for "killed by"


def train(cfg: DictConfig | TrainRunConfig, before_step: Callable[[int], None] = lambda it: None,
          hydra_record: dict[str, str] | None = None) -> TrainResult:
    """One process's part of a run; nothing is written before every check has passed. hydra_record: out_dir/.hydra/'s
    files (name: YAML), the record of the command that started the run."""
    world = world_from_env()
    if not world.is_main:
        log.setLevel(logging.WARNING)  # one voice: rank 0's
    config = typed_config(cfg, TrainRunConfig)
    runtime = make_runtime(config.device, config.train.dtype, world.local_rank if world.distributed else None)
    world.open(runtime.device)
    try:
        trainer = build_trainer(config, world, runtime)
        trainer.before_step = before_step
        if config.resume and (finished := _finished(trainer)):
            return finished
        with contextlib.ExitStack() as held:
            if world.is_main:  # should this fail, torchrun stops the other ranks
                with trainer.run_dir.starting(held):
                    open_run_directory(trainer, held, hydra_record or {})
            world.barrier()
            result = trainer.fit()
            world.barrier()  # leave together: none tears its process group down while rank 0 still writes
        return result
    finally:
        world.close()


def open_run_directory(trainer: Trainer, held: contextlib.ExitStack, hydra_record: dict[str, str]) -> None:
    """out_dir opened for the run's life (RunDir.open); the history cut back to the checkpoint; the config written."""
    run_dir, out_dir, config, train = trainer.run_dir, trainer.out_dir, trainer.config, trainer.config.train
    run_dir.open(held)
    world, peak, compiled = trainer.world, trainer.peak_flops, hasattr(trainer.step_model, "_orig_mod")
    processes = f", {world.size} processes ({train.parallel})" if world.distributed else ""
    mfu = "" if peak is None else f"; MFU against {peak / world.size / 1e12:.3g} TFLOP/s per process"
    log.info(f"{trainer.model.num_params() / 1e6:.2f}M parameters, {trainer.data.meta['vocab_size']} tokens in the "
             f"vocabulary, device {trainer.runtime.device}, {trainer.runtime.dtype_name}, compile {compiled}"
             f"{processes}, out_dir {out_dir}{mfu}")
    settings = {"device": trainer.runtime.device.type, "train.dtype": trainer.runtime.dtype_name,  # for plot.py
                "train.compile": compiled, "threads": torch.get_num_threads()}
    if config.resume:
        _cut_history(run_dir, trainer.progress.iter, settings)
    else:  # a run that died before its first ckpt.pt left these: not this run's
        (out_dir / METRICS_NAME).unlink(missing_ok=True)
        (out_dir / BEST_NAME).unlink(missing_ok=True)
    if hydra_record and not (config.resume and (out_dir / HYDRA_NAME / "hydra.yaml").is_file()):  # kept: its groups
        make_directory(out_dir / HYDRA_NAME, f"out_dir={out_dir}")
        for name, text in hydra_record.items():
            run_dir.write_text(f"{HYDRA_NAME}/{name}", text)
    run_dir.write_text(CONFIG_NAME, OmegaConf.to_yaml(dataclasses.asdict(config)))
    trainer.metrics.write({"iter": trainer.progress.iter, "settings": settings})  # before wandb: to the file only
    if config.wandb.enabled:
        trainer.metrics.start_wandb(config.wandb, dataclasses.asdict(config))
    evaluating = trainer.eval_due()
    if evaluating:  # it may take a while before the first log line
        val = "every window" if train.full_val else f"{train.eval_iters} batches"
        log.info(f"evaluating at iter {trainer.progress.iter}: {train.eval_iters} batches of train, {val} of val")
    if 0 < train.max_iters <= train.warmup_iters:
        log.warning(f"train.max_iters={train.max_iters} <= train.warmup_iters={train.warmup_iters}: the learning rate "
                    f"only warms up, never decays; lower train.warmup_iters (say {train.max_iters // 10}) or raise "
                    "train.max_iters")
    tokens = train.batch_size * trainer.model.config.block_size  # a batch's
    val_batches = sum(trainer.data.val.lengths) / tokens if train.full_val else train.eval_iters
    steps = min(train.log_interval, train.max_iters - trainer.progress.iter)  # to the first log line
    batches = steps * train.grad_accum + evaluating * (train.eval_iters + val_batches) / 3  # a forward: 1/3 of a step
    flops = batches * tokens * trainer.flops_per_token
    if trainer.runtime.device.type == "cpu" and flops > 30e9 * torch.get_num_threads():  # 30 s at 1 GFLOP/s a thread
        _warn_of_the_wait(flops / trainer.world.size, steps, evaluating)


def _warn_of_the_wait(flops: float, steps: int, evaluating: bool) -> None:
    """Said at start when even this CPU's matmul rate puts the first log line over 30 s away (a long context, a GPU's
    preset), not after a silent hour."""
    peak = torch.get_num_threads() * cpu_matmul_flops(1)
    if flops / peak > 30:
        first = "the first evaluation and " if evaluating else ""
        log.warning(f"the first log line is at least {_duration(flops / peak)} away: {first}{steps} steps need "
                    f"{flops:.1e} FLOPs, at this CPU's {peak / 1e9:.0f} GFLOP/s of matmuls; lower model.block_size, "
                    "train.batch_size or train.eval_iters, or use a CPU preset or a GPU (Ctrl-C waits for the torch "
                    "op under way)")


def _cut_history(run_dir: RunDir, iter: int, settings: dict[str, Any]) -> None:
    """A resume drops a killed run's lines after its checkpoint, and warns where threads, device, precision or compile
    differ from the run's last start: they change the float sums' order, and plot.py groups runs by them."""
    log.info(f"resuming {run_dir.path} at iter {iter}")
    records = run_dir.cut_history(iter)
    saved = next((r["settings"] for r in reversed(records) if "settings" in r), {})
    changed = [f"{key} {saved[key]} -> {value}" for key, value in settings.items() if saved.get(key, value) != value]
    if changed:
        log.warning(f"resume: {', '.join(changed)} since the run last started (OMP_NUM_THREADS sets the threads)")


def _finished(trainer: Trainer) -> TrainResult | None:
    """A resumed run that already evaluated its last iteration (train.max_iters, or the target): said, its result
    returned, and nothing written; what a killed writer left (ckpt.pt.tmp, a checkpoint's size) goes (RunDir.open)."""
    progress, train = trainer.progress, trainer.config.train
    reached = progress.iter >= train.max_iters or trainer.reaches_target(progress.val_loss)
    if progress.last_eval_iter != progress.iter or not reached:
        return None
    if trainer.world.is_main:  # best effort: a finished run may sit in a folder it can't write, or one in use
        with contextlib.suppress(UserError, OSError), contextlib.ExitStack() as held:
            trainer.run_dir.open(held)
    log.info(f"out_dir={trainer.out_dir} is finished: {progress.iter} iters, val loss {progress.val_loss:.4f}; "
             "nothing written (to train on, raise train.max_iters and add resume_with_changes=true)")
    return TrainResult(trainer.out_dir, progress.iter, progress.val_loss, progress.best_val_loss,
                       progress.elapsed_s, None, trainer.runtime.dtype_name)


def build_trainer(config: TrainRunConfig, world: World, runtime: Runtime) -> Trainer:
    """Everything the run needs (from ckpt.pt when resuming); it writes nothing. The run's clock starts here."""
    started = time.perf_counter()
    if world.distributed:
        check_for_world(config.train, world)
    # Each rank's Hydra resolved ${now:} on its own clock: all write to rank 0's directory.
    config = dataclasses.replace(config, out_dir=world.all_gather(config.out_dir)[0])
    train, run_dir = config.train, RunDir(Path(config.out_dir))
    checkpoint = None
    if config.resume:
        checkpoint = load_checkpoint(run_dir.path / CKPT_NAME, resuming=True)
        check_resume(checkpoint, config)  # before any data is prepared: a refused resume changes nothing
    else:
        run_dir.check_new()
    torch.manual_seed(config.seed)  # the same initial weights on every rank (FSDP2 shards each rank's own)
    data = ensure_prepared(config.data) if world.is_main else None
    world.barrier()  # rank 0 prepares; the others then read what it made
    data = data or ensure_prepared(config.data, prepare=False)
    tokenizer = tokenizer_from_metadata(data.meta["tokenizer"])
    model = _build_model(config, checkpoint, data, runtime, world)
    if world.rank:  # then each rank its own dropout masks (nanoGPT's seed offset); rank 0's stream goes on
        torch.manual_seed(config.seed + world.rank)
    flops_per_token = model.flops_per_token()  # before sharding
    model.activation_checkpointing = train.activation_checkpointing
    if not (world.distributed and train.parallel == "fsdp"):  # FSDP2 moves each rank's shards to its device itself
        model.to(runtime.device)
    step_model = world.wrap(model, model.transformer.h, train.parallel, runtime.device)
    if train.compile or (train.compile is None and runtime.is_cuda and _compiles_here()):
        step_model = torch.compile(step_model)
    byte_lengths = torch.from_numpy(tokenizer.token_byte_lengths()).to(runtime.device, torch.float64)
    peak = train.peak_tflops * 1e12 if train.peak_tflops else None
    peak = peak or (datasheet_peak(runtime.device, runtime.dtype) if runtime.is_cuda else None)
    extras = [_hellaswag(train, tokenizer, model.config.block_size, runtime, world)] if train.hellaswag_every else []
    extras += [HeadProbe.first_block(data.val, model.config.block_size)] if train.head_scores and world.is_main else []
    trainer = Trainer(
        config=config, world=world, runtime=runtime, run_dir=run_dir, data=data, tokenizer=tokenizer, model=model,
        step_model=step_model, optimizer=make_optimizer(model, train, runtime),
        scaler=torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == torch.float16),
        evaluator=Evaluator(data, train, config.seed, model.config.block_size, byte_lengths, runtime, world),
        metrics=MetricsLog(run_dir, active=world.is_main), extra_scores=extras,
        flops_per_token=flops_per_token, peak_flops=peak * world.size if peak else None, started=started)
    if checkpoint is not None:
        trainer.restore(checkpoint)
    return trainer


def check_for_world(train: TrainConfig, world: World) -> None:
    """The checks that need the number of processes (torchrun's: one process passes them all)."""
    if train.grad_accum % world.size:
        raise ConfigError(f"train.grad_accum={train.grad_accum} (micro-batches per step, all processes together) is "
                          f"not divisible by the {world.size} processes; use a multiple of {world.size}")
    if world.distributed and train.parallel == "fsdp" and train.optimizer == "muon":
        raise ConfigError("train.optimizer=muon needs each hidden matrix whole, and train.parallel=fsdp shards them; "
                          "use train.parallel=ddp (or train.optimizer=adamw)")
    if world.distributed and train.parallel == "fsdp" and train.head_scores:
        raise ConfigError("train.head_scores needs each head's whole weights, and train.parallel=fsdp shards them; use "
                          "train.parallel=ddp (or train.head_scores=false)")


def _build_model(config: TrainRunConfig, checkpoint: Checkpoint | None, data: PreparedData, runtime: Runtime,
                 world: World) -> GPT:
    """A new model from model.*, init_from's pretrained one, or a resume's (resumed_model_config), once it fits."""
    if checkpoint is None and config.init_from is not None:
        return _pretrained_model(config, data)
    if checkpoint is None:
        model_config = config.model.with_vocabulary(data.meta["vocab_size"])
    else:
        model_config = resumed_model_config(checkpoint, config, data.meta)
    _check_data_fits(data, model_config.block_size)  # too little text: said before the memory check, as likelier
    check_fits(model_config, config.train, runtime.device, world)  # before allocating it
    return GPT(model_config)


def check_fits(model: GPTConfig, train: TrainConfig, device: torch.device, world: World) -> None:
    """Refused before allocating, by a bound from below: the float32 weights and gradients of the blocks' matrices
    and token table, and one micro-batch's activations, measured in bench.py memory (4 bytes each, checkpointed)."""
    C, L, V = model.n_embd, model.n_layer, model.vocab_size
    params = 12 * L * C * C + V * C
    shards = world.size if world.distributed and train.parallel == "fsdp" else 1  # FSDP2 splits weights and gradients
    check_memory(8 * params / shards, device, f"a model of about {params:,} parameters (its weights and gradients "
                 "alone)", "train a smaller model: lower model.n_layer or model.n_embd")  # no batch is small enough
    per_layer = 4 if train.activation_checkpointing else 38
    activations = train.batch_size * model.block_size * (per_layer * C * L + 6 * V)
    check_memory(8 * params / shards + activations, device, f"train.batch_size={train.batch_size} with a model of "
                 f"about {params:,} parameters", "lower train.batch_size (train.grad_accum keeps the tokens per step), "
                 "set train.activation_checkpointing=true, or train a smaller model")


def _pretrained_model(config: TrainRunConfig, data: PreparedData) -> GPT:
    """init_from's weights and shape; block_size (cropped) and what the weights leave open from the config."""
    settings = {name: getattr(config.model, name) for name in PRETRAINED_SETTINGS}
    model = load_pretrained(config.init_from, block_size=config.model.block_size, **settings)
    if model.config.vocab_size != data.meta["vocab_size"]:
        raise ConfigError(f"init_from={config.init_from} has a vocabulary of {model.config.vocab_size} tokens, the "
                          f"data's has {data.meta['vocab_size']}; use data tokenized like the model (GPT-2: "
                          "data.tokenizer=r50k_base, e.g. data=shakespeare)")
    shape = {k: getattr(model.config, k) for k in ("n_layer", "n_head", "n_embd", "bias", "activation", "pos_emb")}
    if model.config.attn_window is not None:
        shape["layer_windows"] = model.config.layer_windows()
    log.info(f"init_from={config.init_from}: {shape}, block_size {model.config.block_size}")
    _check_data_fits(data, model.config.block_size)
    return model


def _check_data_fits(data: PreparedData, block_size: int) -> None:
    """Every split has a file longer than a window (windows don't span files)."""
    for split, files in (("train", data.train), ("val", data.val)):
        if max(files.lengths) <= block_size:
            more = f"{'raise' if split == 'val' else 'lower'} data.val_fraction"
            more = "raise data.shard_tokens" if data.meta.get("sharded") else more
            raise ConfigError(f"the {split} split's longest token file has {max(files.lengths)} tokens, too few "
                              f"for model.block_size={block_size}; lower model.block_size or train on more text (or "
                              f"{more})")


def _hellaswag(train: TrainConfig, tokenizer: Tokenizer, block_size: int, runtime: Runtime,
               world: World) -> HellaSwagEval:
    """HellaSwag examples, read at start to fail before training; rank 0 downloads them once while the others wait."""
    path = hellaswag_path(train.hellaswag_file, "train.hellaswag_file") if world.is_main else None
    world.barrier()
    path = path or hellaswag_path(train.hellaswag_file, "train.hellaswag_file")
    examples = load_examples(path, tokenizer)
    log.info(f"HellaSwag: {len(examples):,} examples from {path}, every {train.hellaswag_every} iterations")
    return HellaSwagEval(examples, train.hellaswag_every, block_size, runtime, world)


def _compiles_here() -> bool:
    """torch.compile's GPU backend on Windows needs triton, which PyTorch doesn't bring: off without it, said."""
    if sys.platform == "win32" and importlib.util.find_spec("triton") is None:
        log.info("train.compile: off (torch.compile on Windows needs triton: pip install triton-windows)")
        return False
    return True


def usage() -> str:
    """`python train.py --help`: the keys set most; every key: --cfg job, docs/reference.md."""
    most = ("out_dir", "resume", "resume_with_changes", "data.input", "device", "train.max_iters",
            "train.learning_rate", "train.batch_size", "train.grad_accum", "train.eval_interval", "model.n_layer",
            "model.n_head", "model.n_embd", "model.block_size", "train.compile")
    return f"""Train a GPT. Settings are Hydra overrides, key=value, no dashes.

  python train.py experiment=shakespeare_char_cpu                 # a CPU, about 2 minutes
  python train.py experiment=speedrun_cpu out_dir=runs/fast       # the CPU speedrun: docs/speedrun.md

Presets (group=NAME):
  experiment   {", ".join(presets("experiment"))}
  model        {", ".join(presets("model"))}
  data         {", ".join(presets("data"))}

Keys set most, at their defaults:
{keys_help(TrainRunConfig, most)}

Examples:
  python train.py experiment=shakespeare_char_cpu train.max_iters=500 out_dir=runs/short
  python train.py out_dir=runs/short resume=true                  # after Ctrl-C: the run goes on as it was
  python train.py -m experiment=speedrun_cpu train.learning_rate=3e-3,6e-3   # a sweep, one run per value
  python train.py experiment=speedrun_cpu --cfg job --resolve     # every key, out_dir's date filled in

Every key: docs/reference.md. Hydra's own flags: --hydra-help."""


if __name__ == "__main__":
    run_hydra(main, "config", TrainRunConfig, CONFIG_GROUPS, usage)
