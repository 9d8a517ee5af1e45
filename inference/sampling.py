"""Load a model (a run's or OpenAI's GPT-2); draw a prompt's samples as text that grows until a stop string; and
ModelChoice, the keys of sample.py's, eval.py's and serve.py's typed configs that pick the model."""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from common.config import check_fields, option
from common.errors import CheckpointError, ConfigError, DataError
from common.files import BEST_NAME, CKPT_NAME, why_not_a_file
from common.runtime import DEVICES, DTYPES, Runtime, check_memory
from data.source import read_utf8
from data.tokenizers import BpeTokenizer, CharTokenizer, Tokenizer, tokenizer_from_metadata
from model import GPT
from model.checkpoint import Checkpoint, load_checkpoint
from model.gpt import ATTN_IMPLS, Decoding, row_generators
from model.hf_gpt2 import load_pretrained

GPT2_ENCODING = "r50k_base"  # tiktoken's name for GPT-2's BPE
SEPARATOR = "\n---------------\n"  # after each sample, as nanoGPT's sample.py prints them
ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
MAX_NEW_TOKENS = 1_000_000  # sample.py's bound: hours on a CPU, past any real use


@dataclass
class LoadedModel:
    model: GPT  # on the CPU, in training mode as built
    tokenizer: Tokenizer
    checkpoint: Checkpoint | None  # None for init_from: no run, no data config


def load_model(out_dir: str | None, init_from: str | None, ckpt: str, attn_impl: str | None) -> LoadedModel:
    """init_from's GPT-2 with GPT-2's BPE, or out_dir's ckpt.pt (best.pt: ckpt=best) with the run's tokenizer."""
    if init_from is not None:
        model = load_pretrained(init_from, attn_impl=attn_impl or "flash")
        return LoadedModel(model, BpeTokenizer.from_name(GPT2_ENCODING), None)
    path = Path(out_dir) / (BEST_NAME if ckpt == "best" else CKPT_NAME)
    if ckpt == "best" and not path.exists() and path.with_name(CKPT_NAME).is_file():  # a FIFO: load_checkpoint's
        raise CheckpointError(f"no {BEST_NAME} in {out_dir}: train with train.keep_best=true, or use ckpt=latest")
    checkpoint = load_checkpoint(path, attn_impl=attn_impl)
    tokenizer = tokenizer_from_metadata(checkpoint.tokenizer_for_decoding(path), path)
    size, tokens, chars = tokenizer.vocab_size, checkpoint.model_config.vocab_size, isinstance(tokenizer, CharTokenizer)
    if size > tokens or chars and size < tokens:  # an id past the model's table; characters it can't have learnt
        raise CheckpointError(f"{path} holds damaged tokenizer metadata ({size} {'characters' if chars else 'tokens'} "
                              f"for a model of {tokens} tokens); use a file train.py wrote")
    return LoadedModel(checkpoint.build_model(), tokenizer, checkpoint)


def read_prompt(start: str) -> str:
    """The contents of the file start=FILE:path names."""
    path = Path(os.path.expanduser(start.removeprefix("FILE:")))
    if not path.is_file():
        raise DataError(f"start=FILE:{path} {why_not_a_file(path)}; name a text file")
    return read_utf8(path)


def stop_strings(stop: Sequence[str] | None, tokenizer: Tokenizer) -> list[str]:
    r"""The stop strings, \n, \t and \\ read as typed on the command line, and the tokenizer's end of text."""
    if stop is not None and not stop:
        return []
    unescaped = [re.sub(r"\\([nt\\])", lambda m: ESCAPES[m.group(1)], s) for s in stop or ()]
    end = tokenizer.end_of_text
    return unescaped + ([end] if end and end not in unescaped else [])


