"""sample.py's, eval.py's and serve.py's typed configs (configs/*.yaml), registered with Hydra's ConfigStore."""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from common.config import SEED_MAX, check_fields, option
from common.errors import ConfigError
from common.runtime import DEVICES, DTYPES
from model.gpt import ATTN_IMPLS, DEFAULT_TEMPERATURE, DEFAULT_TOP_K

MAX_NEW_TOKENS = 1_000_000


@dataclass
class ModelChoice:
    """The keys that pick the model sample.py and eval.py run."""

    out_dir: str | None = option(None, path=True)  # a train.py run directory holding ckpt.pt (or init_from)
    init_from: str | None = option(None, path=True)  # instead of out_dir: gpt2[-medium|-large|-xl] or a HF GPT-2 dir
    ckpt: str = option("latest", choices=("latest", "best"))  # the run's ckpt.pt, or its best.pt (train.keep_best)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.out_dir is None and self.init_from is None:
            raise ConfigError("out_dir is required: pass out_dir=RUN, a directory train.py wrote (or init_from=gpt2)")


@dataclass
class SampleConfig(ModelChoice):
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = option(3, at_least=1)
    # at most a million (hours on a CPU, past any real use): 1e10 would run for days while its text filled memory
    max_new_tokens: int = option(500, at_least=1, at_most=MAX_NEW_TOKENS)
    temperature: float = option(
        DEFAULT_TEMPERATURE, at_least=0.0, hint="0 means greedy decoding (the most likely token)"
    )
    top_k: int | None = option(DEFAULT_TOP_K, at_least=1, hint="null means no cut-off")  # the k most likely tokens
    top_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")  # nucleus: mass p
    min_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")  # p >= min_p * top
    seed: int = option(1337, at_least=0, at_most=SEED_MAX)
    device: str = option("auto", choices=DEVICES)
    dtype: str = option("auto", choices=DTYPES)
    attn_impl: str | None = option(None, choices=ATTN_IMPLS)  # default: the checkpoint's
    use_cache: bool = True  # KV cache: run the prompt once, then one token per step
    # a sample ends before the first of these strings (\n, \t: newline, tab); BPE's <|endoftext|> too, unless stop=[]
    stop: list[str] | None = None
    stream: bool | None = None  # print each sample as it is generated; null: when stdout is a terminal
    attention_dir: str | None = option(None, path=True)  # write attention.npz and one PNG per layer here
    check_causal: bool = False  # print the causality demonstration after the samples: a summary by range
    check_causal_positions: bool = False  # with check_causal: one line per position instead of the summary

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stop is not None and "" in self.stop:
            raise ConfigError(f"stop={self.stop} has an empty string, which would stop at once; remove it")


@dataclass
class EvalConfig(ModelChoice):
    input: str | None = option(None, path=True)  # a UTF-8 text file to score; null: the run's own val split
    context: int | None = option(None, at_least=1, hint="null means the model's block_size")  # tokens a window holds
    # tokens each window advances (and scores, but the first); null: context // 2. stride=context: disjoint windows
    stride: int | None = option(None, at_least=1, hint="null means half the context")
    # windows per forward pass; null: 4096 tokens' worth (as train.full_val), at least 1
    batch_size: int | None = option(None, at_least=1, hint="null means 4096 // context windows")
    hellaswag: bool = False  # also score HellaSwag's validation set (BPE models)
    hellaswag_file: str | None = option(None, path=True)  # local hellaswag_val.jsonl; null: in data/cache/hellaswag
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
    allow_no_api_key: bool = False  # else a host beyond loopback needs api_key: anyone reaching the port may use it
    model_id: str | None = None  # the id /v1/models lists and requests name; null: the run directory's name
    max_queue: int = option(64, at_least=0)  # requests waiting for the model's turn; past it: 503, Retry-After
    max_choices: int = option(16, at_least=1)  # prompts x n in one request, generated a prompt's n at a time
    max_request_tokens: int = option(4096, at_least=1)  # max_tokens x choices: the tokens one request generates
    max_prompt_tokens: int = option(8192, at_least=1)  # all the prompts' tokens of one request
    timeout_s: float = option(300.0, above=0.0)  # a request running longer, its wait included, is cancelled: 504
    shutdown_s: float = option(5.0, at_least=0.0)  # on Ctrl-C or SIGTERM, requests in flight get this long; then 503
    max_body_bytes: int = option(1_000_000, at_least=1)  # a larger request body: 413
    max_connections: int = option(1000, at_least=1)  # connections and requests at once (uvicorn's limit_concurrency)
    threads: int | None = option(None, at_least=1)  # torch's CPU threads; null: a core less, left to the HTTP side


def register_schemas() -> None:
    for name, schema in (("sample", SampleConfig), ("eval", EvalConfig), ("serve", ServeConfig)):
        ConfigStore.instance().store(name=f"{name}_schema", node=schema)
