"""The `data.*` keys; a dataset folder (token files, meta.json last) prepared once and reused; its training windows."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import check_fields, option
from common.errors import ConfigError, DataError, DiskFull
from common.files import check_regular_file, make_directory, why_not_a_file, write_text_atomically
from data import corpus
from data.corpus import map_shard, read_shard
from data.source import TextFile, download
from data.text_tokens import make_tokenizer, write_dataset
from data.tokenizers import metadata_problem

log = logging.getLogger(__name__)
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# The sha256 of the text at a known URL: a local copy of it (data.input) counts as the same text
KNOWN_TEXTS = {SHAKESPEARE_URL: "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"}


@dataclass
class DataConfig:
    name: str = "shakespeare_char"  # folder under data/cache unless data.dir is set
    tokenizer: str = "char"  # char, or a tiktoken encoding (r50k_base is GPT-2's BPE); a corpus needs a BPE
    input: str | None = option(None, path=True)  # a UTF-8 text file, not the download, or a dir of .txt/.jsonl docs
    url: str | None = SHAKESPEARE_URL  # the text downloaded when there is no data.input
    dir: str | None = option(None, path=True)  # where the token files and meta.json live
    val_fraction: float = option(0.1, above=0.0, below=1.0)  # a text's last part kept for val
    hf_dataset: str | None = None  # a Hugging Face dataset to stream, e.g. HuggingFaceFW/fineweb-edu (pip ".[hf]")
    hf_name: str | None = None  # its configuration, e.g. sample-10BT
    # tokens per shard file of a corpus (llm.c: 100M)
    shard_tokens: int = option(100_000_000, at_least=1, hint="it counts tokens per shard (100M in llm.c)")
    max_tokens: int | None = option(None, at_least=1, hint="null means the whole corpus")  # stop a corpus early
    # processes tokenizing a corpus; null: the CPUs available less one
    num_proc: int | None = option(None, at_least=1, hint="null means the CPUs available less one")

    def __post_init__(self) -> None:
        check_fields(self, "data.")
        if not self.dir and Path(self.name).name in ("", ".."):  # "", "." or "..": the cache itself, or above it
            raise ConfigError(f"data.name={self.name} names no folder of its own under data/cache; give the dataset a "
                              "name (data.name=mytext) or a folder (data.dir=DIR)")
        if self.hf_name and not self.hf_dataset:
            raise ConfigError(f"data.hf_name={self.hf_name} needs data.hf_dataset (say HuggingFaceFW/fineweb-edu)")
        if self.hf_dataset and self.input:
            raise ConfigError(f"data.input and data.hf_dataset={self.hf_dataset} are both set; keep one")


@dataclass
class PrepareConfig:  # `python -m data.prepare`'s: the data group alone
    data: DataConfig = field(default_factory=DataConfig)


DEFAULT_CACHE = Path(__file__).resolve().parent / "cache"
# The token files PreparedData.split reads, which a new preparation replaces
_TOKEN_FILES = ("train.bin", "val.bin", "train_[0-9]*.bin", "val_[0-9]*.bin")


@dataclass(frozen=True)
class TokenFiles:
    """A split's token files (raw uint16, or headed shards); opened per call, as a held memmap keeps pages resident."""

    paths: tuple[Path, ...]
    sharded: bool = False

    def open(self, index: int) -> np.ndarray:
        if self.sharded:  # its header was checked once, by lengths
            return map_shard(self.paths[index], self.lengths[index])
        return np.memmap(self.paths[index], dtype=np.uint16, mode="r")

    @cached_property  # read once: get_batch needs them on every call, and opening 100 shards costs milliseconds
    def lengths(self) -> tuple[int, ...]:
        if self.sharded:
            return tuple(len(read_shard(path)) for path in self.paths)
        return tuple(path.stat().st_size // 2 for path in self.paths)  # uint16 tokens; an empty file is 0


TRAIN_WINDOWS, EVAL_WINDOWS = 0, 1  # batch_generator's second key: what the windows are for


def batch_generator(*keys: int) -> torch.Generator:
    """A generator of (seed, purpose, step, ...) alone: a resumed run sees the windows the uninterrupted one would."""
    seed = int(np.random.SeedSequence(keys).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def get_batch(files: TokenFiles, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of shape (batch_size, block_size), y shifted by one; windows uniform over the files, none across two."""
    valid = np.maximum(np.asarray(files.lengths) - block_size, 0)  # starts in each file
    ends = np.cumsum(valid)
    starts = torch.randint(int(ends[-1]), (batch_size,), generator=generator).numpy()
    file_of = np.searchsorted(ends, starts, side="right")
    starts -= (ends - valid)[file_of]  # within its file
    opened = {int(i): files.open(int(i)) for i in np.unique(file_of)}
    windows = [opened[int(f)][s : s + block_size + 1] for f, s in zip(file_of, starts, strict=True)]
    batch = torch.from_numpy(np.stack(windows).astype(np.int64))
    return batch[:, :-1], batch[:, 1:]


def every_window(files: TokenFiles, batch_size: int, block_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """All consecutive non-overlapping windows of each file, in order and in batches: a full-split loss."""
    for index in range(len(files.paths)):
        data = files.open(index)
        n_windows = (len(data) - 1) // block_size
        for first in range(0, n_windows, batch_size):
            count = min(batch_size, n_windows - first)
            tokens = torch.from_numpy(data[first * block_size : (first + count) * block_size + 1].astype(np.int64))
            yield tokens[:-1].view(count, block_size), tokens[1:].view(count, block_size)


@dataclass(frozen=True)
class PreparedData:
    dir: Path
    meta: dict[str, Any]

    @cached_property  # one listing and one read of the lengths per run, not per batch
    def train(self) -> TokenFiles:
        return self.split("train")

    @cached_property
    def val(self) -> TokenFiles:
        return self.split("val")

    def split(self, name: str) -> TokenFiles:  # name.bin from a text; shards name_000000.bin, ... from a corpus
        if self.meta.get("sharded"):
            return TokenFiles(tuple(sorted(self.dir.glob(f"{name}_[0-9]*.bin"))), sharded=True)
        return TokenFiles((self.dir / f"{name}.bin",))


def dataset_dir(name: str, dir: str | None) -> Path:
    return Path(dir) if dir else DEFAULT_CACHE / name  # DataConfig expanded its ~ already


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            hasher.update(block)
    return hasher.hexdigest()


def ensure_prepared(config: DataConfig, *, prepare: bool = True) -> PreparedData:
    """The dataset folder's token files, prepared first if it holds none; prepare=False: only read (torchrun ranks)."""
    out_dir = dataset_dir(config.name, config.dir)
    if config.hf_dataset or (config.input and Path(config.input).is_dir()):
        fingerprint = corpus.fingerprint(config)
        make = functools.partial(corpus.prepare_corpus, config)
        return _reusable(out_dir, fingerprint) or _prepare_new(out_dir, fingerprint, {}, prepare, make)
    settings = {"tokenizer_spec": config.tokenizer, "val_fraction": config.val_fraction}
    at_hand = os.path.exists(config.input) if config.input else (out_dir / "input.txt").is_file()
    if not at_hand and (prepared := _prepared_before(out_dir, config, settings)):
        return prepared
    if config.input and not os.path.isfile(config.input):
        raise DataError(f"data.input={config.input} {why_not_a_file(Path(config.input))}; pass a UTF-8 text file or a "
                        "directory of .txt / .jsonl documents")
    source = {"input_sha256": file_sha256(Path(config.input))} if config.input else {"url": config.url}
    fingerprint = {"source": source, **settings}  # a changed data.input is never served stale tokens
    made_from = {"input": str(Path(config.input).absolute())} if config.input else {}  # said when refused or reused
    make = functools.partial(_prepare_text, config, out_dir)
    return _reusable(out_dir, fingerprint) or _prepare_new(out_dir, fingerprint, made_from, prepare, make)


def _prepare_text(config: DataConfig, out_dir: Path, into: Path) -> dict[str, Any]:
    """train.bin and val.bin in `into` of data.input, else of an earlier download, else of one saved there."""
    if config.input:
        path = Path(config.input)
    elif (out_dir / "input.txt").is_file():
        path = out_dir / "input.txt"
    elif config.url:
        path = download(config.url, into / "input.txt", "point at a local copy with data.input=/path/to/text.txt")
    else:
        raise DataError("no text to train on: pass data.input=/path/to/text.txt")
    text = TextFile.survey(path, chars=config.tokenizer == "char")
    if not text.length:
        raise DataError(f"the text for dataset {config.name!r} is empty; pass a non-empty file with data.input=PATH")
    return write_dataset(text, make_tokenizer(config.tokenizer, text.chars), into, config.val_fraction)


def _prepared_before(out_dir: Path, config: DataConfig, settings: dict[str, Any]) -> PreparedData | None:
    """The folder's dataset prepared from a file that is no longer at hand (data.input gone, or none given and nothing
    downloaded), so that offline runs, resumes and sweeps need not repeat data.input."""
    prepared = _reusable(out_dir, settings)
    source = prepared.meta.get("source") if prepared else None
    if not isinstance(source, dict) or "input_sha256" not in source:
        return None
    made_from = prepared.meta.get("input", "an earlier data.input")
    if config.input and made_from != str(Path(config.input).absolute()):
        return None
    if config.input:
        log.warning(f"data.input={config.input} is gone; using the data prepared from it in {out_dir}")
    elif source["input_sha256"] == KNOWN_TEXTS.get(config.url):
        log.info(f"data: using {out_dir}, prepared from {made_from}, a copy of {config.url}")
    else:
        log.warning(f"data: {out_dir} holds the text of {made_from}, not {config.url}; training on it (data.input=FILE "
                    "prepares another text; another data.name keeps both)")
    return prepared


def _prepare_new(out_dir: Path, fingerprint: dict[str, Any], made_from: dict[str, str], prepare: bool,
                 make: Callable[[Path], dict[str, Any]]) -> PreparedData:
    """A dataset written by `make` (which returns its tokenizer's metadata and its counts) in a new folder beside
    out_dir, meta.json last, then moved in."""
    _refuse_other(out_dir, fingerprint, made_from)
    if not prepare:  # a torchrun rank other than 0 only reads what rank 0 prepared
        raise DataError(f"no prepared dataset in {out_dir} matches data.*, though rank 0 prepared it: put data.dir on "
                        "a filesystem every node shares, or run python -m data.prepare on each node first")
    into = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # this preparation's own
    try:
        make_directory(into, f"data.dir={out_dir}")
        meta = {**make(into), **fingerprint, **made_from}
        write_text_atomically(into / "meta.json", json.dumps(meta, ensure_ascii=False))  # last: now the folder counts
        return _move_in(into, out_dir, meta, fingerprint, made_from)
    except DiskFull:  # named by the temporary folder
        raise DiskFull(f"data.dir={out_dir} not prepared: the disk holding it is full; free space, or name a data.dir "
                       "on another disk") from None
    finally:
        shutil.rmtree(into, ignore_errors=True)  # after an error or Ctrl-C too; only a killed process leaves it


def _move_in(into: Path, out_dir: Path, meta: dict[str, Any], fingerprint: dict[str, Any],
             made_from: dict[str, str]) -> PreparedData:
    """The new folder becomes out_dir; where out_dir exists, the files of another process that prepared the same
    meanwhile are used, and otherwise the stale files go and the new ones move in, meta.json last."""
    try:
        into.rename(out_dir)
        return PreparedData(out_dir, meta)
    except OSError:
        if not out_dir.is_dir():
            raise
    if theirs := _reusable(out_dir, fingerprint):
        return theirs
    _refuse_other(out_dir, fingerprint, made_from)  # prepared with other settings meanwhile
    for pattern in ("meta.json", *_TOKEN_FILES):  # meta.json first: damaged, or of damaged token files
        for stale in out_dir.glob(pattern):
            stale.unlink()
    for path in sorted(into.iterdir(), key=lambda path: path.name == "meta.json"):
        shutil.move(path, out_dir / path.name)  # a rename, or a copy where out_dir is on another disk
    return PreparedData(out_dir, meta)


def _refuse_other(out_dir: Path, fingerprint: dict[str, Any], made_from: dict[str, str]) -> None:
    """Refuse a folder prepared from another source or with other settings (a run may be reading it), a meta.json
    this project didn't write, and token files without a meta.json (another tool's, such as nanoGPT's)."""
    theirs = sorted(path.name for pattern in _TOKEN_FILES for path in out_dir.glob(pattern))
    if theirs and not (out_dir / "meta.json").exists():
        raise DataError(f"data.dir={out_dir} holds token files without the meta.json this project writes beside them "
                        f"({', '.join(theirs[:3])}); preparing would replace them: name another data.dir, or delete "
                        "them to prepare it there")
    meta = _read_meta(out_dir)
    if meta is None:
        return
    if not isinstance(meta, dict) or not {"source", "tokenizer_spec"} <= meta.keys():
        raise DataError(f"data.dir={out_dir} holds a meta.json this project didn't write; preparing would replace it "
                        "and the token files beside it: name another data.dir")
    if any(meta.get(key) != value for key, value in fingerprint.items()):
        raise DataError(f"the data folder {out_dir} was prepared from {_described(meta)}, not "
                        f"{_described({**fingerprint, **made_from})} as asked: name another folder for these settings "
                        f"(data.name=NAME or data.dir=DIR), or delete {out_dir} to prepare it again")


def _described(meta: dict[str, Any]) -> str:
    """A preparation's source and settings, in words: "FILE (sha256 ...) with tokenizer=char, val_fraction=0.1"."""
    source = meta["source"] if isinstance(meta.get("source"), dict) else {}
    if "input_sha256" in source:
        what = f"{meta.get('input', 'a file')} (sha256 {source['input_sha256'][:12]})"
    elif "files_sha256" in source:
        what = f"a directory of {source.get('files')} files (sha256 {source['files_sha256'][:12]})"
    elif "hf_dataset" in source:
        what = f"data.hf_dataset={source['hf_dataset']}" + (f" ({source['hf_name']})" if source.get("hf_name") else "")
    else:
        what = str(source.get("url"))
    keys = ("tokenizer_spec", "val_fraction", "shard_tokens", "max_tokens")
    return f"{what} with " + ", ".join(f"{key.removesuffix('_spec')}={meta[key]}" for key in keys if key in meta)


def _reusable(out_dir: Path, fingerprint: dict[str, Any]) -> PreparedData | None:
    """The folder's dataset if its meta.json (written last: the record of what was prepared) matches and is intact."""
    meta = _read_meta(out_dir)
    if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in fingerprint.items()):
        return None
    size = meta.get("vocab_size")  # a damaged tokenizer or vocabulary size is prepared again, as a damaged meta.json
    intact = not metadata_problem(meta.get("tokenizer")) and isinstance(size, int) and 1 <= size <= 2**16
    return PreparedData(out_dir, meta) if intact else None


def _read_meta(out_dir: Path) -> Any:
    """The folder's meta.json as parsed, or None where there is none or it is damaged."""
    check_regular_file(out_dir / "meta.json")
    try:
        return json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None


PREPARE_USAGE = """Tokenize a text or a corpus into data/cache/NAME (train.py does it when needed). Settings: key=value.

  data=NAME               {presets}
  data.input=FILE|DIR     your own UTF-8 text, or a directory of .txt / .jsonl documents
  data.tokenizer=NAME     char, or a tiktoken encoding such as r50k_base (GPT-2's)

Example: python -m data.prepare data.input=my_text.txt data.name=mine"""


def main() -> None:
    """`python -m data.prepare`: a text or a corpus tokenized into its dataset folder."""
    from hydra.core.config_store import ConfigStore

    from common.config import presets, run_hydra, typed_config

    def prepare(cfg: Any) -> None:
        data = ensure_prepared(typed_config(cfg, PrepareConfig).data)
        m = data.meta
        shards = f" in {m['train_shards'] + m['val_shards']} shards" if m.get("sharded") else ""
        print(f"{data.dir}: {m['train_tokens']:,} train and {m['val_tokens']:,} val tokens{shards}, "
              f"vocabulary {m['vocab_size']}")

    ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)
    usage = PREPARE_USAGE.format(presets=", ".join(presets("data")))
    run_hydra(prepare, "prepare", PrepareConfig, ("data",), lambda: usage)


if __name__ == "__main__":  # through the module as imported, not this __main__ copy of it (one PrepareConfig)
    import data.prepare

    data.prepare.main()
