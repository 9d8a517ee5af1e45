"""Typed config schemas, registered with Hydra's ConfigStore so a misspelt key or wrong type fails at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


@dataclass
class ModelConfig:
    """The user-facing keys of model.GPTConfig (its vocab_size comes from the data); defaults: the baby model."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = True
    attn_impl: str = "flash"  # flash | math
    activation: str = "gelu"  # gelu | gelu_tanh (GPT-2's approximation) | relu2 (ReLU squared)
    pos_emb: str = "learned"  # learned | rope (rotary)


@dataclass
class DataConfig:
    """A text (train.bin / val.bin), or a corpus of documents (shards: the first is val, the rest train)."""

    name: str = "shakespeare_char"  # folder under data/cache unless data.dir is set
    tokenizer: str = "char"  # char, or a tiktoken encoding (r50k_base is GPT-2's BPE); a corpus needs a BPE
    input: str | None = None  # a UTF-8 text file instead of the download, or a directory of .txt / .jsonl documents
    url: str | None = SHAKESPEARE_URL
    dir: str | None = None  # where the token files and meta.json live
    val_fraction: float = 0.1  # a text's last part kept for val (a corpus's val is its first shard)
    hf_dataset: str | None = None  # a Hugging Face dataset to stream, e.g. HuggingFaceFW/fineweb-edu (pip ".[hf]")
    hf_name: str | None = None  # its configuration, e.g. sample-10BT
    shard_tokens: int = 100_000_000  # tokens per shard of a corpus (llm.c's and nanoGPT's 100M)
    max_tokens: int | None = None  # stop a corpus after this many tokens; null: all of it
    num_proc: int | None = None  # processes encoding a corpus; null: the CPUs available less one


@dataclass
class OptimConfig:
    batch_size: int = 12  # sequences per micro-batch, in each process
    grad_accum: int = 1  # micro-batches per optimizer step, all processes together (torchrun divides them)
    learning_rate: float = 1e-3
    min_lr: float = 1e-4  # the cosine decays to this
    max_iters: int = 2000
    lr_decay_iters: int | None = None  # default: max_iters
    warmup_iters: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    eval_interval: int = 250
    eval_iters: int = 100  # batches per split in each evaluation
    full_val: bool = False  # evaluate val on every block of the split, in order, instead of eval_iters batches
    target_val_loss: float | None = None  # stop once an evaluation reaches it; metrics get time_to_target_s
    log_interval: int = 10
    compile: bool | None = None  # default: on for CUDA, off elsewhere
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    on_nonfinite: str = "stop"  # a NaN/Inf loss: stop (the last checkpoint stays) | skip (drop that step)
    parallel: str = "ddp"  # under torchrun: ddp (replicas) | fsdp (FSDP2: parameters sharded across processes)


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "gpt"
    entity: str | None = None
    run_name: str | None = None
    mode: str | None = None  # online | offline | disabled; default: $WANDB_MODE, else online
    tags: list[str] = field(default_factory=list)
    group: str | None = None


@dataclass
class TrainRunConfig:
    out_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    device: str = "auto"  # auto | cpu | cuda | mps (auto: cuda > mps > cpu)
    seed: int = 1337
    resume: bool = False  # continue the run in out_dir from its ckpt.pt
    init_from: str | None = None  # gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a HF GPT-2 directory: start from it
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class PrepareConfig:
    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class SampleConfig:
    out_dir: str = MISSING  # a train.py run directory holding ckpt.pt
    init_from: str | None = None  # instead of out_dir: gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a HF GPT-2 dir
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = 3
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int | None = 200
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    attn_impl: str | None = None  # default: the checkpoint's
    use_cache: bool = True  # KV cache: run the prompt once, then one token per step
    attention_dir: str | None = None  # write attention.npz and one PNG per layer here
    check_causal: bool = False  # print the causality demonstration after the samples


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainRunConfig)
    cs.store(name="prepare_schema", node=PrepareConfig)
    cs.store(name="sample_schema", node=SampleConfig)
