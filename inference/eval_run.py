"""eval.py's work: sliding-window loss, perplexity, bits per byte of a text (or val split), HellaSwag; one record."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from common.errors import ConfigError, DataError
from common.runtime import check_memory, make_runtime, memory_bytes
from data.prepare import DataConfig, dataset_dir, ensure_prepared
from data.source import read_utf8
from data.tokenizers import Tokenizer
from evals.hellaswag import hellaswag_examples, hellaswag_sums
from evals.perplexity import score_sequences
from inference.sampling import EvalConfig, LoadedModel, load_model
from model import GPTConfig
from model.gpt import Checkpoint


def run_eval(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    """eval.py's JSON line; every file is found, and every value checked, before the first forward pass."""
    runtime = make_runtime(cfg.device, cfg.dtype)
    loaded = load_model(cfg.out_dir, cfg.init_from, cfg.ckpt, cfg.attn_impl)
    model = loaded.model.to(runtime.device).eval()
    block_size = model.config.block_size
    context, stride = windows_of(cfg, block_size)
    examples = None
    if cfg.hellaswag:  # before scoring the text: a missing file fails at once, not after it
        examples = hellaswag_examples(loaded.tokenizer, cfg.hellaswag_file, "hellaswag_file")
    record: dict[str, Any] = {}
    text = _text_to_score(cfg, loaded)
    if text is not None:
        source, sequences = text
        batch_size = cfg.batch_size or max(1, 4096 // context)  # a big batch keeps small models' matmuls efficient
        batch_size = _fitting_batch(batch_size, model.config, context, runtime.device)
        byte_lengths = torch.from_numpy(loaded.tokenizer.token_byte_lengths()).to(runtime.device, torch.float64)
        score = score_sequences(model, sequences, byte_lengths, context, stride, batch_size, runtime.autocast, progress)
        record |= {"input": source, "loss": score.loss, "perplexity": score.perplexity, "bpb": score.bpb}
        record |= {"tokens": score.tokens, "bytes": score.bytes, "context": context, "stride": stride}
    if examples is not None:
        shown = tqdm(examples, unit="example", desc="hellaswag", disable=not progress)
        sums = hellaswag_sums(model, ((e, True) for e in shown), block_size, runtime.device, runtime.autocast)
        correct, correct_norm, count = sums.tolist()
        record |= {"hellaswag_acc": correct / count, "hellaswag_acc_norm": correct_norm / count}
        record |= {"hellaswag_examples": round(count)}
    return record


def _fitting_batch(batch_size: int, config: GPTConfig, context: int, device: torch.device) -> int:
    """At most the windows that fit in half the device's memory (a window's float32 logits thrice, and activations)."""
    per_window = context * (16 * config.vocab_size + 64 * config.n_embd)
    check_memory(per_window, device, f"one window of context={context}", "lower context")
    memory = memory_bytes(device)
    fitting = batch_size if memory is None else max(1, min(batch_size, memory // 2 // per_window))
    if fitting < batch_size:
        print(f"eval.py: batch_size={batch_size} windows don't fit in memory; scoring {fitting} a pass",
              file=sys.stderr)
    return fitting


def windows_of(cfg: EvalConfig, block_size: int) -> tuple[int, int]:
    """context (at most block_size) and stride (1 ... context), the defaults filled in."""
    context = block_size if cfg.context is None else cfg.context
    if context > block_size:
        raise ConfigError(f"context={context} exceeds the model's block_size={block_size}; use at most that")
    stride = max(1, context // 2) if cfg.stride is None else cfg.stride
    if stride > context:
        held = "context" if cfg.context is not None else "the model's block_size"
        raise ConfigError(f"stride={stride} must be in [1, {context}]: at most the tokens a window holds ({held})")
    return context, stride


def readable(record: dict[str, Any]) -> list[str]:
    """The lines eval.py prints before its JSON line."""
    lines = []
    if "loss" in record:
        lines.append(f"{record['input']}: {record['tokens']:,} tokens scored ({record['bytes']:,} bytes of text), "
                     f"context {record['context']}, stride {record['stride']}")
        lines.append(f"loss {record['loss']:.4f} nats/token, perplexity {record['perplexity']:.3f}, "
                     f"{record['bpb']:.4f} bits/byte")
    if "hellaswag_acc" in record:
        lines.append(f"hellaswag: acc {record['hellaswag_acc']:.4f}, acc_norm {record['hellaswag_acc_norm']:.4f} "
                     f"over {record['hellaswag_examples']:,} examples")
    return lines


def _text_to_score(cfg: EvalConfig, loaded: LoadedModel) -> tuple[str, list[np.ndarray]] | None:
    """input's tokens, or the run's val split (one sequence per token file); None: HellaSwag alone (init_from)."""
    if cfg.input is not None:
        return cfg.input, [_file_tokens(cfg.input, loaded.tokenizer)]
    if loaded.checkpoint is None:
        return None  # the config asked for input=FILE unless hellaswag=true
    data_dir, files = _val_split(loaded.checkpoint, cfg.out_dir)
    return f"{data_dir} (val split)", files


def _file_tokens(input_path: str, tokenizer: Tokenizer) -> np.ndarray:
    path = Path(os.path.expanduser(input_path))
    if not path.is_file():
        raise DataError(f"input={input_path} is not a file; name a UTF-8 text file")
    tokens = np.asarray(tokenizer.encode(read_utf8(path)), dtype=np.int64)
    if len(tokens) < 2:
        raise DataError(f"input={input_path} has {len(tokens)} token(s): at least 2 are needed to score one")
    return tokens


def _val_split(checkpoint: Checkpoint, out_dir: str | None) -> tuple[Path, list[np.ndarray]]:
    """The token files of the val split the run was trained beside, found through its saved data.* keys."""
    saved = checkpoint.config.get("data")
    if not isinstance(saved, dict):
        raise DataError(f"the checkpoint in {out_dir} holds no data config to find its val split; pass input=FILE")
    known = {f.name for f in dataclasses.fields(DataConfig)}
    config = DataConfig(**{k: v for k, v in saved.items() if k in known})
    try:
        data = ensure_prepared(config, prepare=False)  # read, never made: a moved or changed source is an error
    except DataError:
        where = dataset_dir(config.name, config.dir)
        raise DataError(f"no val split of {out_dir} in {where} (train.py prepares it there from the run's data.* "
                        "keys; gone, or its source changed since): pass input=FILE") from None
    if data.meta["tokenizer"] != checkpoint.tokenizer:
        raise DataError(f"the val split in {data.dir} was tokenized unlike {out_dir}'s model; pass input=FILE")
    return data.dir, [data.val.open(i) for i in range(len(data.val.paths))]
