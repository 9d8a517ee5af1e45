"""A text -> train.bin, val.bin and meta.json, prepared once and reused: read and encoded in pieces into exactly the
files of the whole text encoded at once (reads of a few bytes cut every character, \\r\\n and word somewhere)."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import data.prepare
import data.source as source
import data.text_tokens as text_tokens
from common.errors import ConfigError, DataError
from conftest import TINY_BPE
from data.prepare import KNOWN_TEXTS, SHAKESPEARE_URL, DataConfig, PreparedData, ensure_prepared, file_sha256
from data.source import TextFile, read_utf8
from data.text_tokens import make_tokenizer, write_dataset
from data.tokenizers import BpeTokenizer, CharTokenizer, tokenizer_from_metadata

SPEECH = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20
# Safe cuts (a lone \n between non-spaces), \r\n and lone \r (read as \n), 2-, 3- and 4-byte characters, long words.
TEXT = (
    "Café déjà vu:\nnaïve façade,\r\n漢字かな混じり文\rthe antidisestablishmentarianism\n"
    "🙂🎉 emoji,   spaces\n\n  and\ttabs\n" + "".join(f"line{i} 😀 über{i}x\n" for i in range(40))
)
# No lone newline between two non-space characters anywhere: one paragraph a line, blank lines between.
NO_SAFE_CUT = "".join(f"Paragraph {i}: héllo 漢 🙂 wörld, the end.\n\n" for i in range(60))
GPT2_RANKS = pytest.mark.skipif(not os.environ.get("TIKTOKEN_CACHE_DIR"), reason="GPT-2 ranks not provided (set "
                                "TIKTOKEN_CACHE_DIR as .ci/run does)")


@pytest.fixture
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of 7 bytes and BPE pieces of 5 characters: dozens of reads and cuts in a text of a few kB."""
    monkeypatch.setattr(source, "_READ_BYTES", 7)
    monkeypatch.setattr(text_tokens, "_CHUNK_CHARS", 5)


def _prepare(data_dir: Path, input: Path | None, tokenizer: str = "char", val_fraction: float = 0.1,
             url: str | None = None) -> PreparedData:
    return ensure_prepared(DataConfig("test", tokenizer, input and str(input), url, str(data_dir), val_fraction))


def _assert_whole_text_files(data: PreparedData, path: Path) -> None:
    """The files prepared in pieces hold the whole text encoded at once, and meta.json's tokenizer decodes them."""
    text = path.read_text(encoding="utf-8")
    split = int(len(text) * 0.9)
    tokenizer = make_tokenizer(data.meta["tokenizer_spec"], text)
    decoder = tokenizer_from_metadata(data.meta["tokenizer"])
    for name, part in (("train", text[:split]), ("val", text[split:])):
        tokens = np.fromfile(data.dir / f"{name}.bin", dtype=np.uint16).tolist()
        assert tokens == tokenizer.encode(part) and decoder.decode(tokens) == part
        assert data.meta[f"{name}_tokens"] == len(tokens) and data.meta["vocab_size"] == tokenizer.vocab_size


@pytest.mark.parametrize("spec", ["char", TINY_BPE, pytest.param("r50k_base", marks=GPT2_RANKS)])
@pytest.mark.parametrize("text", [TEXT, NO_SAFE_CUT], ids=["safe_cuts", "no_safe_cut"])
def test_streamed_files_equal_encoding_the_whole_text(tmp_path: Path, small_reads: None, spec: str, text: str) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes(text.encode())  # bytes: \r stays \r on disk
    _assert_whole_text_files(_prepare(tmp_path / "data", path, spec), path)


