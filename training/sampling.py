"""Load a run's checkpoint and generate text from a prompt."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import ConfigError
from data.errors import DataError
from data.source import read_utf8
from data.tokenizers import Tokenizer
from model import GPT
from training.load import load_model
from training.runtime import Runtime, make_runtime
from training.schema import SampleConfig


def read_prompt(start: str) -> str:
    """The prompt itself, or the contents of a file given as FILE:path."""
    if not start.startswith("FILE:"):
        return start
    path = Path(start.removeprefix("FILE:")).expanduser()
    if path.is_dir():
        raise DataError(f"start=FILE:{path} is a directory; name a text file")
    if not path.is_file():
        raise DataError(f"start=FILE:{path}: no such file")
    return read_utf8(path)


@dataclass
class Sampler:
    model: GPT
    tokenizer: Tokenizer
    runtime: Runtime

    def encode_prompt(self, start: str) -> list[int]:
        ids = self.tokenizer.encode(read_prompt(start))
        if not ids:
            raise ConfigError('start is empty; give a prompt such as start="ROMEO:"')
        block_size = self.model.config.block_size
        if len(ids) > block_size and not self.model.config.rolls:
            warn(f"the prompt has {len(ids)} tokens; the model sees only its last {block_size} (block_size)")
        return ids

    def generate(
        self,
        prompt: list[int],
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        use_cache: bool,
        top_p: float | None = None,
        min_p: float | None = None,
    ) -> Iterator[list[int]]:
        idx = torch.tensor([prompt], dtype=torch.long, device=self.runtime.device)
        for _ in range(num_samples):
            with self.runtime.autocast():
                out = self.model.generate(
                    idx, max_new_tokens, temperature, top_k, use_cache=use_cache, top_p=top_p, min_p=min_p
                )
            yield out[0].tolist()

    def last_window(self, ids: list[int], purpose: str, span: int | None = None) -> list[int]:
        """The last `span` tokens; by default block_size, all the model can look at in one pass."""
        block_size = self.model.config.block_size
        span = block_size if span is None else span
        if len(ids) > span:
            why = " (block_size)" if span == block_size else ""
            warn(f"{purpose}: the sequence has {len(ids)} tokens; using its last {span}{why}")
        return ids[-span:]


def load_sampler(cfg: SampleConfig) -> Sampler:
    """The run's model (or init_from's GPT-2) and tokenizer, on the config's device, the random seed set."""
    runtime = make_runtime(cfg.device, cfg.dtype)
    loaded = load_model(cfg.out_dir, cfg.init_from, cfg.ckpt, cfg.attn_impl)
    torch.manual_seed(cfg.seed)
    return Sampler(loaded.model.to(runtime.device).eval(), loaded.tokenizer, runtime)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
