"""`python -m data.prepare`: a text or a corpus tokenized into its dataset folder (train.py does it when needed)."""

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from common.config import CONFIG_DIR, exit_on_user_error, presets, run_hydra, typed_config
from data.prepare import PrepareConfig, ensure_prepared

USAGE = """Tokenize a text or a corpus into data/cache/NAME (train.py does it when needed). Settings: key=value.

  data=NAME               {presets}
  data.input=FILE|DIR     your own UTF-8 text, or a directory of .txt / .jsonl documents
  data.tokenizer=NAME     char, or a tiktoken encoding such as r50k_base (GPT-2's)

Example: python -m data.prepare data.input=my_text.txt data.name=mine"""


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="prepare")
def _prepare(cfg: DictConfig) -> None:
    with exit_on_user_error():
        data = ensure_prepared(typed_config(cfg, PrepareConfig).data)
    m = data.meta
    shards = f" in {m['train_shards'] + m['val_shards']} shards" if m.get("sharded") else ""
    print(f"{data.dir}: {m['train_tokens']:,} train and {m['val_tokens']:,} val tokens{shards}, "
          f"vocabulary {m['vocab_size']}")


def main() -> None:
    ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)
    run_hydra(_prepare, PrepareConfig, ("data",), lambda: USAGE.format(presets=", ".join(presets("data"))))