def test_safe_cuts_give_the_whole_text_s_ids_where_the_reads_would_not(
    small_reads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BPE over the raw reads gives other ids (words cut in two). Paragraphs a line each have no lone newline to cut
    at, so the encoding's own word boundaries are used, checked against the text ending there: checking only the
    last word would cut "end.\n\n|Paragraph", where the text ending at the cut makes "\n\n" one word, not two."""
    bpe = BpeTokenizer.from_name(TINY_BPE)
    words = bpe.pretokenizer().findall  # BPE merges within these words only: equal words, equal ids
    text = NO_SAFE_CUT * 3
    reads = [text[i : i + 7] for i in range(0, len(text), 7)]
    assert [t for r in reads for t in bpe.encode(r)] != bpe.encode(text)
    pieces = list(text_tokens._safely_cut(reads, bpe.pretokenizer()))
    assert len(pieces) > 100 and max(map(len, pieces)) < 1024 + 3 * 5 + 7  # the margin, 2 pieces and a read
    assert [w for p in pieces for w in words(p)] == words(text)
    assert [t for p in pieces for t in bpe.encode(p)] == bpe.encode(text)
    monkeypatch.setattr(text_tokens, "_CHUNK_CHARS", NO_SAFE_CUT.index("Paragraph 1"))  # cut after "end.\n\n"
    checked = list(text_tokens._pretoken_chunks(text, bpe.pretokenizer()))
    assert len(checked) > 100 and [w for p in checked for w in words(p)] == words(text)
    careless = list(text_tokens._pretoken_chunks(text, bpe.pretokenizer(), check=1))
    assert "".join(careless) == text and [w for p in careless for w in words(p)] != words(text)


def test_memory_stays_bounded_however_long_the_text_or_a_word(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No piece encoded is much longer than a read, and a run of one letter with no safe cut at all is cut anyway."""
    monkeypatch.setattr(source, "_READ_BYTES", 64)
    monkeypatch.setattr(text_tokens, "_CHUNK_CHARS", 16)
    path = tmp_path / "input.txt"
    path.write_bytes((TEXT * 20).encode())
    lengths = []
    encode = BpeTokenizer.encode
    monkeypatch.setattr(BpeTokenizer, "encode", lambda self, text: lengths.append(len(text)) or encode(self, text))
    _prepare(tmp_path / "data", path, TINY_BPE)
    assert len(lengths) > 100 and max(lengths) <= 64 + 16 + 64  # a read, the minimum piece, the held tail
    monkeypatch.setattr(text_tokens, "_GIANT_WORD_CHARS", 4096)
    text = "a" * 20_000 + " the end\n"
    reads = [text[i : i + 100] for i in range(0, len(text), 100)]
    pieces = list(text_tokens._safely_cut(reads, BpeTokenizer.from_name(TINY_BPE).pretokenizer()))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 4096 + 100


GOOD = "é漢🙂 ok\n".encode() * 3  # 36 bytes: past the first few reads


@pytest.mark.parametrize(
    "raw",
    [
        GOOD + b"\xff" + GOOD,  # a byte that never starts a character
        GOOD + "漢".encode()[:2] + b"a" + GOOD,  # a character cut short
        GOOD + "🙂".encode()[:3],  # the file ends inside a character
        GOOD[:13] + b"\x80" + GOOD,  # a lone continuation byte, the last byte of the second read
    ],
    ids=["invalid_start", "cut_short", "truncated", "at_read_end"],
)
def test_non_utf8_text_is_the_same_one_line_error_at_the_absolute_offset(
    tmp_path: Path, small_reads: None, raw: bytes
) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes(raw)
    with pytest.raises(DataError) as whole:
        read_utf8(path)  # the text read whole
    with pytest.raises(DataError) as streamed:
        _prepare(tmp_path / "data", path)
    with pytest.raises(UnicodeDecodeError) as decoded:
        raw.decode("utf-8")
    assert str(streamed.value) == str(whole.value) and "\n" not in str(streamed.value)
    assert f"at byte {decoded.value.start})" in str(streamed.value) and decoded.value.start > 7
    assert not list((tmp_path / "data").glob("*.bin*"))  # refused before anything was written


def test_tokenizer_errors_name_the_culprit_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="'z'"):
        CharTokenizer(sorted(set("abc"))).encode("abz")
    with pytest.raises(DataError, match="data.tokenizer=no_such_encoding") as info:
        BpeTokenizer.from_name("no_such_encoding")
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="vocabulary of 70000 tokens does not fit in uint16"):
        write_dataset("text", SimpleNamespace(vocab_size=70_000), tmp_path, 0.1)  # type: ignore[arg-type]


