"""sample.py's, eval.py's and serve.py's typed configs (configs/sample.yaml, eval.yaml, serve.yaml), registered
with Hydra's ConfigStore; built and checked as training/schema.py's are (common.config)."""

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
    # instead of out_dir: gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a HF GPT-2 dir
    init_from: str | None = option(None, path=True)
    ckpt: str = option("latest", choices=("latest", "best"))  # the run's ckpt.pt, or its best.pt (train.keep_best)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.out_dir is None and self.init_from is None:
            raise ConfigError("out_dir is required: pass out_dir=RUN, a directory train.py wrote (or init_from=gpt2)")


@dataclass
class SampleConfig(ModelChoice):
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = option(3, at_least=1)
    # at most a million: hours of generation on a CPU and a few MB of text a sample, past any real use; 1e10 would
    # run for days while its text filled the memory
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
    # a sample ends before the first of these strings (\n, \t: newline, tab); a BPE model's <|endoftext|> too, but
    # with stop=[]
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
    # a host beyond loopback with no api_key is refused unless this says so: anyone reaching the port may use it
    allow_no_api_key: bool = False
    model_id: str | None = None  # the id /v1/models lists and requests name; null: the run directory's name
    max_batch: int = option(64, at_least=1)  # sequences decoded together, one forward pass a step
    max_queue: int = option(256, at_least=0)  # choices waiting for a place in the batch; past it: 503, Retry-After
    max_tokens: int = option(1024, at_least=1)  # the largest max_tokens a request may ask for
    max_choices: int = option(16, at_least=1)  # prompts x n in one request
    # a prompt's tokens at most (a learned-position model sees the last block_size of them, as sample.py does)
    max_prompt_tokens: int = option(8192, at_least=1)
    timeout_s: float = option(300.0, above=0.0)  # a request running longer is cancelled: 504
    # Ctrl-C or SIGTERM: requests in flight get this long to finish, then each ends with an error (503)
    shutdown_s: float = option(5.0, at_least=0.0)
    max_body_bytes: int = option(1_000_000, at_least=1)  # a larger request body: 413
    max_connections: int = option(1000, at_least=1)  # open at once (within the process's file limit); past it: closed
    # a connection with no whole request this long after it opened (or after its last answer) is closed
    header_timeout_s: float = option(10.0, above=0.0)
    # torch's CPU threads for the model; null: one less than the cores (at least 1), leaving one to the HTTP side
    threads: int | None = option(None, at_least=1)


def register_schemas() -> None:
    for name, schema in (("sample", SampleConfig), ("eval", EvalConfig), ("serve", ServeConfig)):
        ConfigStore.instance().store(name=f"{name}_schema", node=schema)
