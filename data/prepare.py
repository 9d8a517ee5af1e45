"""A dataset folder, prepared once and reused: train.bin / val.bin (uint16 token streams) from a text
(data.text_tokens), or shards from a corpus (data.corpus), and meta.json, which says what they were made from.

Runs on first use from train.py; on its own: `python -m data.prepare data=shakespeare`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from common.files import check_writable, discard_temporaries
from data import corpus
from data.batches import TokenFiles
from data.config import KNOWN_TEXTS, DataConfig
from data.errors import DataError
from data.folder_locks import PREPARE_LOCK, acquire, alone, locked, missing, take_back
from data.source import TextFile, file_sha256, input_file, text_file
from data.text_tokens import make_tokenizer, write_dataset
from data.tokenizers import tokenizer_from_metadata

log = logging.getLogger(__name__)
DEFAULT_CACHE = Path(__file__).resolve().parent / "cache"


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


def source_fingerprint(input_path: str | None, url: str | None) -> dict[str, str | None]:
    """What the bins were made from, so a different data.input is never served stale tokens."""
    if input_path:
        return {"input_sha256": file_sha256(input_file(input_path))}
    return {"url": url}


def ensure_prepared(config: DataConfig, *, prepare: bool = True) -> PreparedData:
    """Reuse the token files in the dataset folder if they were made from the same source and tokenizer.

    A text file (or the download) gives train.bin / val.bin; a directory of documents or a Hugging Face dataset
    gives shards. prepare=False (a torchrun rank other than 0) only reads what rank 0 prepared.
    """
    out_dir = dataset_dir(config.name, config.dir)
    if config.hf_dataset or (config.input and Path(os.path.expanduser(config.input)).is_dir()):
        return _ensure_corpus(out_dir, config, prepare)
    if config.input and not os.path.exists(config.input):  # DataConfig expanded its ~ already
        prepared = _prepared_from_a_gone_text(out_dir, config)
        if prepared:
            return prepared
    fingerprint = {
        "source": source_fingerprint(config.input, config.url),
        "tokenizer_spec": config.tokenizer,
        "val_fraction": config.val_fraction,
    }

    if not config.input and not (out_dir / "input.txt").is_file():
        prepared = _prepared_from_any_text(out_dir, fingerprint, config.url)
        if prepared:
            return prepared

    return _prepared_once(out_dir, fingerprint, prepare, lambda: _prepare_text(config, out_dir, fingerprint))


def _prepare_text(config: DataConfig, out_dir: Path, fingerprint: dict[str, Any]) -> PreparedData:
    path = text_file(config.input, out_dir / "input.txt", config.url)
    text = TextFile.survey(path, chars=config.tokenizer == "char")
    if not text.length:
        raise DataError(f"the text for dataset {config.name!r} is empty; pass a non-empty file with data.input=PATH")
    tokenizer = make_tokenizer(config.tokenizer, text.chars)
    made_from = {"input": str(path.absolute())} if config.input else {}  # for _prepared_from_any_text's line
    return PreparedData(
        out_dir, write_dataset(text, tokenizer, out_dir, config.val_fraction, {**fingerprint, **made_from})
    )


def _prepared_from_any_text(out_dir: Path, fingerprint: dict[str, Any], url: str | None) -> PreparedData | None:
    """With no data.input and nothing downloaded, a whole dataset prepared here from a file (data.input on an
    earlier command) is used rather than downloading: a run, its resume and a sweep work offline without repeating
    data.input. Its tokenizer and split must be the ones asked for (a folder made from another URL is not used).
    A copy of the URL's own text is said in passing; any other text with a warning, since it is not what the
    preset names."""
    source = (_read_meta(out_dir) or {}).get("source")  # first the cheap look: made from a file at all?
    if not isinstance(source, dict) or "input_sha256" not in source:
        return None
    prepared = _reusable(out_dir, {key: value for key, value in fingerprint.items() if key != "source"})
    if prepared is None:
        return None
    made_from = prepared.meta.get("input", "an earlier data.input")
    if source["input_sha256"] == KNOWN_TEXTS.get(url):
        log.info(f"data: using {out_dir}, prepared from {made_from}, a copy of {url}")
    else:
        log.warning(
            f"data: {out_dir} holds the text of {made_from}, not {url}; training on it (data.input=FILE prepares "
            "another text; another data.name keeps both)"
        )
    return prepared


def _prepared_from_a_gone_text(out_dir: Path, config: DataConfig) -> PreparedData | None:
    """data.input names a file that is gone (moved, or on a disk not mounted now), and this folder was prepared
    from that very path: its tokens stand for it (a resume restores data.input from the run's config)."""
    if (_read_meta(out_dir) or {}).get("input") != str(Path(config.input).absolute()):
        return None
    prepared = _reusable(out_dir, {"tokenizer_spec": config.tokenizer, "val_fraction": config.val_fraction})
    if prepared is None:
        return None
    log.warning(f"data.input={config.input} is gone; using the data prepared from it in {out_dir}")
    return prepared


def _ensure_corpus(out_dir: Path, config: DataConfig, prepare: bool) -> PreparedData:
    fingerprint = {
        "source": corpus.source_fingerprint(config.input, config.hf_dataset, config.hf_name),
        "tokenizer_spec": config.tokenizer,
        "shard_tokens": config.shard_tokens,
        "max_tokens": config.max_tokens,
    }

    def prepare_corpus() -> PreparedData:
        bpe = corpus.corpus_tokenizer(config.tokenizer)
        documents = (
            corpus.hf_documents(config.hf_dataset, config.hf_name)
            if config.hf_dataset
            else corpus.local_documents(Path(config.input))
        )
        procs = config.num_proc or corpus.default_num_proc()
        meta = corpus.write_corpus(documents, bpe, out_dir, config.shard_tokens, config.max_tokens, procs, fingerprint)
        return PreparedData(out_dir, meta)

    return _prepared_once(out_dir, fingerprint, prepare, prepare_corpus)


def _prepared_once(
    out_dir: Path, fingerprint: dict[str, Any], prepare: bool, make: Callable[[], PreparedData]
) -> PreparedData:
    """The folder's dataset, made by `make` unless it is already there."""
    return _reusable(out_dir, fingerprint) or _prepare_once(out_dir, fingerprint, prepare, make)


def _prepare_once(
    out_dir: Path, fingerprint: dict[str, Any], prepare: bool, make: Callable[[], PreparedData]
) -> PreparedData:
    """One process prepares a folder at a time (an OS file lock, released if it dies): another one on the same
    data waits, then reuses what it made. Holding the lock, what killed preparations left (their temporaries)
    goes."""
    _refuse_unless(prepare, out_dir)
    _refuse_foreign(out_dir)
    check_writable(out_dir, "data.dir")
    made = missing(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out_dir / PREPARE_LOCK)  # not the run's .lock: data.dir may be the run directory
    made = acquire(lock, out_dir) or made
    try:
        prepared = _reusable(out_dir, fingerprint)
        if prepared:
            return prepared
        for name in ("train.bin", "val.bin", "meta.json", "input.txt"):  # what temporary_beside names here
            discard_temporaries(out_dir / name)
        with alone(out_dir):
            return make()
    except BaseException:
        take_back(made, out_dir)
        raise
    finally:
        lock.release()


@contextlib.contextmanager
def in_use(data: PreparedData) -> Iterator[None]:
    """While a run reads `data`: its folder's .in_use held shared, so that no process prepares other tokens over
    them (_alone). meta.json is read again once held: a preparation that slipped in since is said. Unguarded where
    the folder is read-only (nobody replaces it there), the filesystem can't lock or the OS has no flock (Windows)."""
    with locked(data.dir, exclusive=False) as held:
        if held and _read_meta(data.dir) != json.loads(json.dumps(data.meta)):  # as meta.json holds it
            raise DataError(
                f"data.dir={data.dir} was prepared again with other settings as this run started; start it again"
            )
        yield


def _refuse_foreign(out_dir: Path) -> None:
    """A meta.json this project didn't write (another tool's, or the user's own) is never replaced, nor the token
    files beside it: ours always names its source and tokenizer spec."""
    path = out_dir / "meta.json"
    if not path.is_file():
        return
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):  # damaged (ours are written whole, but disks fail): prepared again
        return
    if not isinstance(meta, dict) or not {"source", "tokenizer_spec"} <= meta.keys():
        raise DataError(
            f"data.dir={out_dir} holds a meta.json this project didn't write; preparing would replace it and the "
            "token files beside it: name another data.dir"
        )


