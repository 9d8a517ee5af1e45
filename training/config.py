"""train.py's typed config: `model.*` (model/gpt.py's ModelConfig), `data.*` (data/prepare.py's DataConfig), `train.*`,
`wandb.*` and the run's own keys. A bad key or value fails at start, in one line naming it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from common.config import SEED_MAX, check_fields, option
from common.errors import ConfigError
from common.runtime import DEVICES, DTYPES
from data.prepare import DataConfig
from model import ModelConfig

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
    learning_rate: float = option(1e-3, above=0.0)
    min_lr: float = option(1e-4, at_least=0.0)  # the schedule (cosine or wsd) ends at this
    max_iters: int = option(2000, at_least=0)
    lr_decay_iters: int | None = option(None, at_least=0)  # default: max_iters
    lr_schedule: str = option("cosine", choices=LR_SCHEDULES)  # after warmup: cosine | wsd (plateau, then cooldown)
    cooldown_frac: float = option(0.2, above=0.0, at_most=1.0)  # wsd's: the share of lr_decay_iters cooling down
    warmup_iters: int = option(100, at_least=0)
    weight_decay: float = option(0.1, at_least=0.0)  # decoupled, on 2-D weights (and Muon's matrices)
    beta1: float = option(0.9, at_least=0.0, below=1.0)
    beta2: float = option(0.99, at_least=0.0, below=1.0)
    grad_clip: float = option(1.0, at_least=0.0)  # 0 disables clipping
    # adamw: AdamW for every parameter (nanoGPT's) | muon: Muon for the blocks' nn.Linear weights, AdamW for the rest
    optimizer: str = option("adamw", choices=OPTIMIZERS)
    # Muon's keys, read with optimizer=muon only (a preset may set them and still sweep the optimizer)
    muon_lr: float = option(0.02, above=0.0)  # Muon's peak lr; follows learning_rate's schedule (scaled by the ratio)
    muon_momentum: float = option(0.95, at_least=0.0, below=1.0)  # Muon's Nesterov momentum, after its warmup
    muon_momentum_warmup: int = option(300, at_least=0)  # iterations to go from 0.85 to muon_momentum; 0: none
    muon_ns_steps: int = option(5, at_least=1)  # Newton-Schulz iterations per update: fewer are cheaper, rougher
    eval_interval: int = option(250, at_least=1)
    # evaluate (and write ckpt.pt) only from this iteration on, and after the last step: a timed run skips early ones
    eval_from: int = option(0, at_least=0)
    eval_iters: int = option(100, at_least=1)  # batches per split in each evaluation
    full_val: bool = False  # evaluate val on every block of the split, in order, instead of eval_iters batches
    target_val_loss: float | None = None  # stop once an evaluation reaches it; metrics get time_to_target_s
    keep_best: bool = False  # also keep best.pt, the checkpoint of the lowest val loss (ckpt.pt stays the latest)
    log_interval: int = option(10, at_least=1)
    compile: bool | None = None  # default: on for CUDA, off elsewhere
    # recompute each block's activations in backward: far less memory, ~one more forward's compute (bench.py memory)
    activation_checkpointing: bool = False
    dtype: str = option("auto", choices=DTYPES)  # auto: bfloat16 on CUDA GPUs that have it, else float32
    peak_tflops: float | None = option(None, above=0.0)  # MFU's denominator per process; null: datasheet peak or no MFU
    on_nonfinite: str = option("stop", choices=ON_NONFINITE)  # a NaN/Inf loss: stop (ckpt.pt stays) | skip the step
    parallel: str = option("ddp", choices=PARALLEL)  # under torchrun: ddp (replicas) | fsdp (FSDP2: sharded)
    # HellaSwag at the evaluations whose iteration is a multiple of this (BPE data only); 0: never
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
    enabled: bool = False
    project: str = "gpt"
    entity: str | None = None
    run_name: str | None = None
    mode: str | None = option(None, choices=("online", "offline", "disabled"))  # default: $WANDB_MODE, else online
    tags: list[str] = field(default_factory=list)
    group: str | None = None
    init_timeout: float = option(30.0, above=0.0)  # seconds wandb may take to start; then training goes on without it

    def __post_init__(self) -> None:
        check_fields(self, "wandb.")


@dataclass
class TrainRunConfig:
    out_dir: str = option("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}", path=True)
    device: str = option("auto", choices=DEVICES)
    seed: int = option(1337, at_least=0, at_most=SEED_MAX)
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


def register_schemas() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainRunConfig)
