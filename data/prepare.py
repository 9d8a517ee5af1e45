"""Turn a text into train.bin / val.bin (uint16 token streams) and meta.json.

Runs on first use from train.py; on its own: `python -m data.prepare data=shakespeare`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data.errors import DataError
from data.source import input_file, read_text
from data.tokenizers import BpeTokenizer, CharTokenizer, Tokenizer

DEFAULT_CACHE = Path(__file__).resolve().parent / "cache"
_CHUNK_CHARS = 1 << 20  # encode in ~1 MB pieces so a progress bar can move
# A lone newline between two non-space characters: GPT-2's pre-tokenizer always splits after it,
# so cutting there gives the same tokens as encoding the whole text at once.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


@dataclass(frozen=True)
class PreparedData:
    dir: Path
    meta: dict[str, Any]

    @property
    def train_bin(self) -> Path:
        return self.dir / "train.bin"

    @property
    def val_bin(self) -> Path:
        return self.dir / "val.bin"


def dataset_dir(name: str, dir: str | None) -> Path:
    return Path(dir).expanduser() if dir else DEFAULT_CACHE / name


def source_fingerprint(input_path: str | None, url: str | None) -> dict[str, str | None]:
    """What the bins were made from, so a different data.input is never served stale tokens."""
    if input_path:
        digest = hashlib.sha256(input_file(input_path).read_bytes()).hexdigest()
        return {"input_sha256": digest}
    return {"url": url}


def make_tokenizer(spec: str, text: str) -> Tokenizer:
    return CharTokenizer.from_text(text) if spec == "char" else BpeTokenizer.from_name(spec)


def write_dataset(
    text: str, tokenizer: Tokenizer, out_dir: Path, val_fraction: float, extra_meta: dict
) -> PreparedData:
    """Split the text (first part train, last part val), encode each part and write the streams."""
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise DataError(f"vocabulary of {tokenizer.vocab_size} tokens does not fit in uint16 token files")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # no meta.json: the folder is not a finished dataset
    split = int(len(text) * (1 - val_fraction))
    counts = {}
    with tqdm(
        total=len(text), unit="char", unit_scale=True, desc="tokenizing", disable=len(text) < 4 * _CHUNK_CHARS
    ) as bar:
        for name, part in (("train", text[:split]), ("val", text[split:])):
            ids = []
            for chunk in _chunks(part):
                ids.extend(tokenizer.encode(chunk))
                bar.update(len(chunk))
            counts[f"{name}_tokens"] = len(ids)
            tmp = out_dir / f"{name}.bin.tmp"
            np.asarray(ids, dtype=np.uint16).tofile(tmp)
            os.replace(tmp, out_dir / f"{name}.bin")
    meta = {"tokenizer": tokenizer.metadata(), "vocab_size": tokenizer.vocab_size, **counts, **extra_meta}
    tmp = out_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, ensure_ascii=False))
    os.replace(tmp, out_dir / "meta.json")  # last: only now do the bins count as prepared
    return PreparedData(out_dir, meta)


def _chunks(text: str) -> Iterator[str]:
    start = 0
    while len(text) - start > _CHUNK_CHARS:
        cut = _SAFE_CUT.search(text, start + _CHUNK_CHARS)
        if cut is None:
            break
        yield text[start : cut.start()]
        start = cut.start()
    yield text[start:]


def ensure_prepared(
    name: str, tokenizer: str, input: str | None, url: str | None, dir: str | None, val_fraction: float
) -> PreparedData:
    """Reuse the token files in the dataset folder if they were made from the same text and tokenizer."""
    out_dir = dataset_dir(name, dir)
    fingerprint = {"source": source_fingerprint(input, url), "tokenizer_spec": tokenizer, "val_fraction": val_fraction}
    meta_path = out_dir / "meta.json"
    if meta_path.is_file() and (out_dir / "train.bin").is_file() and (out_dir / "val.bin").is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            meta = {}  # damaged: prepare again
        if all(meta.get(k) == v for k, v in fingerprint.items()):
            return PreparedData(out_dir, meta)
    text = read_text(input, out_dir / "input.txt", url)
    if not text:
        raise DataError(f"the text for dataset {name!r} is empty; pass a non-empty file with data.input=PATH")
    return write_dataset(text, make_tokenizer(tokenizer, text), out_dir, val_fraction, fingerprint)


if __name__ == "__main__":
    import hydra
    from omegaconf import DictConfig

    from training.cli import exit_on_user_error
    from training.schema import register_schemas

    register_schemas()

    @hydra.main(version_base="1.3", config_path="../configs", config_name="prepare")
    def main(cfg: DictConfig) -> None:
        with exit_on_user_error():
            data = ensure_prepared(**cfg.data)
        m = data.meta
        print(
            f"{data.dir}: {m['train_tokens']:,} train and {m['val_tokens']:,} val tokens, vocabulary {m['vocab_size']}"
        )

    main()
