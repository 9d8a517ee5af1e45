"""A text is prepared in pieces (data.source's reads, data.prepare's safe cuts) into exactly the files that
encoding it whole in memory gives. Reads of a few bytes make every multi-byte character, \\r\\n and BPE word fall
across a read somewhere in these small texts."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import data.source as source
import data.text_tokens as prepare
from common.errors import DataError
from conftest import TINY_BPE
from data.prepare import DataConfig, ensure_prepared, source_fingerprint
from data.source import read_utf8
from data.tokenizers import BpeTokenizer, CharTokenizer, Tokenizer

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
# Safe cuts (a lone \n between non-spaces), \r\n and lone \r (read as \n), 2-, 3- and 4-byte characters, long words.
TEXT = (
    "Café déjà vu:\nnaïve façade,\r\n漢字かな混じり文\rthe antidisestablishmentarianism\n"
    "🙂🎉 emoji,   spaces\n\n  and\ttabs\n" + "".join(f"line{i} 😀 über{i}x\n" for i in range(40))
)
# No lone newline between two non-space characters anywhere: one paragraph a line, blank lines between.
NO_SAFE_CUT = "".join(f"Paragraph {i}: héllo 漢 🙂 wörld, the end.\n\n" for i in range(60))


def _real_r50k_available() -> bool:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    return bool(cache) and (Path(cache) / hashlib.sha1(R50K_URL.encode()).hexdigest()).is_file()


TOKENIZERS = [
    "char",
    TINY_BPE,
    pytest.param(
        "r50k_base",
        marks=pytest.mark.skipif(
            not _real_r50k_available(), reason="GPT-2 ranks not provided (set TIKTOKEN_CACHE_DIR as .ci/run does)"
        ),
    ),
]


@pytest.fixture
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of 7 bytes and BPE pieces of 5 characters: dozens of reads and cuts in a text of a few kB."""
    monkeypatch.setattr(source, "_READ_BYTES", 7)
    monkeypatch.setattr(prepare, "_CHUNK_CHARS", 5)


def _whole_text_tokenizer(spec: str, text: str) -> Tokenizer:
    return CharTokenizer(sorted(set(text))) if spec == "char" else BpeTokenizer.from_name(spec)


def _expected_files(path: Path, spec: str, val_fraction: float, source_meta: dict) -> dict[str, bytes]:
    """The files the code before streaming made: the whole text in memory, each part encoded at once."""
    text = path.read_text(encoding="utf-8")
    split = int(len(text) * (1 - val_fraction))
    tokenizer = _whole_text_tokenizer(spec, text)
    ids = {name: tokenizer.encode(part) for name, part in (("train", text[:split]), ("val", text[split:]))}
    meta = {
        "tokenizer": tokenizer.metadata(),
        "vocab_size": tokenizer.vocab_size,
        "train_tokens": len(ids["train"]),
        "val_tokens": len(ids["val"]),
        "source": source_meta,
        "tokenizer_spec": spec,
        "val_fraction": val_fraction,
        **({"input": str(path)} if "input_sha256" in source_meta else {}),
    }
    files = {f"{name}.bin": np.asarray(part, dtype=np.uint16).tobytes() for name, part in ids.items()}
    return {**files, "meta.json": json.dumps(meta, ensure_ascii=False).encode()}


def _prepared_files(data_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in data_dir.iterdir() if path.name != "input.txt"}


def _prepare(path: Path | None, data_dir: Path, spec: str, url: str | None = None) -> None:
    ensure_prepared(DataConfig("test", spec, str(path) if path else None, url, str(data_dir), 0.1))


