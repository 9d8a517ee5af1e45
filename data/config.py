"""The `data.*` keys: a text (train.bin / val.bin), or a corpus of documents (shards: the first is val, the rest
train). Checked when built, so a bad value fails before any data is read or prepared."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config import check_fields, option
from common.errors import ConfigError

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# The sha256 of the text at a known URL: a local copy of it (data.input) counts as the same text
KNOWN_TEXTS = {SHAKESPEARE_URL: "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"}


@dataclass
class DataConfig:
    name: str = "shakespeare_char"  # folder under data/cache unless data.dir is set
    tokenizer: str = "char"  # char, or a tiktoken encoding (r50k_base is GPT-2's BPE); a corpus needs a BPE
    # a UTF-8 text file instead of the download, or a directory of .txt / .jsonl documents
    input: str | None = option(None, path=True)
    url: str | None = SHAKESPEARE_URL
    dir: str | None = option(None, directory=True)  # where the token files and meta.json live
    val_fraction: float = option(0.1, above=0.0, below=1.0)  # a text's last part kept for val
    hf_dataset: str | None = None  # a Hugging Face dataset to stream, e.g. HuggingFaceFW/fineweb-edu (pip ".[hf]")
    hf_name: str | None = None  # its configuration, e.g. sample-10BT
    # tokens per shard of a corpus (llm.c's and nanoGPT's 100M)
    shard_tokens: int = option(100_000_000, at_least=1, hint="it counts tokens per shard (100M in llm.c)")
    max_tokens: int | None = option(None, at_least=1, hint="null means the whole corpus")  # stop a corpus early
    # processes encoding a corpus; null: the CPUs available less one
    num_proc: int | None = option(None, at_least=1, hint="null means the CPUs available less one")

    def __post_init__(self) -> None:
        check_fields(self, "data.")
        if self.hf_name and not self.hf_dataset:
            raise ConfigError(f"data.hf_name={self.hf_name} needs data.hf_dataset (say HuggingFaceFW/fineweb-edu)")
        if self.hf_dataset and self.input:
            raise ConfigError(
                f"data.input and data.hf_dataset={self.hf_dataset} are both set; keep one (data.hf_dataset=null)"
            )


@dataclass
class PrepareConfig:
    """`python -m data.prepare`: only the data group."""

    data: DataConfig = field(default_factory=DataConfig)


def register_prepare_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)
