"""The `data.*` keys; a dataset folder (token files, meta.json last) prepared once and reused; its training windows."""

from __future__ import annotations

import errno
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
from common.runtime import check_regular_file, make_directory, replace_file, why_not_a_file
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
    url: str | None = SHAKESPEARE_URL
    dir: str | None = option(None, path=True)  # where the token files and meta.json live
    val_fraction: float = option(0.1, above=0.0, below=1.0)  # a text's last part kept for val
    hf_dataset: str | None = None  # a Hugging Face dataset to stream, e.g. HuggingFaceFW/fineweb-edu (pip ".[hf]")
    hf_name: str | None = None  # its configuration, e.g. sample-10BT
    shard_tokens: int = option(100_000_000, at_least=1, hint="it counts tokens per shard (100M in llm.c)")
    max_tokens: int | None = option(None, at_least=1, hint="null means the whole corpus")  # stop a corpus early
    num_proc: int | None = option(None, at_least=1, hint="null means the CPUs available less one")

    def __post_init__(self) -> None:
        check_fields(self, "data.")
        if self.hf_name and not self.hf_dataset:
            raise ConfigError(f"data.hf_name={self.hf_name} needs data.hf_dataset (say HuggingFaceFW/fineweb-edu)")
        if self.hf_dataset and self.input:
            raise ConfigError(f"data.input and data.hf_dataset={self.hf_dataset} are both set; keep one")


@dataclass
class PrepareConfig:  # `python -m data.prepare`'s: the data group alone
    data: DataConfig = field(default_factory=DataConfig)


DEFAULT_CACHE = Path(__file__).resolve().parent / "cache"
# The token files PreparedData.split reads: an unfinished preparation's go before another's move in
_TOKEN_FILES = ("train.bin", "val.bin", "train_[0-9]*.bin", "val_[0-9]*.bin")
Make = Callable[[Path], dict[str, Any]]  # writes a dataset into the folder given; its meta


