"""Load a model (a run's or OpenAI's GPT-2); draw a prompt's samples as text that grows until a stop string; and
the typed configs of sample.py, eval.py and serve.py (a bad key or value fails at start)."""

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
from hydra.core.config_store import ConfigStore

from common.config import SEED_MAX, check_fields, option
from common.errors import CheckpointError, ConfigError, DataError
from common.files import BEST_NAME, CKPT_NAME, why_not_a_file
from common.runtime import DEVICES, DTYPES, Runtime, check_memory
from data.source import read_utf8
from data.tokenizers import BpeTokenizer, CharTokenizer, Tokenizer, tokenizer_from_metadata
from model import GPT
from model.checkpoint import Checkpoint, load_checkpoint
from model.gpt import ATTN_IMPLS, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, Decoding, row_generators
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
    checkpoint = load_checkpoint(path)
    tokenizer = tokenizer_from_metadata(checkpoint.tokenizer_for_decoding(path), path)
    size, tokens, chars = tokenizer.vocab_size, checkpoint.model_config.vocab_size, isinstance(tokenizer, CharTokenizer)
    if size > tokens or chars and size < tokens:  # an id past the model's table; characters it can't have learnt
        raise CheckpointError(f"{path} holds damaged tokenizer metadata ({size} {'characters' if chars else 'tokens'} "
                              f"for a model of {tokens} tokens); use a file train.py wrote")
    return LoadedModel(checkpoint.build_model(attn_impl), tokenizer, checkpoint)


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
    device: str = option("auto", choices=DEVICES)
    dtype: str = option("auto", choices=DTYPES)
    attn_impl: str | None = option(None, choices=ATTN_IMPLS)  # default: the checkpoint's

    def __post_init__(self) -> None:
        check_fields(self)
        if self.out_dir is None and self.init_from is None:
            raise ConfigError("out_dir is required: pass out_dir=RUN, a directory train.py wrote (or init_from=gpt2)")


@dataclass
class SampleConfig(ModelChoice):
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = option(3, at_least=1)
    # bounded: 1e10 would run for days while its text filled memory
    max_new_tokens: int = option(500, at_least=1, at_most=MAX_NEW_TOKENS)
    temperature: float = option(DEFAULT_TEMPERATURE, at_least=0.0,
                                hint="0 means greedy decoding (the most likely token)")
    top_k: int | None = option(DEFAULT_TOP_K, at_least=1, hint="null means no cut-off")  # the k most likely tokens
    top_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")  # nucleus: mass p
    min_p: float | None = option(None, above=0.0, at_most=1.0, hint="null means no cut-off")  # p >= min_p * top
    seed: int = option(1337, at_least=0, at_most=SEED_MAX)
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
    batch_size: int | None = option(None, at_least=1, hint="null means 4096 // context windows")  # per forward pass
    hellaswag: bool = False  # also score HellaSwag's validation set (BPE models)
    hellaswag_file: str | None = option(None, path=True)  # local hellaswag_val.jsonl; null: in data/cache/hellaswag

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.out_dir is None and self.input is None and not self.hellaswag:
            raise ConfigError(f"init_from={self.init_from} has no val split to score: pass input=FILE (a text file) or "
                              "hellaswag=true")
        if self.hellaswag_file is not None and not self.hellaswag:
            raise ConfigError(f"hellaswag_file={self.hellaswag_file} is read only with hellaswag=true; add it")


@dataclass
class ServeConfig(ModelChoice):
    """serve.py's keys (configs/serve.yaml): where it listens, the model's device, and the limits of its work."""

    host: str = "127.0.0.1"  # loopback: only this machine; 0.0.0.0 listens on every interface
    port: int = option(8000, at_least=0, at_most=65535)  # 0: any free port (printed when ready)
    api_key: str | None = None  # every request then needs Authorization: Bearer KEY; null: $GPT_LAB_API_KEY, if set
    allow_no_api_key: bool = False  # else a host beyond loopback needs api_key: anyone reaching the port may use it
    model_id: str | None = None  # the id /v1/models lists and requests name; null: the run directory's name
    max_queue: int = option(64, at_least=0)  # requests under way besides one (taking turns); past it: 503, Retry-After
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