@pytest.mark.parametrize("spec", TOKENIZERS)
@pytest.mark.parametrize("text", [TEXT, NO_SAFE_CUT], ids=["safe_cuts", "no_safe_cut"])
def test_streamed_files_equal_encoding_the_whole_text(tmp_path: Path, small_reads: None, spec: str, text: str) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes(text.encode())  # bytes: \r stays \r on disk
    _prepare(path, tmp_path / "data", spec)
    expected = _expected_files(path, spec, 0.1, {"input_sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    assert _prepared_files(tmp_path / "data") == expected


def test_encoding_the_reads_one_by_one_would_not_do(small_reads: None, tmp_path: Path) -> None:
    """What the safe cuts are for: BPE over the raw reads gives other ids (words cut in two)."""
    path = tmp_path / "input.txt"
    path.write_bytes(TEXT.encode())
    bpe = BpeTokenizer.from_name(TINY_BPE)
    reads = list(source.utf8_pieces(path))
    assert "".join(reads) == path.read_text(encoding="utf-8")
    assert [t for r in reads for t in bpe.encode(r)] != bpe.encode("".join(reads))
    cut = list(prepare._safely_cut(reads, bpe.pretokenizer()))
    assert len(cut) > 20 and [t for c in cut for t in bpe.encode(c)] == bpe.encode("".join(reads))


def test_a_text_without_a_newline_cut_is_cut_where_the_pretokenizer_splits_it(
    small_reads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paragraphs a line each: no lone newline to cut at, so the encoding's own word boundaries are used, checked
    against the text ending there. Checking only the last word would cut "end.\n\n|Paragraph", where the text
    ending at the cut makes "\n\n" one word instead of two: other ids."""
    bpe = BpeTokenizer.from_name(TINY_BPE)
    words = bpe.pretokenizer().findall  # BPE merges within these words only: equal words, equal ids
    text = NO_SAFE_CUT * 3
    reads = [text[i : i + 7] for i in range(0, len(text), 7)]
    pieces = list(prepare._safely_cut(reads, bpe.pretokenizer()))
    assert len(pieces) > 100 and max(map(len, pieces)) < 1024 + 3 * 5 + 7  # the margin, 2 pieces and a read
    assert [w for p in pieces for w in words(p)] == words(text)
    assert [t for p in pieces for t in bpe.encode(p)] == bpe.encode(text)
    paragraph = NO_SAFE_CUT.index("Paragraph 1")
    monkeypatch.setattr(prepare, "_CHUNK_CHARS", paragraph)  # the first candidate: right after "end.\n\n"
    checked = list(prepare._pretoken_chunks(text, bpe.pretokenizer()))
    assert len(checked) > 100 and [w for p in checked for w in words(p)] == words(text)
    careless = list(prepare._pretoken_chunks(text, bpe.pretokenizer(), check=1))
    assert "".join(careless) == text and [w for p in careless for w in words(p)] != words(text)


def test_bpe_pieces_stay_near_a_read_long(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Bounded memory: no piece encoded is much longer than a read, whatever the text's length."""
    monkeypatch.setattr(source, "_READ_BYTES", 64)
    monkeypatch.setattr(prepare, "_CHUNK_CHARS", 16)
    path = tmp_path / "input.txt"
    path.write_bytes((TEXT * 20).encode())
    lengths = []
    encode = BpeTokenizer.encode

    def recording(self: BpeTokenizer, text: str) -> list[int]:
        lengths.append(len(text))
        return encode(self, text)

    monkeypatch.setattr(BpeTokenizer, "encode", recording)
    _prepare(path, tmp_path / "data", TINY_BPE)
    assert len(lengths) > 100 and max(lengths) <= 64 + 16 + 64  # a read, the minimum piece, the held tail


def _bad_bytes() -> Iterator[bytes]:
    good = "é漢🙂 ok\n".encode() * 3  # 36 bytes: past the first few reads
    yield good + b"\xff" + good  # a byte that never starts a character
    yield good + "漢".encode()[:2] + b"a" + good  # a character cut short
    yield good + "🙂".encode()[:3]  # the file ends inside a character
    yield good[:13] + b"\x80" + good  # a lone continuation byte, the last byte of the second read


@pytest.mark.parametrize("raw", list(_bad_bytes()), ids=["invalid_start", "cut_short", "truncated", "at_read_end"])
def test_non_utf8_text_is_the_same_one_line_error_at_the_absolute_offset(
    tmp_path: Path, small_reads: None, raw: bytes
) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes(raw)
    with pytest.raises(DataError) as whole:
        read_utf8(path)  # the text read whole, as before
    with pytest.raises(DataError) as streamed:
        _prepare(path, tmp_path / "data", "char")
    with pytest.raises(UnicodeDecodeError) as decoded:
        raw.decode("utf-8")
    assert str(streamed.value) == str(whole.value)
    assert f"at byte {decoded.value.start})" in str(streamed.value) and decoded.value.start > 7
    assert "\n" not in str(streamed.value)
    assert not list((tmp_path / "data").glob("*.bin*"))  # refused before anything was written


def test_fingerprint_hashes_the_file_in_blocks(tmp_path: Path, small_reads: None) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes(TEXT.encode() * 3)
    assert source_fingerprint(str(path), None) == {"input_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_a_downloaded_text_is_saved_then_streamed(tmp_path: Path, small_reads: None) -> None:
    served = tmp_path / "served"
    served.mkdir()
    (served / "text.txt").write_bytes(TEXT.encode())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/text.txt"
        _prepare(None, tmp_path / "data", TINY_BPE, url)
        server.shutdown()
    cached = tmp_path / "data" / "input.txt"
    assert cached.read_bytes() == TEXT.encode()
    assert _prepared_files(tmp_path / "data") == _expected_files(cached, TINY_BPE, 0.1, {"url": url})


def test_a_giant_word_is_cut_anyway_so_memory_stays_bounded(small_reads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of one letter has no safe cut at all: it used to be held whole (20 MB peaked at 1.16 GB of RSS; cut
    every _GIANT_WORD_CHARS: 0.33 GB, the same token counts)."""
    monkeypatch.setattr(prepare, "_GIANT_WORD_CHARS", 4096)
    bpe = BpeTokenizer.from_name(TINY_BPE)
    text = "a" * 20_000 + " the end\n"
    reads = [text[i : i + 100] for i in range(0, len(text), 100)]
    pieces = list(prepare._safely_cut(reads, bpe.pretokenizer()))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 4096 + 2 * 100
