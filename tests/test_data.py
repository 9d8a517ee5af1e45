import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import data.text_tokens as prepare
from conftest import TINY_BPE, tiny_encoding
from data.batches import TokenFiles, get_batch
from data.config import KNOWN_TEXTS, SHAKESPEARE_URL, DataConfig
from data.errors import DataError
from data.prepare import PreparedData, ensure_prepared
from data.source import file_sha256, read_utf8, text_file
from data.text_tokens import write_dataset
from data.tokenizers import BpeTokenizer, CharTokenizer, tokenizer_from_metadata

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20


def _prepare(tmp_path: Path, input: Path, tokenizer: str = "char") -> PreparedData:
    return ensure_prepared(DataConfig("test", tokenizer, str(input), None, str(tmp_path / "data"), 0.1))


def test_char_dataset_round_trip_and_split(tmp_path: Path, corpus_path: Path) -> None:
    text = corpus_path.read_text(encoding="utf-8")
    data = _prepare(tmp_path, corpus_path)
    train = np.fromfile(data.train.paths[0], dtype=np.uint16)
    val = np.fromfile(data.val.paths[0], dtype=np.uint16)
    split = int(len(text) * 0.9)
    assert (len(train), len(val)) == (split, len(text) - split)
    tokenizer = tokenizer_from_metadata(data.meta["tokenizer"])
    assert tokenizer.vocab_size == data.meta["vocab_size"] == len(set(text))
    assert tokenizer.decode(train.tolist()) + tokenizer.decode(val.tolist()) == text


def test_bpe_dataset_round_trip_with_a_tiktoken_encoding(tmp_path: Path, corpus_path: Path) -> None:
    text = corpus_path.read_text(encoding="utf-8")
    data = _prepare(tmp_path, corpus_path, tokenizer=TINY_BPE)
    assert data.meta["tokenizer"] == {"kind": "bpe", "encoding": TINY_BPE}
    tokenizer = tokenizer_from_metadata(data.meta["tokenizer"])
    train = np.fromfile(data.train.paths[0], dtype=np.uint16).tolist()
    val = np.fromfile(data.val.paths[0], dtype=np.uint16).tolist()
    assert tokenizer.decode(train) + tokenizer.decode(val) == text
    assert len(train) + len(val) < 0.95 * len(text.encode())  # merges were applied


def test_chunked_bpe_encoding_equals_encoding_the_whole_text(
    monkeypatch: pytest.MonkeyPatch, corpus_path: Path
) -> None:
    text = corpus_path.read_text(encoding="utf-8")[:200_000]
    monkeypatch.setattr(prepare, "_CHUNK_CHARS", 3000)
    chunks = list(prepare._chunks(text))
    assert len(chunks) > 20 and "".join(chunks) == text
    encoding = tiny_encoding()
    chunked = [t for c in chunks for t in encoding.encode_ordinary(c)]
    assert chunked == encoding.encode_ordinary(text)


def test_char_tokenizer_names_an_unknown_character() -> None:
    tokenizer = CharTokenizer.from_text("abc")
    with pytest.raises(DataError, match="'z'"):
        tokenizer.encode("abz")


def test_unknown_tiktoken_encoding_is_a_one_line_error() -> None:
    with pytest.raises(DataError, match="data.tokenizer=no_such_encoding") as info:
        BpeTokenizer.from_name("no_such_encoding")
    assert "\n" not in str(info.value)


def test_prepared_files_are_reused_and_remade_when_the_input_changes(tmp_path: Path) -> None:
    first = tmp_path / "a.txt"
    first.write_text(TEXT)
    data = _prepare(tmp_path, first)
    stamp = data.train.paths[0].stat().st_mtime_ns
    assert _prepare(tmp_path, first).train.paths[0].stat().st_mtime_ns == stamp
    second = tmp_path / "b.txt"
    second.write_text(TEXT.upper())
    remade = _prepare(tmp_path, second)
    assert remade.meta["tokenizer"]["chars"] == sorted(set(TEXT.upper()))


