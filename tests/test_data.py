import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import data.text_tokens as prepare
from common.errors import DataError
from conftest import REPO, TINY_BPE, tiny_encoding
from data.prepare import (
    KNOWN_TEXTS,
    SHAKESPEARE_URL,
    DataConfig,
    PreparedData,
    TokenFiles,
    ensure_prepared,
    file_sha256,
    get_batch,
    text_file,
)
from data.source import read_utf8
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
    tokenizer = CharTokenizer(sorted(set("abc")))
    with pytest.raises(DataError, match="'z'"):
        tokenizer.encode("abz")


def test_unknown_tiktoken_encoding_is_a_one_line_error() -> None:
    with pytest.raises(DataError, match="data.tokenizer=no_such_encoding") as info:
        BpeTokenizer.from_name("no_such_encoding")
    assert "\n" not in str(info.value)


def _files(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Each file's inode, modification time and bytes: what "left as it was" means."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_a_folder_prepared_with_other_settings_is_refused_in_one_line_and_left_as_it_was(tmp_path: Path) -> None:
    first = tmp_path / "a.txt"
    first.write_text(TEXT)
    data = _prepare(tmp_path, first)
    before = _files(data.dir)
    assert _prepare(tmp_path, first).meta == data.meta and _files(data.dir) == before  # the same settings: reused
    second = tmp_path / "b.txt"
    second.write_text(TEXT.upper())
    fix = (
        "name another folder for these settings (data.name=NAME or data.dir=DIR), or delete "
        f"{data.dir} to prepare it again"
    )
    asked = [
        (DataConfig("test", "char", str(second), None, str(data.dir), 0.1), f"not {second} (sha256 "),
        (DataConfig("test", TINY_BPE, str(first), None, str(data.dir), 0.1), f"tokenizer={TINY_BPE}, val_fraction=0.1"),
        (DataConfig("test", "char", str(first), None, str(data.dir), 0.2), "tokenizer=char, val_fraction=0.2 as"),
    ]
    for config, named in asked:
        with pytest.raises(DataError) as refused:
            ensure_prepared(config)
        message = str(refused.value)
        assert "\n" not in message and message.endswith(fix) and named in message
        assert message.startswith(
            f"the data folder {data.dir} was prepared from {first} (sha256 {data.meta['source']['input_sha256'][:12]})"
            " with tokenizer=char, val_fraction=0.1, not "
        )
        assert _files(data.dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "data"]  # nothing was begun
    own = ensure_prepared(DataConfig("test", "char", str(second), None, str(tmp_path / "upper"), 0.1))
    assert own.meta["tokenizer"]["chars"] == sorted(set(TEXT.upper()))  # its own folder: prepared


def test_preparation_leaves_no_temporary_folder_and_an_incomplete_folder_is_prepared_again(tmp_path: Path) -> None:
    text = tmp_path / "input.txt"
    text.write_text(TEXT)
    data = _prepare(tmp_path, text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "input.txt"]
    assert sorted(p.name for p in data.dir.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    good = {name: content for name, (_, _, content) in _files(data.dir).items()}
    for damage in (
        lambda: (data.dir / "meta.json").unlink(),  # a preparation killed before its last move
        lambda: (data.dir / "meta.json").write_text("{not json"),
    ):
        damage()
        assert _prepare(tmp_path, text).meta == data.meta
        assert {name: content for name, (_, _, content) in _files(data.dir).items()} == good
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "input.txt"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty"):  # a failed preparation: nothing of it either
        ensure_prepared(DataConfig("test", "char", str(empty), None, str(tmp_path / "new"), 0.1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "empty.txt", "input.txt"]


def test_a_run_reading_a_folder_is_not_disturbed_when_another_process_asks_the_same_settings(tmp_path: Path) -> None:
    text = tmp_path / "input.txt"
    text.write_text(TEXT)
    data = _prepare(tmp_path, text)
    before = _files(data.dir)
    reading = np.memmap(data.train.paths[0], dtype=np.uint16, mode="r")  # as a run reads it
    tokens = reading.copy()
    args = [f"data.input={text}", f"data.dir={data.dir}", "data.tokenizer=char", "data.val_fraction=0.1"]
    other = subprocess.run(
        [sys.executable, "-m", "data.prepare", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert other.returncode == 0, other.stderr
    assert f"{data.dir}: {data.meta['train_tokens']:,} train and" in other.stdout
    assert _files(data.dir) == before and np.array_equal(reading, tokens)  # reused: the same inodes, not rewritten


def test_of_two_preparing_the_same_folder_at_once_the_later_uses_the_earlier_s_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "input.txt"
    text.write_text(TEXT)
    theirs: dict[str, tuple[int, int, bytes]] = {}

    def another_process_finishes_first(*args: object) -> dict:
        monkeypatch.setattr("data.prepare.write_dataset", write_dataset)
        theirs.update(_files(_prepare(tmp_path, text).dir))  # the other process: prepares, and moves in first
        return write_dataset(*args)

    monkeypatch.setattr("data.prepare.write_dataset", another_process_finishes_first)
    later = _prepare(tmp_path, text)
    assert _files(later.dir) == theirs and later.meta == json.loads(theirs["meta.json"][2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "input.txt"]  # ours went


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


def test_a_data_folder_on_another_disk_is_prepared_by_copying(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.dir a mount point or a link to another disk: the files can't be renamed in (EXDEV), so they are moved."""
    import errno

    import data.prepare

    def across_disks(source: Path, target: Path) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(data.prepare, "replace_file", across_disks)
    folder = tmp_path / "mounted"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's own")  # a folder in use: its files are moved in one by one
    prepared = ensure_prepared(DataConfig(input=str(corpus_path), dir=str(folder)))
    assert sum(prepared.train.lengths) > 0 and (folder / "meta.json").is_file()
    assert (folder / "notes.txt").read_text() == "the user's own"
    assert [p.name for p in tmp_path.iterdir()] == ["mounted"]  # no temporary folder left
