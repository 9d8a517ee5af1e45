"""Score a model: sliding-window loss, perplexity and bits per byte of a text (or a run's val split), and HellaSwag
accuracy (evals/). Readable lines, then one JSON line, go to stdout; progress to stderr. usage(): the keys set most."""

import json
import math
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from common.config import end_quietly_when_stdout_closes, keys_help, option, run_hydra, typed_config
from common.errors import ConfigError
from inference.eval_run import run_eval
from inference.sampling import ModelChoice


@dataclass
class EvalConfig(ModelChoice):
    # a UTF-8 text file to score; null: the run's own val split (init_from needs a file)
    input: str | None = option(None, path=True)
    # tokens a window holds; null: the model's block_size
    context: int | None = option(None, at_least=1, hint="null means the model's block_size")
    # tokens each window advances (and scores, but the first); null: context // 2. stride=context: disjoint windows
    stride: int | None = option(None, at_least=1, hint="null means half the context")
    # windows per forward pass; null: 4096 // context, lowered with a note to what fits in half the memory
    batch_size: int | None = option(None, at_least=1, hint="null means 4096 // context windows")
    hellaswag: bool = False  # also score HellaSwag's validation set (BPE models)
    hellaswag_file: str | None = option(None, path=True)  # local hellaswag_val.jsonl; null: in data/cache/hellaswag

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.out_dir is None and self.input is None and not self.hellaswag:
            raise ConfigError(f"init_from={self.init_from} has no val split to score: pass input=FILE (a text file) or "
                              "hellaswag=true")
        if self.hellaswag_file is not None and not self.hellaswag:
            raise ConfigError(f"hellaswag_file={self.hellaswag_file} is read only with hellaswag=true; add it")


ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


def usage() -> str:
    return f"""Score a model: loss, perplexity and bits per byte of a text, and HellaSwag. Settings are key=value.

Keys set most, at their defaults:
{keys_help(EvalConfig, ("out_dir", "init_from", "input", "context", "stride", "hellaswag", "ckpt"))}

Examples:
  python eval.py out_dir=runs/cpu
  python eval.py init_from=gpt2 input=text.txt hellaswag=true

Every key: docs/reference.md. Hydra's own flags: --hydra-help."""


def main(dict_cfg: DictConfig) -> None:
    record = run_eval(typed_config(dict_cfg, EvalConfig))  # checked: one line for a bad value
    end_quietly_when_stdout_closes()
    if "loss" in record:
        print(f"{record['input']}: {record['tokens']:,} tokens scored ({record['bytes']:,} bytes of text), "
              f"context {record['context']}, stride {record['stride']}")
        print(f"loss {record['loss']:.4f} nats/token, perplexity {record['perplexity']:.3f}, "
              f"{record['bpb']:.4f} bits/byte")
    if "hellaswag_acc" in record:
        print(f"hellaswag: acc {record['hellaswag_acc']:.4f}, acc_norm {record['hellaswag_acc_norm']:.4f} "
              f"over {record['hellaswag_examples']:,} examples")
    # NaN (bits per byte of a text that is all special tokens) isn't JSON: null
    print(json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}))


if __name__ == "__main__":
    run_hydra(main, "eval", EvalConfig, usage=usage)