def _files(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Each file's inode, modification time and bytes: what "left as it was" means."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_a_folder_prepared_with_other_settings_is_refused_in_one_line_and_left_as_it_was(tmp_path: Path) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(SPEECH)
    second.write_text(SPEECH.upper())
    data = _prepare(tmp_path / "data", first)
    before = _files(data.dir)
    assert _prepare(data.dir, first).meta == data.meta and _files(data.dir) == before  # the same settings: reused
    prepared_from = (f"the data folder {data.dir} was prepared from {first} (sha256 "
                     f"{data.meta['source']['input_sha256'][:12]}) with tokenizer=char, val_fraction=0.1, not ")
    fix = f"(data.name=NAME or data.dir=DIR), or delete {data.dir} to prepare it again"
    for input, tokenizer, val_fraction, named in ((second, "char", 0.1, f"not {second} (sha256 "),
                                                  (first, TINY_BPE, 0.1, f"tokenizer={TINY_BPE}, val_fraction=0.1"),
                                                  (first, "char", 0.2, "tokenizer=char, val_fraction=0.2 as")):
        with pytest.raises(DataError) as refused:
            _prepare(tmp_path / "data", input, tokenizer, val_fraction)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(prepared_from) and named in message and message.endswith(fix)
        assert _files(data.dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "data"]  # nothing was begun
    own = _prepare(tmp_path / "upper", second)
    assert own.meta["tokenizer"]["chars"] == sorted(set(SPEECH.upper()))  # its own folder: prepared


def test_preparation_leaves_no_temporary_folder_and_a_damaged_meta_json_is_prepared_again(tmp_path: Path) -> None:
    text = tmp_path / "input.txt"
    text.write_text(SPEECH)
    data = _prepare(tmp_path / "data", text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "input.txt"]
    assert sorted(p.name for p in data.dir.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    good = {name: content for name, (_, _, content) in _files(data.dir).items()}
    (data.dir / "meta.json").write_text("{not json")
    assert _prepare(tmp_path / "data", text).meta == data.meta
    assert {name: content for name, (_, _, content) in _files(data.dir).items()} == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "input.txt"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty"):  # a failed preparation: nothing of it either
        _prepare(tmp_path / "new", empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "empty.txt", "input.txt"]


def test_token_files_without_our_meta_json_are_never_replaced(tmp_path: Path) -> None:
    """Another tool's token files (nanoGPT's beside its meta.pkl), or ours from a preparation killed while moving
    them in, are left for the user to decide on."""
    text = tmp_path / "input.txt"
    text.write_text(SPEECH)
    theirs = tmp_path / "nanogpt"
    theirs.mkdir()
    for name in ("train.bin", "val.bin", "meta.pkl"):
        (theirs / name).write_bytes(b"\x01\x02")
    before = _files(theirs)
    with pytest.raises(DataError) as refused:
        _prepare(theirs, text)
    assert str(refused.value) == f"data.dir={theirs} holds token files without the meta.json this project writes " \
                                 "beside them (train.bin, val.bin); preparing would replace them: name another " \
                                 "data.dir, or delete them to prepare it there"
    assert _files(theirs) == before and sorted(p.name for p in tmp_path.iterdir()) == ["input.txt", "nanogpt"]


@pytest.mark.parametrize("name", ["", ".", "..", "a/.."])
def test_a_data_name_that_names_no_folder_of_its_own_is_refused(name: str) -> None:
    """Such a name would prepare the dataset into data/cache itself, among all the others."""
    with pytest.raises(ConfigError, match=f"^data.name={re.escape(name)} names no folder of its own under data/cache"):
        DataConfig(name=name)
    assert DataConfig(name=name, dir="elsewhere").name == name  # data.dir names the folder: the name is unused


def test_of_two_preparing_the_same_folder_at_once_the_later_uses_the_earlier_s_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "input.txt"
    text.write_text(SPEECH)
    theirs: dict[str, tuple[int, int, bytes]] = {}

    def another_process_finishes_first(*args: object) -> dict:
        monkeypatch.setattr(data.prepare, "write_dataset", write_dataset)
        theirs.update(_files(_prepare(tmp_path / "data", text).dir))  # the other process: prepares, and moves in first
        return write_dataset(*args)

    monkeypatch.setattr(data.prepare, "write_dataset", another_process_finishes_first)
    later = _prepare(tmp_path / "data", text)
    assert _files(later.dir) == theirs and later.meta == json.loads(theirs["meta.json"][2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "input.txt"]  # ours went


def test_text_comes_from_data_input_else_the_cache_else_a_download_saved_then_streamed(
    tmp_path: Path, small_reads: None
) -> None:
    unreachable = "http://127.0.0.1:9/input.txt"  # a closed port on this machine: fails at once
    with pytest.raises(DataError, match="data.input=/path/to/text.txt") as info:
        _prepare(tmp_path / "none", None, url=unreachable)
    assert "\n" not in str(info.value)
    mine = tmp_path / "mine.txt"
    mine.write_text("my own text")
    for folder, input in (("cache", None), ("mine", mine)):  # data.input, else the cached copy
        cached = tmp_path / folder / "input.txt"
        cached.parent.mkdir()
        cached.write_text("cached copy")
        _assert_whole_text_files(_prepare(cached.parent, input, url=unreachable), input or cached)
    served = tmp_path / "served.txt"  # a file:// URL, downloaded as an http:// one is
    served.write_bytes(TEXT.encode())
    data = _prepare(tmp_path / "data", None, TINY_BPE, url=served.as_uri())
    assert (data.dir / "input.txt").read_bytes() == TEXT.encode()
    _assert_whole_text_files(data, data.dir / "input.txt")


@pytest.mark.parametrize(("tokenizer", "counts"), [
    ("char", (1_003_854, 111_540, 65)), pytest.param("r50k_base", (301_966, 36_059, 50257), marks=GPT2_RANKS)])
def test_tiny_shakespeare_matches_nanogpt(tmp_path: Path, corpus_path: Path, tokenizer: str, counts: tuple) -> None:
    if file_sha256(corpus_path) != KNOWN_TEXTS[SHAKESPEARE_URL]:  # whatever the file's name (input.txt)
        pytest.skip("tiny Shakespeare not provided (set GPT_TEST_CORPUS as .ci/run does)")
    meta = _prepare(tmp_path / "data", corpus_path, tokenizer).meta
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == counts  # nanoGPT's README


@pytest.mark.parametrize("added", ["Ω", " more of the same text"])
def test_a_text_that_changes_during_preparation_is_named_as_such(tmp_path: Path, added: str) -> None:
    """A character the survey never saw is not blamed on the text, and no split or counts of another text are kept."""
    path = tmp_path / "input.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 50)
    text = TextFile.survey(path, chars=True)
    tokenizer = make_tokenizer("char", text.chars)
    with path.open("a") as f:  # another program writes on
        f.write(added)
    with pytest.raises(DataError, match=r"input\.txt changed while it was being prepared; prepare again once"):
        write_dataset(text, tokenizer, tmp_path, 0.1)


def test_a_data_folder_on_another_disk_is_prepared_by_copying(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.dir a mount point or a link to another disk: the files can't be renamed in (EXDEV), so they are copied."""
    text = tmp_path / "input.txt"
    text.write_text(SPEECH)

    def across_disks(source: Path, target: Path) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", across_disks)
    folder = tmp_path / "mounted"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's own")  # a folder in use: its files are moved in one by one
    _assert_whole_text_files(_prepare(folder, text), text)
    assert (folder / "notes.txt").read_text() == "the user's own"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.txt", "mounted"]  # no temporary folder left
