"""Typed config schemas, registered with Hydra's ConfigStore so a misspelt key or a wrong type fails at start.

Each key's allowed values are declared once, beside it (common.config.option); common.config.typed_config turns
Hydra's DictConfig into these dataclasses, and building them checks every value: one ConfigError naming the key.
The `model.*` keys come from model/config.py, the `data.*` keys from data/config.py.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from common.config import check_fields, option
from common.errors import ConfigError
from data.config import DataConfig, register_prepare_schema
from model.config import ATTN_IMPLS, GPTConfig
from training.optim import LR_SCHEDULES, OPTIMIZERS
from training.runtime import DEVICES, DTYPES

ON_NONFINITE = ("stop", "skip")
SEED_MAX = 2**63 - 1  # torch's generators take 64 bits; sample i of sample.py draws from seed + i
PARALLEL = ("ddp", "fsdp")
CONFIG_GROUPS = ("experiment", "model", "data")  # train.py's Hydra groups: configs/<group>/NAME.yaml, as group=NAME
# The schema's defaults for the model's shape: the baby model (configs/model/baby.yaml), not GPTConfig's GPT-2.
# Their order is the keys' order in config.yaml; the other keys follow in GPTConfig's.
SCHEMA_SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}


def _model_keys() -> type:
    """`model.*`: GPTConfig's fields less vocab_size (the data's), with their defaults and allowed values, so the
    keys can't drift from the model. Building one checks it as GPTConfig would, naming keys as model.KEY."""
    hints = typing.get_type_hints(GPTConfig)
    gpt_fields = {f.name: f for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size"}
    order = [*SCHEMA_SHAPE, *(name for name in gpt_fields if name not in SCHEMA_SHAPE)]
    keys = []
    for name in order:
        default = SCHEMA_SHAPE.get(name, gpt_fields[name].default)
        keys.append((name, hints[name], field(default=default, metadata=gpt_fields[name].metadata)))

    def gpt_config(self: Any, vocab_size: int) -> GPTConfig:
        """The model these keys describe, for the data's vocabulary."""
        return GPTConfig(vocab_size=vocab_size, **dataclasses.asdict(self))

    def check(self: Any) -> None:
        try:
            self.gpt_config(vocab_size=GPTConfig.vocab_size)  # any vocabulary: the shape is what is checked
        except ConfigError as err:
            raise ConfigError(f"model.{err}") from None

    namespace = {"gpt_config": gpt_config, "__post_init__": check}
    cls = dataclasses.make_dataclass("ModelConfig", keys, namespace=namespace)
    cls.__module__ = __name__  # importable by name, like a class written here
    return cls


ModelConfig = _model_keys()


@dataclass
class OptimConfig:
    """`train.*`: the optimizer, its schedule, evaluation, logging and the step's machinery."""

    batch_size: int = option(12, at_least=1)  # sequences per micro-batch, in each process
    grad_accum: int = option(1, at_least=1)  # micro-batches per optimizer step, all processes together
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
    # evaluate only from this iteration on (and always after the last step): a run timed to a target skips the
    # evaluations it knows come too early (each costs a pass over the val split with full_val). ckpt.pt is written
    # at evaluations, so there is none before it either
    eval_from: int = option(0, at_least=0)
    eval_iters: int = option(100, at_least=1)  # batches per split in each evaluation
    full_val: bool = False  # evaluate val on every block of the split, in order, instead of eval_iters batches
    target_val_loss: float | None = None  # stop once an evaluation reaches it; metrics get time_to_target_s
    keep_best: bool = False  # also keep best.pt, the checkpoint of the lowest val loss (ckpt.pt stays the latest)
    log_interval: int = option(10, at_least=1)
    compile: bool | None = None  # default: on for CUDA, off elsewhere
    # recompute each block's activations in backward instead of keeping them: far less memory for long contexts
    # and deep models, for about one more forward pass of compute (bench.py memory)
    activation_checkpointing: bool = False
    dtype: str = option("auto", choices=DTYPES)
    on_nonfinite: str = option("stop", choices=ON_NONFINITE)  # a NaN/Inf loss: stop (ckpt.pt stays) | skip the step
    # with on_nonfinite=skip: stop after this many skipped steps in a row (and at once if the weights are non-finite)
    max_consecutive_skips: int = option(10, at_least=1)
    parallel: str = option("ddp", choices=PARALLEL)  # under torchrun: ddp (replicas) | fsdp (FSDP2: sharded)
    # HellaSwag at the evaluations whose iteration is a multiple of this (BPE data only); 0: never
    hellaswag_every: int = option(0, at_least=0, hint="0 means never; use a multiple of train.eval_interval")
    # a local hellaswag_val.jsonl; null: data/cache/hellaswag's, downloaded once
    hellaswag_file: str | None = option(None, path=True)

    def __post_init__(self) -> None:
        check_fields(self, "train.")
        if self.hellaswag_every % self.eval_interval:
            raise ConfigError(
                f"train.hellaswag_every={self.hellaswag_every} is not a multiple of train.eval_interval="
                f"{self.eval_interval}: HellaSwag runs at evaluations"
            )
        if self.hellaswag_file is not None and not self.hellaswag_every:
            raise ConfigError(
                f"train.hellaswag_file={self.hellaswag_file} is read only with train.hellaswag_every > 0; set it"
            )

    @property
    def decay_iters(self) -> int:
        """Where the schedule reaches min_lr: lr_decay_iters, or max_iters when that is null."""
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
    # seconds wandb may take to start (no network stalls it); then training goes on without it, with a warning
    init_timeout: float = option(30.0, above=0.0)

    def __post_init__(self) -> None:
        check_fields(self, "wandb.")


@dataclass
class TrainRunConfig:
    out_dir: str = option("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}", directory=True)
    device: str = option("auto", choices=DEVICES)
    seed: int = option(1337, at_least=0, at_most=SEED_MAX)
    resume: bool = False  # continue the run in out_dir from its ckpt.pt, with its saved settings
    # with resume=true: let overrides change what the run trains (its schedule, optimizer, data, model settings)
    resume_with_changes: bool = False
    # gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a HF GPT-2 directory: start from it
    init_from: str | None = option(None, path=True)
    model: ModelConfig = field(default_factory=ModelConfig)  # type: ignore[valid-type]
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        check_fields(self)  # its own keys; the groups checked themselves as they were built
        if self.train.hellaswag_every and self.data.tokenizer == "char":
            raise ConfigError(
                f"train.hellaswag_every={self.train.hellaswag_every} needs a BPE model (HellaSwag is scored in GPT-2's "
                "tokens); this run's data.tokenizer is char (use e.g. data=shakespeare)"
            )


@dataclass
class ModelChoice:
    """The keys that pick the model sample.py and eval.py run."""

    out_dir: str | None = option(None, path=True)  # a train.py run directory holding ckpt.pt (or init_from)
    # instead of out_dir: gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a HF GPT-2 dir
    init_from: str | None = option(None, path=True)
    ckpt: str = option("latest", choices=("latest", "best"))  # the run's ckpt.pt, or its best.pt (train.keep_best)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.out_dir is None and self.init_from is None:
            raise ConfigError(
                "out_dir is required: pass out_dir=RUN, a directory written by train.py (or init_from=gpt2)"
            )


@dataclass
class SampleConfig(ModelChoice):
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = option(3, at_least=1)
    max_new_tokens: int = option(500, at_least=1)
    temperature: float = option(0.8, at_least=0.0, hint="0 means greedy decoding (the most likely token)")
    top_k: int | None = option(200, at_least=1, hint="null means no cut-off")  # the k most likely tokens
    top_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")  # nucleus: mass p
    min_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")  # p >= min_p * top
    seed: int = option(1337, at_least=0, at_most=SEED_MAX)
    device: str = option("auto", choices=DEVICES)
    dtype: str = option("auto", choices=DTYPES)
    attn_impl: str | None = option(None, choices=ATTN_IMPLS)  # default: the checkpoint's
    use_cache: bool = True  # KV cache: run the prompt once, then one token per step
    # a sample ends before the first of these strings (\n, \t: newline, tab); a BPE model's <|endoftext|> too, but
    # with stop=[]
    stop: list[str] | None = None
    stream: bool | None = None  # print each sample as it is generated; null: when stdout is a terminal
    attention_dir: str | None = option(None, directory=True)  # write attention.npz and one PNG per layer here
    check_causal: bool = False  # print the causality demonstration after the samples: a summary by range
    check_causal_positions: bool = False  # with check_causal: one line per position instead of the summary

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stop is not None and "" in self.stop:
            raise ConfigError(f"stop={self.stop} has an empty string, which would stop at once; remove it")


@dataclass
class EvalConfig(ModelChoice):
    # a UTF-8 text file to score; null: the run's own val split (init_from needs a file)
    input: str | None = option(None, path=True)
    # tokens of context a window holds; null: the model's block_size
    context: int | None = option(None, at_least=1, hint="null means the model's block_size")
    # tokens each window advances (and scores, but the first); null: context // 2. stride=context: disjoint windows
    stride: int | None = option(None, at_least=1, hint="null means half the context")
    # windows per forward pass; null: 4096 tokens' worth (as train.full_val), at least 1
    batch_size: int | None = option(None, at_least=1, hint="null means 4096 // context windows")
    hellaswag: bool = False  # also score HellaSwag's validation set (BPE models)
    # a local hellaswag_val.jsonl; null: data/cache/hellaswag's, downloaded once
    hellaswag_file: str | None = option(None, path=True)
    device: str = option("auto", choices=DEVICES)
    dtype: str = option("auto", choices=DTYPES)
    attn_impl: str | None = option(None, choices=ATTN_IMPLS)  # default: the checkpoint's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.out_dir is None and self.input is None and not self.hellaswag:
            raise ConfigError(
                f"init_from={self.init_from} has no val split to score: pass input=FILE (a text file) or hellaswag=true"
            )
        if self.hellaswag_file is not None and not self.hellaswag:
            raise ConfigError(f"hellaswag_file={self.hellaswag_file} is read only with hellaswag=true; add it")


@dataclass
class ServeConfig(ModelChoice):
    """serve.py's keys (configs/serve.yaml): where it listens, the model's device, and the limits of its work."""

    host: str = "127.0.0.1"  # loopback: only this machine; 0.0.0.0 listens on every interface
    port: int = option(8000, at_least=0, at_most=65535)  # 0: any free port (printed when ready)
    device: str = option("auto", choices=DEVICES)
    dtype: str = option("auto", choices=DTYPES)
    attn_impl: str | None = option(None, choices=ATTN_IMPLS)  # default: the checkpoint's
    api_key: str | None = None  # every request then needs Authorization: Bearer KEY; null: $GPT_LAB_API_KEY, if set
    model_id: str | None = None  # the id /v1/models lists and requests name; null: the run directory's name
    max_batch: int = option(64, at_least=1)  # sequences decoded together, one forward pass a step
    max_queue: int = option(256, at_least=0)  # choices waiting for a place in the batch; past it: 503, Retry-After
    max_tokens: int = option(1024, at_least=1)  # the largest max_tokens a request may ask for
    max_choices: int = option(16, at_least=1)  # prompts x n in one request
    max_prompt_tokens: int = option(8192, at_least=1)  # a rolling model's prompt; others: block_size with max_tokens
    timeout_s: float = option(300.0, above=0.0)  # a request running longer is cancelled: 504
    max_body_bytes: int = option(1_000_000, at_least=1)  # a larger request body: 413
    # torch's CPU threads for the model; null: one less than the cores (at least 1), leaving one to the HTTP side
    threads: int | None = option(None, at_least=1)


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainRunConfig)
    cs.store(name="sample_schema", node=SampleConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="serve_schema", node=ServeConfig)
    register_prepare_schema()