class SampleText:
    """Prompt, then generated text to the first stop string; decoded incrementally: a token may end mid-character."""

    def __init__(self, tokenizer: Tokenizer, prompt: str, stop: Sequence[str] = ()) -> None:
        self._token_bytes = tokenizer.token_bytes
        self._stop = list(stop)
        self._longest = max(map(len, self._stop), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._start = len(prompt)  # stop strings are looked for in the generated text only
        self._shown = 0
        self.text = prompt
        self.tokens: list[int] = []  # those generated, up to the one that completed a stop string
        self.stopped = False  # a stop string appeared
        self.finished = False  # stopped, or no more tokens will come

    def add(self, token: int) -> None:
        if self.finished:  # none are taken once the sample is finished
            return
        self.tokens.append(token)
        searched = max(self._start, len(self.text) - self._longest + 1)  # a stop string may end in the new text
        self.text += self._decoder.decode(self._token_bytes(token))
        found = [(i + len(s), i) for s, i in ((s, self.text.find(s, searched)) for s in self._stop) if i >= 0]
        if found:  # the stop string completed first, as if the text had come a character at a time
            self.text = self.text[: min(found)[1]]
            self.stopped = self.finished = True

    def finish(self) -> None:
        self.finished = True

    def unshown(self) -> str:
        """Unsent text no later token can change: all once finished, else all but a possible stop string's start."""
        end = len(self.text)
        if not self.finished:  # held back: the longest tail of the generated text that starts a stop string
            for n in range(min(self._longest - 1, end - self._start), 0, -1):
                if any(s.startswith(self.text[-n:]) for s in self._stop):
                    end -= n
                    break
        piece = self.text[self._shown : end]
        self._shown = end
        return piece


class InOrder:
    """Writes samples that grow side by side one after another: each once the one before ends, then as it grows."""

    def __init__(self, out: TextIO, samples: Sequence[SampleText]) -> None:
        self.out = out
        self.samples = samples
        self.current = 0
        self.write()

    def write(self) -> None:
        while self.current < len(self.samples):
            sample = self.samples[self.current]
            self.out.write(sample.unshown())
            if not sample.finished:
                break
            self.out.write(SEPARATOR)
            self.current += 1
        self.out.flush()


@dataclass
class Sample:
    ids: list[int]  # the prompt's tokens and those generated, up to the one that completed a stop string
    text: str  # the prompt and the generated text, which ends before the stop string


@dataclass
class Sampler:
    """generate() draws num_samples continuations side by side, as one batch, each ending at a stop string; with
    `stream` written as they grow; with `seed`, sample i from its own generator seeded seed + i."""

    model: GPT
    tokenizer: Tokenizer
    runtime: Runtime

    def encode_prompt(self, start: str) -> list[int]:
        ids = self.tokenizer.encode(read_prompt(start) if start.startswith("FILE:") else start)
        if not ids:
            raise ConfigError('start is empty; give a prompt such as start="ROMEO:"')
        if len(ids) > self.model.config.block_size and not self.model.config.rolls:
            warn(f"the prompt has {len(ids)} tokens; the model sees only its last {self.model.config.block_size}")
        return ids

    def generate(self, prompt: list[int], num_samples: int, max_new_tokens: int, decoding: Decoding, *,
                 use_cache: bool = True, stop: Sequence[str] = (), stream: TextIO | None = None,
                 seed: int | None = None) -> list[Sample]:
        config = self.model.config  # checked before allocating: every sample has its KV cache and its logits
        per_sample = 8 * config.n_layer * config.block_size * config.n_embd + 16 * config.vocab_size
        check_memory(num_samples * per_sample, self.runtime.device, f"num_samples={num_samples}", "lower num_samples")
        prompt_text = self.tokenizer.decode(prompt)  # once, for every sample
        texts = [SampleText(self.tokenizer, prompt_text, stop) for _ in range(num_samples)]
        show = InOrder(stream, texts).write if stream is not None else lambda: None
        idx = torch.tensor([prompt] * num_samples, device=self.runtime.device)
        generators = row_generators(seed, num_samples, self.runtime.device)
        steps = self.model.generate_tokens(idx, max_new_tokens, decoding, use_cache, generators)
        with self.runtime.autocast(), contextlib.closing(steps):
            for step in steps:
                for text, token in zip(texts, step[:, 0].tolist(), strict=True):
                    text.add(token)
                show()
                if all(text.finished for text in texts):
                    break
        for text in texts:
            text.finish()
        show()
        return [Sample(prompt + text.tokens, text.text) for text in texts]

    def last_window(self, ids: list[int], purpose: str, span: int | None = None) -> list[int]:
        """The last `span` tokens; by default block_size, all the model can look at in one pass."""
        span = span or self.model.config.block_size
        if len(ids) > span:
            why = " (block_size)" if span == self.model.config.block_size else ""
            warn(f"{purpose}: the sequence has {len(ids)} tokens; using its last {span}{why}")
        return ids[-span:]


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


@dataclass
class ModelChoice:
    """The keys that pick the model sample.py, eval.py and serve.py run, and how it runs."""

    out_dir: str | None = option(None, path=True)  # a train.py run directory holding ckpt.pt (or init_from)
    init_from: str | None = option(None, path=True)  # instead of out_dir: gpt2[-medium|-large|-xl] or a HF GPT-2 dir
    ckpt: str = option("latest", choices=("latest", "best"))  # the run's ckpt.pt, or its best.pt (train.keep_best)
    device: str = option("auto", choices=DEVICES)  # auto: cuda, else mps, else cpu
    dtype: str = option("auto", choices=DTYPES)  # auto: bfloat16 on CUDA GPUs that have it, else float32
    attn_impl: str | None = option(None, choices=ATTN_IMPLS)  # default: the checkpoint's

    def __post_init__(self) -> None:
        check_fields(self)
        if self.out_dir is None and self.init_from is None:
            raise ConfigError("out_dir is required: pass out_dir=RUN, a directory train.py wrote (or init_from=gpt2)")
