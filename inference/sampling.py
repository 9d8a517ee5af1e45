"""Load a run's checkpoint and generate text from a prompt."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from common.errors import ConfigError
from common.runtime import Runtime, check_memory, make_runtime
from data.errors import DataError
from data.source import read_utf8, why_not_a_file
from data.tokenizers import Tokenizer
from inference.load import load_model
from inference.sample_text import InOrder, SampleText
from inference.schema import SampleConfig
from model import GPT
from model.decoding import Decoding, row_generators


def read_prompt(start: str) -> str:
    """The prompt itself, or the contents of a file given as FILE:path."""
    if not start.startswith("FILE:"):
        return start
    path = Path(os.path.expanduser(start.removeprefix("FILE:")))
    if not path.is_file():
        raise DataError(f"start=FILE:{path} {why_not_a_file(path)}; name a text file")
    return read_utf8(path)


@dataclass
class Sample:
    ids: list[int]  # the prompt's tokens and those generated, up to the one that completed a stop string
    text: str  # the prompt and the generated text, which ends before the stop string


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
        decoding: Decoding,
        *,
        use_cache: bool = True,
        stop: Sequence[str] = (),
        stream: TextIO | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """num_samples continuations of the prompt, drawn side by side as one batch; each ends at its first stop
        string, and generation ends once all have. With `stream`, they are written there as they grow, in order
        (InOrder), each followed by SEPARATOR. With `seed`, sample i draws from its own generator seeded with
        seed + i (row_generators), as a served request's choice i does; without, from torch's global one."""
        config = self.model.config  # before allocating: every sample has its KV cache and its logits
        per_sample = 8 * config.n_layer * config.block_size * config.n_embd + 16 * config.vocab_size
        check_memory(num_samples * per_sample, self.runtime.device, f"num_samples={num_samples}", "lower num_samples")
        prompt_text = self.tokenizer.decode(prompt)
        texts = [SampleText(self.tokenizer, prompt_text, stop) for _ in range(num_samples)]
        writer = InOrder(stream, texts) if stream is not None else None
        if writer is not None:
            writer.write()  # the prompt, before the first step
        idx = torch.tensor([prompt] * num_samples, dtype=torch.long, device=self.runtime.device)
        generated: list[list[int]] = [[] for _ in texts]  # each sample's tokens, up to the one that ends it
        generators = row_generators(seed, num_samples, self.runtime.device)
        steps = self.model.generate_tokens(idx, max_new_tokens, decoding, use_cache, generators)
        try:
            with self.runtime.autocast():
                for step in steps:
                    for text, ids, token in zip(texts, generated, step[:, 0].tolist(), strict=True):
                        if not text.finished:
                            ids.append(token)
                            text.add(token)
                    if writer is not None:
                        writer.write()
                    if all(text.finished for text in texts):
                        break
        finally:
            steps.close()
        for text in texts:
            text.finish()
        if writer is not None:
            writer.write()
        return [Sample(prompt + ids, text.text) for ids, text in zip(generated, texts, strict=True)]

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