@dataclass(frozen=True)
class TokenFiles:
    """A split's token files (raw uint16, or headed shards); opened per call, as a held memmap keeps pages resident."""

    paths: tuple[Path, ...]
    sharded: bool = False

    def open(self, index: int) -> np.ndarray:
        path = self.paths[index]
        if self.sharded:  # its header was checked once, by lengths
            return map_shard(path, self.lengths[index])
        return np.memmap(path, dtype=np.uint16, mode="r")

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        """Read once: get_batch needs them on every call, and opening 100 shards costs milliseconds."""
        if self.sharded:
            return tuple(len(read_shard(path)) for path in self.paths)
        return tuple(path.stat().st_size // 2 for path in self.paths)  # uint16 tokens; an empty file is 0


TRAIN_WINDOWS, EVAL_WINDOWS = 0, 1  # batch_generator's second key: what the windows are for


def batch_generator(*keys: int) -> torch.Generator:
    """A generator of (seed, purpose, step, ...) alone: a resumed run sees the windows the uninterrupted one would."""
    seed = int(np.random.SeedSequence(keys).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def get_batch(
    files: TokenFiles, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of shape (batch_size, block_size), y shifted by one; windows uniform over the files, none across two."""
    valid = np.maximum(np.asarray(files.lengths) - block_size, 0)  # starts in each file
    ends = np.cumsum(valid)
    starts = torch.randint(int(ends[-1]), (batch_size,), generator=generator).numpy()
    file_of = np.searchsorted(ends, starts, side="right")
    opened = {int(i): files.open(int(i)) for i in np.unique(file_of)}
    windows = [
        opened[int(f)][s - (ends[f] - valid[f]) :][: block_size + 1] for f, s in zip(file_of, starts, strict=True)
    ]
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

    def split(self, name: str) -> TokenFiles:
        """name.bin from a text, or the shards name_000000.bin, name_000001.bin, ... from a corpus."""
        if self.meta.get("sharded"):
            return TokenFiles(tuple(sorted(self.dir.glob(f"{name}_[0-9]*.bin"))), sharded=True)
        return TokenFiles((self.dir / f"{name}.bin",))


def dataset_dir(name: str, dir: str | None) -> Path:
    return Path(os.path.expanduser(dir)) if dir else DEFAULT_CACHE / name


def input_file(input_path: str) -> Path:
    path = Path(os.path.expanduser(input_path))
    if not path.is_file():
        raise DataError(
            f"data.input={input_path} {why_not_a_file(path)}; pass a UTF-8 text file or a directory of .txt / .jsonl "
            "documents"
        )
    return path


def text_file(input_path: str | None, cached_copy: Path, url: str | None) -> Path:
    """The file holding the text: data.input, else the cached copy, else the download saved as the cached copy."""
    if input_path:
        return input_file(input_path)
    if cached_copy.is_file():
        return cached_copy
    if not url:
        raise DataError("no text to train on: pass data.input=/path/to/text.txt")
    return download(url, cached_copy, "point at a local copy with data.input=/path/to/text.txt")


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            hasher.update(block)
    return hasher.hexdigest()


def source_fingerprint(input_path: str | None, url: str | None) -> dict[str, str | None]:
    """What the bins were made from, so a different data.input is never served stale tokens."""
    if input_path:
        return {"input_sha256": file_sha256(input_file(input_path))}
    return {"url": url}


def ensure_prepared(config: DataConfig, *, prepare: bool = True) -> PreparedData:
    """The dataset folder's token files, prepared first if it holds none; prepare=False: only read (torchrun ranks)."""
    out_dir = dataset_dir(config.name, config.dir)
    if config.hf_dataset or (config.input and Path(config.input).is_dir()):
        return _ensure_corpus(out_dir, config, prepare)
    settings = {"tokenizer_spec": config.tokenizer, "val_fraction": config.val_fraction}
    gone = config.input and not os.path.exists(config.input)  # DataConfig expanded its ~ already
    if gone or not (config.input or (out_dir / "input.txt").is_file()):
        prepared = _prepared_before(out_dir, config, settings)
        if prepared:
            return prepared
    fingerprint = {"source": source_fingerprint(config.input, config.url), **settings}
    made_from = {"input": str(Path(config.input).absolute())} if config.input else {}  # said when refused or reused
    make = functools.partial(_prepare_text, config, out_dir, {**fingerprint, **made_from})
    return _reusable(out_dir, fingerprint) or _prepare_new(out_dir, fingerprint, made_from, prepare, make)


def _prepare_text(config: DataConfig, out_dir: Path, meta: dict[str, Any], into: Path) -> dict[str, Any]:
    """train.bin and val.bin of the text (data.input, or the download) in the folder `into`; their meta."""
    cached = out_dir / "input.txt"  # an earlier download; a new one goes into the new folder
    path = text_file(config.input, cached if cached.is_file() else into / "input.txt", config.url)
    text = TextFile.survey(path, chars=config.tokenizer == "char")
    if not text.length:
        raise DataError(f"the text for dataset {config.name!r} is empty; pass a non-empty file with data.input=PATH")
    tokenizer = make_tokenizer(config.tokenizer, text.chars)
    return write_dataset(text, tokenizer, into, config.val_fraction, meta)


def _prepared_before(out_dir: Path, config: DataConfig, settings: dict[str, Any]) -> PreparedData | None:
    """The folder's dataset from a text no longer at hand: data.input gone and prepared from that path, or none given
    and nothing downloaded (offline runs, resumes and sweeps need not repeat data.input)."""
    meta = _read_meta(out_dir)
    source = meta.get("source") if isinstance(meta, dict) else None
    if not isinstance(source, dict) or "input_sha256" not in source:
        return None
    if config.input and meta.get("input") != str(Path(config.input).absolute()):
        return None
    prepared = _reusable(out_dir, {**settings, "source": source})
    if prepared is None:
        return None
    made_from = meta.get("input", "an earlier data.input")
    if config.input:
        log.warning(f"data.input={config.input} is gone; using the data prepared from it in {out_dir}")
    elif source["input_sha256"] == KNOWN_TEXTS.get(config.url):
        log.info(f"data: using {out_dir}, prepared from {made_from}, a copy of {config.url}")
    else:
        log.warning(
            f"data: {out_dir} holds the text of {made_from}, not {config.url}; training on it (data.input=FILE "
            "prepares another text; another data.name keeps both)"
        )
    return prepared


def _ensure_corpus(out_dir: Path, config: DataConfig, prepare: bool) -> PreparedData:
    fingerprint = corpus.fingerprint(config)
    make = functools.partial(corpus.prepare_corpus, config, fingerprint)
    return _reusable(out_dir, fingerprint) or _prepare_new(out_dir, fingerprint, {}, prepare, make)


def _prepare_new(
    out_dir: Path, fingerprint: dict[str, Any], made_from: dict[str, str], prepare: bool, make: Make
) -> PreparedData:
    """A dataset made by `make` in a new folder beside out_dir and moved in (out_dir holds none of these settings)."""
    _refuse_other(out_dir, fingerprint, made_from)
    if not prepare:  # a torchrun rank other than 0 only reads what rank 0 prepared
        raise DataError(
            f"no prepared dataset in {out_dir} matches data.*, though rank 0 prepared it: put data.dir on a "
            "filesystem every node shares, or run python -m data.prepare on each node first"
        )
    into = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # this preparation's own
    try:
        make_directory(into, f"data.dir={out_dir}")
        return _move_in(into, out_dir, make(into), fingerprint, made_from)
    except DiskFull:  # named by the temporary folder
        raise DiskFull(f"data.dir={out_dir} not prepared: the disk holding it is full; free space, or name a data.dir "
                       "on another disk") from None
    finally:
        shutil.rmtree(into, ignore_errors=True)  # after an error or Ctrl-C too; only a killed process leaves it


def _move_in(
    into: Path, out_dir: Path, meta: dict[str, Any], fingerprint: dict[str, Any], made_from: dict[str, str]
) -> PreparedData:
    """The new folder becomes out_dir, or, where out_dir is there, its files move in, meta.json last (an
    unfinished preparation's token files go first). Another process that prepared the same meanwhile: theirs."""
    try:
        into.rename(out_dir)
        return PreparedData(out_dir, meta)
    except OSError:
        if not out_dir.is_dir():
            raise
    theirs = _reusable(out_dir, fingerprint)
    if theirs:
        return theirs
    _refuse_other(out_dir, fingerprint, made_from)  # prepared with other settings meanwhile
    (out_dir / "meta.json").unlink(missing_ok=True)  # damaged, or of damaged token files: not complete now
    ours = {path.name for path in into.iterdir()}
    for pattern in _TOKEN_FILES:
        for stale in out_dir.glob(pattern):
            if stale.name not in ours:
                stale.unlink()
    for path in sorted(into.iterdir(), key=lambda path: path.name == "meta.json"):
        try:
            replace_file(path, out_dir / path.name)
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
            shutil.move(path, out_dir / path.name)  # out_dir on another disk (a mount, a link): copied
    return PreparedData(out_dir, meta)


def _refuse_other(out_dir: Path, fingerprint: dict[str, Any], made_from: dict[str, str]) -> None:
    """A folder prepared from another source or with other settings (a run may be reading it), or holding a
    meta.json this project didn't write (ours names its source and tokenizer spec), is never prepared again."""
    meta = _read_meta(out_dir)
    if meta is None:
        return
    if not isinstance(meta, dict) or not {"source", "tokenizer_spec"} <= meta.keys():
        raise DataError(
            f"data.dir={out_dir} holds a meta.json this project didn't write; preparing would replace it and the "
            "token files beside it: name another data.dir"
        )
    if any(meta.get(key) != value for key, value in fingerprint.items()):
        asked = _described({**fingerprint, **made_from})
        raise DataError(
            f"the data folder {out_dir} was prepared from {_described(meta)}, not {asked} as asked: name another "
            f"folder for these settings (data.name=NAME or data.dir=DIR), or delete {out_dir} to prepare it again"
        )


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
    """The folder's dataset if its meta.json, written last and the record of what was prepared, matches."""
    meta = _read_meta(out_dir)
    if isinstance(meta, dict) and all(meta.get(k) == v for k, v in fingerprint.items()) and _intact(meta):
        return PreparedData(out_dir, meta)
    return None


def _intact(meta: dict[str, Any]) -> bool:
    """Its tokenizer and vocabulary size usable (else damaged: prepared again, as an unreadable meta.json is)."""
    size = meta.get("vocab_size")
    return not metadata_problem(meta.get("tokenizer")) and isinstance(size, int) and 1 <= size <= 2**16


def _read_meta(out_dir: Path) -> Any:
    """The folder's meta.json as parsed, or None where there is none or it is damaged."""
    check_regular_file(out_dir / "meta.json")
    try:
        return json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None


if __name__ == "__main__":  # python -m data.prepare
    from data.prepare_command import main

    main()
