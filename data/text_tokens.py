"""A text -> train.bin / val.bin (uint16) in bounded memory: encoded in pieces, same as encoded whole."""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import regex
from tqdm import tqdm

from common.errors import DataError
from common.files import write_atomically
from data.source import TextFile, utf8_pieces
from data.tokenizers import BpeTokenizer, CharTokenizer, Tokenizer

_CHUNK_CHARS = 1 << 20  # BPE: encode pieces of at least this many characters, cut where it is safe
_GIANT_WORD_CHARS = 2 * _CHUNK_CHARS  # a run with no safe cut at all is cut here anyway (_safely_cut)
# A lone newline between two non-space characters: GPT-2's pre-tokenizer always splits after it (a safe cut)
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def make_tokenizer(spec: str, chars: Iterable[str]) -> Tokenizer:
    return CharTokenizer(sorted(set(chars))) if spec == "char" else BpeTokenizer.from_name(spec)


def write_dataset(text: TextFile, tokenizer: Tokenizer, out_dir: Path, val_fraction: float) -> dict[str, Any]:
    """Split the text (first part train, last part val) and write each part's tokens; the tokenizer and the counts."""
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise DataError(f"vocabulary of {tokenizer.vocab_size} tokens does not fit in uint16 token files")
    split = int(text.length * (1 - val_fraction))
    counts = {}
    with tqdm(total=text.length, unit="char", unit_scale=True, desc="tokenizing",
              disable=text.length < 4 * _CHUNK_CHARS) as bar:
        try:
            for name, part in zip(("train", "val"), _split(utf8_pieces(text.path), split), strict=True):
                # characters encode one by one: any cut will do; BPE needs safe cuts
                cut = part if isinstance(tokenizer, CharTokenizer) else _safely_cut(part, tokenizer.pretokenizer())
                counts[f"{name}_tokens"] = _write_tokens(out_dir / f"{name}.bin", cut, tokenizer, bar)
        except DataError:  # "not in the vocabulary": a character added since the survey, say so
            text.check_unchanged()
            raise
    text.check_unchanged()  # the text encoded is the text surveyed: its split and its vocabulary
    return {"tokenizer": tokenizer.metadata(), "vocab_size": tokenizer.vocab_size, **counts}


def _split(pieces: Iterator[str], at: int) -> tuple[Iterator[str], Iterator[str]]:
    """The first `at` characters of the pieces, then the rest, in one read: take the rest once the first is used up."""
    rest: list[str] = []  # the far side of the piece the split falls in

    def first(left: int) -> Iterator[str]:
        for piece in pieces:
            yield piece[:left]
            if len(piece) >= left:
                rest.append(piece[left:])
                return
            left -= len(piece)

    return first(at), itertools.chain(rest, pieces)  # chain reads `rest` only when it gets to it


def _write_tokens(path: Path, pieces: Iterable[str], tokenizer: Tokenizer, bar: tqdm) -> int:
    """Encode piece by piece into `path`, written whole (write_atomically); the token count."""

    def write(f: BinaryIO) -> None:
        for piece in pieces:
            np.asarray(tokenizer.encode(piece), dtype=np.uint16).tofile(f)
            bar.update(len(piece))

    write_atomically(path, write)
    return path.stat().st_size // 2  # uint16 tokens


def _safely_cut(pieces: Iterable[str], pretokenizer: regex.Pattern) -> Iterator[str]:
    """The pieces re-cut at safe cuts only, so BPE-encoding them one by one gives the whole text's ids. Cuts: a lone
    newline between words, _CHUNK_CHARS or more apart; past 2 * _CHUNK_CHARS held, where the pre-tokenizer splits
    (_pretoken_chunks); with no cut at all, every _GIANT_WORD_CHARS anyway (tokens may differ there; memory stays
    bounded). These hold for GPT-2's pre-tokenizer (r50k_base, p50k_base, which fit uint16), not for cl100k's."""
    tail = ""
    for piece in pieces:
        tail += piece
        while len(tail) > _CHUNK_CHARS and (cut := _SAFE_CUT.search(tail, _CHUNK_CHARS)):
            yield tail[: cut.start()]
            tail = tail[cut.start() :]
        if len(tail) > 2 * _CHUNK_CHARS:
            *whole, tail = _pretoken_chunks(tail, pretokenizer)
            yield from whole
        while len(tail) > _GIANT_WORD_CHARS:  # no safe cut anywhere: cut anyway, memory before exactness
            yield tail[:_GIANT_WORD_CHARS]
            tail = tail[_GIANT_WORD_CHARS:]
    yield tail


def _pretoken_chunks(text: str, pretokenizer: regex.Pattern, check: int = 4) -> Iterator[str]:
    """~_CHUNK_CHARS-character pieces of a text starting at a safe cut, each ending where the pre-tokenizer splits it,
    checked: the last `check` words before the cut match when the text ends there. The last is >= 1,024 characters."""
    ends = [0, *itertools.accumulate(map(len, pretokenizer.findall(text)))]  # GPT-2's words cover every character
    start, word = 0, check  # ends[word] is where the word-th word ends
    while True:
        word = max(word, bisect.bisect_left(ends, start + _CHUNK_CHARS))
        cut = ends[word] if word < len(ends) else len(text)
        if cut > len(text) - 1024:  # the words near the end may change with the text that follows
            break
        words = list(zip(ends[word - check : word], ends[word - check + 1 : word + 1], strict=True))
        if [m.span() for m in pretokenizer.finditer(text, words[0][0], cut)] == words:  # as if the text ended there
            yield text[start:cut]
            start = cut
        word += 1
    yield text[start:]