def _refuse_unless(prepare: bool, out_dir: Path) -> None:
    """prepare=False: a torchrun rank other than 0, which only reads what rank 0 prepared."""
    if not prepare:
        raise DataError(
            f"no prepared dataset in {out_dir} matches data.*, though rank 0 prepared it: put data.dir on a "
            "filesystem every node shares, or run python -m data.prepare on each node first"
        )


def _reusable(out_dir: Path, fingerprint: dict[str, Any]) -> PreparedData | None:
    """The folder's dataset if meta.json matches the fingerprint and its token files are all there and whole.

    A shard's header is checked against its size and the counts against meta.json's (a few reads per shard, no
    token read), so a truncated or damaged file is prepared again here rather than failing training later. The
    vocabulary is checked against the tokenizer meta.json names and, for a text, against the largest token id
    (one pass over the tokens): a wrong vocab_size would make a model of the wrong size.
    """
    meta = _read_meta(out_dir)
    if meta is None or not all(meta.get(k) == v for k, v in fingerprint.items()):
        return None  # none, damaged (prepare again), or made otherwise
    data = PreparedData(out_dir, meta)
    try:
        if meta.get("sharded"):
            if (len(data.train.paths), len(data.val.paths)) != (meta.get("train_shards"), meta.get("val_shards")):
                return None
            counts = {"train": data.train.num_tokens, "val": data.val.num_tokens}  # read_shard checks each one
        else:
            sizes = {name: getattr(data, name).paths[0].stat().st_size for name in ("train", "val")}
            if any(size % 2 for size in sizes.values()):
                return None
            counts = {name: size // 2 for name, size in sizes.items()}  # uint16 tokens
    except (OSError, DataError):
        return None  # a file missing, truncated or not a shard: prepare again
    if any(meta.get(f"{name}_tokens", count) != count for name, count in counts.items()):
        return None
    if not _vocabulary_agrees(data):
        return None
    return data


def _read_meta(out_dir: Path) -> dict[str, Any] | None:
    """The folder's meta.json, or None where there is none or it is damaged."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    return meta if isinstance(meta, dict) else None


def _vocabulary_agrees(data: PreparedData) -> bool:
    meta = data.meta
    try:
        tokenizer_vocab = tokenizer_from_metadata(meta["tokenizer"]).vocab_size
    except (KeyError, TypeError):
        return False  # no tokenizer named, or not one we know
    if meta.get("vocab_size") != tokenizer_vocab:
        return False
    if meta.get("sharded"):
        return True  # a corpus's tokens come from that BPE; reading every shard at each start would cost minutes
    return all(_largest_token(path) < tokenizer_vocab for path in data.train.paths + data.val.paths)


def _largest_token(path: Path) -> int:
    largest = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):  # an even number of bytes: whole uint16 tokens
            largest = max(largest, int(np.frombuffer(chunk, dtype=np.uint16).max()))
    return largest


if __name__ == "__main__":
    import hydra
    from omegaconf import DictConfig

    from common.cli import exit_on_user_error, presets, run_hydra
    from common.config import typed_config
    from data.config import PrepareConfig, register_prepare_schema

    register_prepare_schema()

    @hydra.main(version_base="1.3", config_path="../configs", config_name="prepare")
    def main(cfg: DictConfig) -> None:
        with exit_on_user_error():
            data = ensure_prepared(typed_config(cfg, PrepareConfig).data)
        m = data.meta
        shards = f" in {m['train_shards'] + m['val_shards']} shards" if m.get("sharded") else ""
        print(
            f"{data.dir}: {m['train_tokens']:,} train and {m['val_tokens']:,} val tokens{shards}, "
            f"vocabulary {m['vocab_size']}"
        )

    usage = (
        "Tokenize a text or a corpus into data/cache/NAME (train.py does it when needed). Settings: key=value.\n\n"
        f"  data=NAME               {', '.join(presets('data'))}\n"
        "  data.input=FILE|DIR     your own UTF-8 text, or a directory of .txt / .jsonl documents\n"
        "  data.tokenizer=NAME     char, or a tiktoken encoding such as r50k_base (GPT-2's)\n\n"
        "Examples:\n  python -m data.prepare data=shakespeare\n"
        "  python -m data.prepare data.input=my_text.txt data.name=mine\n"
    )
    run_hydra(main, PrepareConfig, ("data",), lambda: usage)
