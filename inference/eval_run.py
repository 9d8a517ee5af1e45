"""eval.py's work: sliding-window loss, perplexity, bits per byte of a text (or val split), HellaSwag; one record."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from common.errors import ConfigError, DataError
from common.runtime import check_memory, make_runtime, memory_bytes
from data.prepare import DataConfig, dataset_dir, ensure_prepared
from data.source import read_utf8
from data.tokenizers import CharTokenizer
from evals.hellaswag import hellaswag_path, hellaswag_sums, load_examples
from evals.perplexity import score_sequences
from inference.sampling import load_model
from model import GPTConfig

if TYPE_CHECKING:  # eval.py's schema, for annotations
    from eval import EvalConfig


def run_eval(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    """eval.py's JSON record; every file is found, and every value checked, before the first forward pass."""
    runtime = make_runtime(cfg.device, cfg.dtype)
    loaded = load_model(cfg.out_dir, cfg.init_from, cfg.ckpt, cfg.attn_impl)
    model, tokenizer = loaded.model.to(runtime.device).eval(), loaded.tokenizer
    block_size = model.config.block_size
    context = block_size if cfg.context is None else cfg.context
    if context > block_size:
        raise ConfigError(f"context={context} exceeds the model's block_size={block_size}; use at most that")
    stride = max(1, context // 2) if cfg.stride is None else cfg.stride
    if stride > context:
        held = "context" if cfg.context is not None else "the model's block_size"
        raise ConfigError(f"stride={stride} must be in [1, {context}]: at most the tokens a window holds ({held})")
    examples = None
    if cfg.hellaswag:  # before scoring the text, and before any download: a mistake fails at once
        if isinstance(tokenizer, CharTokenizer):  # its figures are for GPT-2's tokens, and its prose has any character
            raise DataError("HellaSwag needs a BPE model (GPT-2's tokens); this model's tokenizer reads characters")
        examples = load_examples(hellaswag_path(cfg.hellaswag_file, "hellaswag_file"), tokenizer)
    record: dict[str, Any] = {}
    source = None  # init_from with hellaswag=true alone: no text to score
    if cfg.input is not None:
        if not Path(cfg.input).is_file():
            raise DataError(f"input={cfg.input} is not a file; name a UTF-8 text file")
        source, sequences = cfg.input, [np.asarray(tokenizer.encode(read_utf8(Path(cfg.input))), dtype=np.int64)]
        if len(sequences[0]) < 2:
            raise DataError(f"input={cfg.input} has {len(sequences[0])} token(s): at least 2 are needed to score one")
    elif loaded.checkpoint is not None:  # the val split the run was trained beside, found by its saved data.* keys
        saved, known = loaded.checkpoint.config.get("data"), {f.name for f in dataclasses.fields(DataConfig)}
        if not isinstance(saved, dict):
            raise DataError(f"the checkpoint in {cfg.out_dir} holds no data config to find its val split; pass "
                            "input=FILE")
        data_cfg = DataConfig(**{k: v for k, v in saved.items() if k in known})
        try:
            data = ensure_prepared(data_cfg, prepare=False)  # read, never made: a moved or changed source is an error
        except DataError:
            raise DataError(f"no val split of {cfg.out_dir} in {dataset_dir(data_cfg.name, data_cfg.dir)} (train.py "
                            "prepares it there from the run's data.* keys; gone, or its source changed since): pass "
                            "input=FILE") from None
        if data.meta["tokenizer"] != loaded.checkpoint.tokenizer:
            raise DataError(f"the val split in {data.dir} was tokenized unlike {cfg.out_dir}'s model; pass input=FILE")
        source, sequences = f"{data.dir} (val split)", [data.val.open(i) for i in range(len(data.val.paths))]
    if source is not None:
        batch_size = cfg.batch_size or max(1, 4096 // context)  # a big batch keeps small models' matmuls efficient
        batch_size = _fitting_batch(batch_size, model.config, context, runtime.device)
        byte_lengths = torch.from_numpy(tokenizer.token_byte_lengths()).to(runtime.device, torch.float64)
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