def test_text_source_order_input_then_cache_then_download(tmp_path: Path) -> None:
    cached = tmp_path / "cache" / "input.txt"
    unreachable = "http://127.0.0.1:9/input.txt"  # a closed port on this machine: fails at once
    with pytest.raises(DataError, match="data.input=/path/to/text.txt") as info:
        read_utf8(text_file(None, cached, unreachable))
    assert "\n" not in str(info.value)
    cached.parent.mkdir()
    cached.write_text("cached copy")
    assert read_utf8(text_file(None, cached, unreachable)) == "cached copy"
    mine = tmp_path / "mine.txt"
    mine.write_text("my own text")
    assert read_utf8(text_file(str(mine), cached, unreachable)) == "my own text"
    with pytest.raises(DataError, match="data.input=.*does not exist"):
        text_file(str(tmp_path / "missing.txt"), cached, unreachable)


def test_non_utf8_input_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        read_utf8(text_file(str(bad), tmp_path / "cache.txt", None))


def test_get_batch_gives_shifted_windows_and_depends_only_on_the_generator(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    x, y = get_batch(TokenFiles((path,)), 5, 16, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # consecutive tokens: y is x shifted by one
    assert torch.equal(torch.diff(x, dim=1), torch.ones(5, 15, dtype=torch.int64))
    x2, _ = get_batch(TokenFiles((path,)), 5, 16, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2)


def test_write_dataset_refuses_a_vocabulary_too_large_for_uint16(tmp_path: Path) -> None:
    class Huge:
        vocab_size = 70_000

    with pytest.raises(DataError, match="uint16"):
        write_dataset("text", Huge(), tmp_path, 0.1, {})  # type: ignore[arg-type]


def _real_r50k_available() -> bool:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    return bool(cache) and (Path(cache) / hashlib.sha1(R50K_URL.encode()).hexdigest()).is_file()


@pytest.mark.skipif(
    not _real_r50k_available(), reason="GPT-2 ranks not provided (set TIKTOKEN_CACHE_DIR as .ci/run does)"
)
def test_real_gpt2_bpe_on_tiny_shakespeare_matches_nanogpt(tmp_path: Path, corpus_path: Path) -> None:
    if file_sha256(corpus_path) != KNOWN_TEXTS[SHAKESPEARE_URL]:  # whatever the file's name (input.txt)
        pytest.skip("tiny Shakespeare not provided (set GPT_TEST_CORPUS as .ci/run does)")
    data = ensure_prepared(DataConfig("shakespeare", "r50k_base", str(corpus_path), None, str(tmp_path), 0.1))
    assert (data.meta["train_tokens"], data.meta["val_tokens"]) == (301_966, 36_059)  # nanoGPT's README
    assert data.meta["vocab_size"] == 50257
    tokenizer = tokenizer_from_metadata(data.meta["tokenizer"])
    assert tokenizer.encode("Hello world") == [15496, 995]  # GPT-2's ids


@pytest.mark.skipif(not os.environ.get("GPT_TEST_CORPUS"), reason="tiny Shakespeare not provided (set GPT_TEST_CORPUS)")
def test_real_char_level_tiny_shakespeare_matches_nanogpt(tmp_path: Path) -> None:
    source = tmp_path / "copy.txt"
    shutil.copy(os.environ["GPT_TEST_CORPUS"], source)
    data = _prepare(tmp_path, source)
    assert data.meta["vocab_size"] == 65
    assert (data.meta["train_tokens"], data.meta["val_tokens"]) == (1_003_854, 111_540)
    assert json.loads((data.dir / "meta.json").read_text())["vocab_size"] == 65


@pytest.mark.parametrize("added", ["Ω", " more of the same text"])
def test_a_text_that_changes_during_preparation_is_named_as_such(tmp_path: Path, added: str) -> None:
    """It was "character 'Ω' is not in the model's vocabulary ...; remove it from the text" for a character the
    survey never saw, and silently a split and counts from another text otherwise."""
    from data.source import TextFile
    from data.text_tokens import make_tokenizer, write_dataset

    path = tmp_path / "input.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 50)
    text = TextFile.survey(path, chars=True)
    tokenizer = make_tokenizer("char", text.chars)
    with path.open("a") as f:  # another program writes on
        f.write(added)
    with pytest.raises(DataError, match=r"input\.txt changed while it was being prepared; prepare again once"):
        write_dataset(text, tokenizer, tmp_path / "data", 0.1, {})
    assert not (tmp_path / "data" / "meta.json").exists()  # nothing that counts as prepared
