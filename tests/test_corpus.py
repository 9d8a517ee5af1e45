"""A corpus of documents -> token shards (data/corpus.py), offline: local directories, and the Hugging Face
streaming path pointed at a local directory of .jsonl files."""

import hashlib
import json
import multiprocessing
import os
import pydoc_data.topics
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

import data.corpus as corpus
from common.errors import ConfigError, DataError
from conftest import REPO, TINY_BPE, compose_config, run_in_process, tiny_encoding
from data.corpus import HEADER_BYTES, MAGIC, VERSION, read_shard, write_shard
from data.prepare import DataConfig, PreparedData, TokenFiles, ensure_prepared, every_window, get_batch
from data.tokenizers import BpeTokenizer, CharTokenizer

SHARD = 8_000
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
TOPICS = list(pydoc_data.topics.topics.values())


def _prepare(data_dir: Path, input: Path | None = None, **keys: object) -> PreparedData:
    options = {"shard_tokens": SHARD, "num_proc": 1, **keys}
    source = str(input) if input else None
    return ensure_prepared(DataConfig("corpus", TINY_BPE, source, None, str(data_dir), 0.1, **options))


def _write_docs(root: Path, docs: dict[str, list[str]]) -> list[str]:
    """Files of documents (a .txt holds one, a .jsonl one a line); returns them in the corpus's order."""
    for name, texts in docs.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):
            lines = (json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n" for i, t in enumerate(texts))
            path.write_text("".join(lines), encoding="utf-8")
        else:
            path.write_text(texts[0], encoding="utf-8")
    return [t for name in sorted(docs) for t in docs[name]]


@pytest.fixture
def docs_dir(tmp_path: Path) -> tuple[Path, list[str]]:
    """About 100k characters of English in .txt files (two folders deep) and a .jsonl, plus one non-ASCII text."""
    files = {f"{i:02d}.txt": [TOPICS[i]] for i in range(12)}
    files["b.jsonl"] = TOPICS[12:24]
    files.update({f"c/{i:02d}.txt": [TOPICS[i]] for i in range(24, 30)})
    files["c/unicode.txt"] = ["naïve café — 日本語, <|endoftext|> as plain text 🙂"]
    files["d.jsonl"] = ["a line\u2028separator and\x85 next line, unescaped in JSON", "\r\n\tspace ", ""]
    root = tmp_path / "docs"
    return root, _write_docs(root, files)


def _stream(docs: list[str]) -> np.ndarray:
    """What the shards must hold, end to end: <|endoftext|> before each document's tokens."""
    encoding = tiny_encoding()
    return np.array([t for d in docs for t in [encoding.eot_token, *encoding.encode_ordinary(d)]], dtype=np.uint16)


def _shard_stream(data: PreparedData) -> np.ndarray:
    return np.concatenate([read_shard(p) for p in data.val.paths + data.train.paths])


def _shard_bytes(data: PreparedData) -> list[bytes]:
    return [p.read_bytes() for p in data.val.paths + data.train.paths]


def test_shard_header_round_trip_and_damaged_shards_are_named(tmp_path: Path) -> None:
    path = tmp_path / "train_000000.bin"
    tokens = np.array([0, 1, 50256, 65535], dtype=np.uint16)
    write_shard(path, tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * len(tokens)
    assert np.fromfile(path, dtype=np.int32, count=3).tolist() == [MAGIC, VERSION, 4]
    assert read_shard(path).tolist() == tokens.tolist()
    write_shard(path, np.array([], dtype=np.uint16))
    assert len(read_shard(path)) == 0

    write_shard(path, tokens)
    path.write_bytes(path.read_bytes()[:-2])  # truncated
    with pytest.raises(DataError, match="train_000000.bin holds 3 tokens, its header says 4") as info:
        read_shard(path)
    assert "\n" not in str(info.value)
    path.write_bytes(b"\0" * 100)  # shorter than a header
    with pytest.raises(DataError, match="train_000000.bin is not a token shard"):
        read_shard(path)
    path.write_bytes(np.zeros(HEADER_BYTES // 4, dtype=np.int32).tobytes())  # no magic
    with pytest.raises(DataError, match="train_000000.bin is not a token shard"):
        read_shard(path)
    with pytest.raises(DataError, match="65536"):
        write_shard(path, np.array([65536]))


def test_a_directory_becomes_shards_of_its_documents_in_order(tmp_path: Path, docs_dir: tuple[Path, list[str]]) -> None:
    root, docs = docs_dir
    data = _prepare(tmp_path / "one", root, num_proc=1)
    expected = _stream(docs)
    assert np.array_equal(_shard_stream(data), expected)
    assert [p.name for p in data.val.paths] == ["val_000000.bin"]  # the first shard is val
    assert [p.name for p in data.train.paths][:2] == ["train_000000.bin", "train_000001.bin"]
    lengths = list(data.val.lengths + data.train.lengths)
    assert lengths[:-1] == [SHARD] * (len(lengths) - 1) and 0 < lengths[-1] <= SHARD  # the last one is partial
    meta = json.loads((data.dir / "meta.json").read_text())
    assert meta["sharded"] and meta["tokenizer"] == {"kind": "bpe", "encoding": TINY_BPE}
    assert (meta["val_tokens"], meta["train_tokens"]) == (SHARD, len(expected) - SHARD)
    assert (meta["documents"], meta["val_shards"], meta["train_shards"]) == (len(docs), 1, len(lengths) - 1)
    assert sum(data.train.lengths) == meta["train_tokens"]

    two = _prepare(tmp_path / "two", root, num_proc=2)  # a pool of workers: the same bytes
    assert _shard_bytes(two) == _shard_bytes(data)


def test_workers_started_fresh_get_the_encoding_without_its_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, docs_dir: tuple[Path, list[str]]
) -> None:
    """Under spawn (macOS, Windows) or forkserver (Linux from 3.14), tiny_test_bpe isn't registered in workers."""
    root, docs = docs_dir
    monkeypatch.setattr(corpus, "START_METHOD", "spawn")
    data = _prepare(tmp_path / "spawned", root, num_proc=2)
    assert np.array_equal(_shard_stream(data), _stream(docs))


def test_shards_are_reused_and_a_changed_corpus_needs_its_own_folder(
    tmp_path: Path, docs_dir: tuple[Path, list[str]]
) -> None:
    root, docs = docs_dir
    data = _prepare(tmp_path, root)
    stamps = [p.stat().st_mtime_ns for p in data.train.paths]
    again = _prepare(tmp_path, root)
    assert [p.stat().st_mtime_ns for p in again.train.paths] == stamps and again.meta == data.meta

    shorter = root / "05.txt"
    shorter.write_text("a shorter document")
    os.utime(shorter, ns=(shorter.stat().st_atime_ns, shorter.stat().st_mtime_ns + 10**9))
    for path in (root / "c").glob("*.txt"):
        path.unlink()  # fewer documents: fewer shards
    for keys in ({}, {"shard_tokens": 2 * SHARD}):  # another corpus, or another shard size
        with pytest.raises(DataError, match=r"prepared from a directory of 21 files .*, not a directory of 14") as no:
            _prepare(tmp_path, root, **keys)
        assert "\n" not in str(no.value) and str(no.value).endswith(f"or delete {tmp_path} to prepare it again")
        assert [p.stat().st_mtime_ns for p in data.train.paths] == stamps
    remade = _prepare(tmp_path / "changed", root)
    assert remade.meta["train_shards"] < data.meta["train_shards"]
    assert len(list(remade.dir.glob("*.bin"))) == remade.meta["train_shards"] + 1
    kept = docs[:5] + ["a shorter document"] + docs[6:24] + docs[-3:]
    assert np.array_equal(_shard_stream(remade), _stream(kept))
    bigger = _prepare(tmp_path / "bigger", root, shard_tokens=2 * SHARD)
    assert bigger.meta["val_tokens"] == 2 * SHARD


_KILLED_WORKER = r"""
import itertools, os, signal, sys, time
from pathlib import Path
import tiktoken
import data.corpus as corpus
from common.errors import ConfigError
from data.prepare import DataConfig
from common.errors import DataError
from data.tokenizers import BpeTokenizer

ranks = {bytes([b]): b for b in range(256)}
encoding = tiktoken.Encoding("bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})
tokenizer = BpeTokenizer(encoding)
out = Path(sys.argv[1])
corpus.START_METHOD = "fork"  # the workers inherit the patched _encode
encode = corpus._encode

def encode_or_die(encoding, eot, doc):
    if doc == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
    return encode(encoding, eot, doc)

corpus._encode = encode_or_die
with corpus.DocumentEncoder(tokenizer, 2) as encoder:
    print("worker SIGINT ignored:", encoder._pool.submit(signal.getsignal, signal.SIGINT).result() == signal.SIG_IGN)
start = time.monotonic()
endless = itertools.repeat("some text, " * 20)  # stopped at max_tokens: only a bounded window is ever submitted
meta = corpus.write_corpus(endless, tokenizer, out / "capped", 1000, 5000, 2, {})
print(f"capped: {meta['train_tokens'] + meta['val_tokens']} tokens in {time.monotonic() - start:.1f} s")
start = time.monotonic()
try:
    corpus.write_corpus(["text"] * 5000 + ["die"] + ["text"] * 5000, tokenizer, out / "killed", 1000, None, 2, {})
except DataError as err:
    print(f"DataError in {time.monotonic() - start:.1f} s: {err}")
"""


def test_a_killed_worker_is_a_one_line_error_not_a_hang(tmp_path: Path) -> None:
    """multiprocessing.Pool.imap waits forever for a worker the OOM killer took; the executor's pool breaks."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("the test's patched worker function reaches the workers by fork")
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_WORKER, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,  # a hang fails here rather than stalling the suite
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "worker SIGINT ignored: True"
    capped = re.fullmatch(r"capped: 5000 tokens in ([0-9.]+) s", lines[1])
    assert capped and float(capped[1]) < 10, lines[1]
    died = re.fullmatch(
        r"DataError in ([0-9.]+) s: an encoding process died \(out of memory\?\); lower data.num_proc.*", lines[2]
    )
    assert died and float(died[1]) < 10, lines[2]
    assert len(lines) == 3, result.stdout


def test_max_tokens_stops_inside_a_document_and_a_small_corpus_asks_for_smaller_shards(
    tmp_path: Path, docs_dir: tuple[Path, list[str]]
) -> None:
    root, docs = docs_dir
    data = _prepare(tmp_path / "capped", root, max_tokens=3 * SHARD + 123)
    assert np.array_equal(_shard_stream(data), _stream(docs)[: 3 * SHARD + 123])
    assert data.meta["train_shards"] == 3 and data.meta["train_tokens"] == 2 * SHARD + 123
    with pytest.raises(DataError, match="lower data.shard_tokens") as info:
        _prepare(tmp_path / "small", root, shard_tokens=10**6)
    assert "\n" not in str(info.value)


def test_batches_over_shards_are_slices_of_one_shard(tmp_path: Path, docs_dir: tuple[Path, list[str]]) -> None:
    root, _ = docs_dir
    data = _prepare(tmp_path, root)
    shards = [np.asarray(read_shard(p)) for p in data.train.paths]
    block = 32
    x, y = get_batch(data.train, 64, block, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])
    for window in torch.cat([x, y[:, -1:]], dim=1).numpy().astype(np.uint16):
        assert any(_holds(shard, window) for shard in shards), "a window is not a slice of any one shard"

    rows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in every_window(data.train, 7, block)]
    expected = [s[i * block : (i + 1) * block + 1] for s in shards for i in range((len(s) - 1) // block)]
    assert np.array_equal(torch.cat(rows).numpy(), np.stack(expected))  # each shard's windows, in order


def test_get_batch_draws_from_every_shard_and_never_across_two(tmp_path: Path) -> None:
    sizes = [1000, 40, 2000, 600]  # distinct token values: a window's first token says where it came from
    starts = np.cumsum([0, *sizes])
    paths = []
    for i, size in enumerate(sizes):
        paths.append(tmp_path / f"train_{i:06d}.bin")
        write_shard(paths[-1], np.arange(starts[i], starts[i] + size, dtype=np.uint16))
    x, y = get_batch(TokenFiles(tuple(paths), sharded=True), 2000, 64, torch.Generator().manual_seed(1))
    first, last = x[:, 0].numpy(), y[:, -1].numpy()
    assert np.array_equal(last - first, np.full(len(first), 64))  # consecutive tokens: never spans two shards
    shard_of = np.searchsorted(starts, first, side="right") - 1
    assert np.all(last < starts[shard_of + 1])
    assert set(shard_of.tolist()) == {0, 2, 3}  # the 40-token shard holds no 64-token window


def test_hf_streaming_path_gives_the_tokens_of_the_local_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets", reason='the optional datasets package is not installed (pip install ".[hf]")')
    root = tmp_path / "jsonl"
    docs = _write_docs(root, {"a.jsonl": TOPICS[:15], "b.jsonl": TOPICS[15:25]})
    streamed = _prepare(tmp_path / "hf", hf_dataset=str(root), num_proc=2)
    local = _prepare(tmp_path / "local", root)
    assert _shard_bytes(streamed) == _shard_bytes(local)
    assert np.array_equal(_shard_stream(streamed), _stream(docs))
    assert streamed.meta["source"] == {"hf_dataset": str(root), "hf_name": None}


def test_hf_errors_are_one_line_and_say_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DataError, match=r'data.hf_dataset=HuggingFaceFW/fineweb-edu .*pip install "\.\[hf\]"'):
        _prepare(tmp_path, hf_dataset="HuggingFaceFW/fineweb-edu", hf_name="sample-10BT")

    class Offline:
        @staticmethod
        def load_dataset(*args: object, **kwargs: object) -> None:
            raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub\n(details)")

    monkeypatch.setitem(sys.modules, "datasets", Offline)
    with pytest.raises(DataError, match="could not load data.hf_dataset=HuggingFaceFW/fineweb-edu") as info:
        _prepare(tmp_path, hf_dataset="HuggingFaceFW/fineweb-edu", hf_name="sample-10BT")
    assert "\n" not in str(info.value) and "ConnectionError" in str(info.value)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"shard_tokens": 0}, "data.shard_tokens=0"),
        ({"max_tokens": -5}, "data.max_tokens=-5"),
        ({"num_proc": 0}, "data.num_proc=0"),
        ({"hf_name": "sample-10BT"}, "data.hf_name=sample-10BT needs data.hf_dataset"),
        ({"hf_dataset": "x/y"}, "data.input and data.hf_dataset=x/y are both set"),
    ],
)
def test_corpus_keys_are_checked_at_start(tmp_path: Path, keys: dict, message: str) -> None:
    (tmp_path / "doc.txt").write_text("text")
    with pytest.raises(ConfigError, match=message) as info:
        _prepare(tmp_path / "data", tmp_path, **keys)
    assert "\n" not in str(info.value)


def test_bad_corpora_are_one_line_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no .txt or .jsonl files"):
        _prepare(tmp_path / "data", empty)
    (tmp_path / "doc.txt").write_text("text")
    with pytest.raises(DataError, match="data.tokenizer=char can't encode a corpus.*r50k_base"):
        ensure_prepared(DataConfig("c", "char", str(tmp_path), None, str(tmp_path / "data"), 0.1))
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(DataError, match=r'rows.jsonl:2 has no "text"'):
        _prepare(tmp_path / "data", tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(DataError, match=r"rows.jsonl:2 is not a JSON line"):
        _prepare(tmp_path / "data", tmp_path, num_proc=2)  # raised while a pool is reading the documents
    ranks = {bytes([b]): b for b in range(256)}
    no_eot = tiktoken.Encoding(name="no_eot", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    with pytest.raises(DataError, match=re.escape("no <|endoftext|> token")):
        _ = BpeTokenizer(no_eot).eot_token


def test_token_byte_lengths_add_up_to_the_utf8_bytes_of_the_text(docs_dir: tuple[Path, list[str]]) -> None:
    _, docs = docs_dir
    text = "naïve café — 日本語 🙂\n" + TOPICS[0][:2000]
    char = CharTokenizer(sorted(set(text)))
    assert char.token_byte_lengths().dtype == np.int32
    assert char.token_byte_lengths()[char.encode(text)].sum() == len(text.encode())
    bpe = BpeTokenizer(tiny_encoding())
    lengths = bpe.token_byte_lengths()
    assert lengths.shape == (bpe.vocab_size,) and lengths.dtype == np.int32 and lengths[bpe.eot_token] == 0
    ids = bpe.encode(text)
    assert any(len(bpe.encoding.decode_single_token_bytes(t)) > 1 for t in ids)  # merges were applied
    assert lengths[ids].sum() == len(bpe.decode(ids).encode()) == len(text.encode())
    assert lengths[_stream(docs)].sum() == sum(len(d.encode()) for d in docs)  # <|endoftext|> counts 0 bytes


def test_web_corpus_presets_stream_with_gpt2s_bpe() -> None:
    for preset, dataset in (("fineweb_edu", "HuggingFaceFW/fineweb-edu"), ("openwebtext", "Skylion007/openwebtext")):
        data = compose_config([f"data={preset}"]).data
        assert (data.hf_dataset, data.tokenizer, data.shard_tokens, data.input) == (
            dataset,
            "r50k_base",
            100_000_000,
            None,
        )
    assert compose_config(["data=fineweb_edu"]).data.hf_name == "sample-10BT"


def _holds(shard: np.ndarray, window: np.ndarray) -> bool:
    haystack, needle = shard.tobytes(), window.tobytes()
    at = haystack.find(needle)
    while at != -1 and at % 2:  # a match must start on a token boundary
        at = haystack.find(needle, at + 1)
    return at != -1


def _real_r50k_available() -> bool:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    return bool(cache) and (Path(cache) / hashlib.sha1(R50K_URL.encode()).hexdigest()).is_file()


@pytest.mark.skipif(
    not _real_r50k_available(), reason="GPT-2 ranks not provided (set TIKTOKEN_CACHE_DIR as .ci/run does)"
)
def test_prepare_command_shards_a_directory_with_gpt2s_bpe(tmp_path: Path, docs_dir: tuple[Path, list[str]]) -> None:
    root, docs = docs_dir
    args = [f"data.input={root}", "data.tokenizer=r50k_base", f"data.dir={tmp_path / 'data'}", "data.num_proc=2"]
    result = run_in_process("-m data.prepare", [*args, f"data.shard_tokens={SHARD}"], cwd=REPO)
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert f"{meta['train_tokens']:,} train and {SHARD:,} val tokens in" in result.stdout
    data = PreparedData(tmp_path / "data", meta)
    gpt2 = tiktoken.get_encoding("r50k_base")
    assert _shard_stream(data).tolist() == [t for d in docs for t in [50256, *gpt2.encode_ordinary(d)]]


def test_val_bits_per_byte_is_the_text_tokens_nats_over_their_bytes(
    tmp_path: Path, docs_dir: tuple[Path, list[str]]
) -> None:
    """Trained on the shards; bits per byte leaves <|endoftext|> (0 bytes) out of both sums, as nanochat."""
    from conftest import tiny_run_overrides
    from model.gpt import CKPT_NAME, load_checkpoint
    from training.run import train

    root, _ = docs_dir
    extra = {"data.tokenizer": TINY_BPE, "data.shard_tokens": SHARD, "data.num_proc": 1, "train.full_val": True}
    train(compose_config(tiny_run_overrides(tmp_path, root, **extra)))
    reported = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    model = load_checkpoint(tmp_path / "run" / CKPT_NAME).build_model().eval()
    encoding = tiny_encoding()
    data = _prepare(tmp_path / "data", root)
    nats, all_nats, tokens, n_bytes = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for x, y in every_window(data.val, 16, 32):
            losses = torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none")
            text = y.flatten() != encoding.eot_token
            nats += losses[text].sum().item()
            all_nats, tokens = all_nats + losses.sum().item(), tokens + y.numel()
            n_bytes += sum(len(encoding.decode_single_token_bytes(t)) for t in y.flatten()[text].tolist())
    assert nats < all_nats  # the val shard does hold document boundaries: the two sums differ
    assert reported["val_loss"] == pytest.approx(all_nats / tokens, rel=1e-5)
    assert reported["val_bpb"] == pytest.approx(nats / (np.log(2) * n_bytes), rel=1e-5)


_ORPHAN_PARENT = """
import os, sys, time
sys.path.insert(0, {repo!r})
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from data.corpus import exit_with_parent

def work(_):
    time.sleep(60)
    return os.getpid()

if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    pool = ProcessPoolExecutor(2, mp_context=context, initializer=exit_with_parent, initargs=(os.getpid(), 0.1))
    futures = [pool.submit(work, i) for i in range(2)]
    while len(pool._processes) < 2:
        time.sleep(0.05)
    print(" ".join(str(pid) for pid in pool._processes), flush=True)
    time.sleep(60)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and re-parenting are POSIX's")
@pytest.mark.parametrize("method", ["spawn", "forkserver"])  # forkserver: Python 3.14's default on Linux
def test_encoding_workers_end_when_their_parent_is_killed(tmp_path: Path, method: str) -> None:
    """data.prepare's pool initializer: workers of a parent killed with SIGKILL used to live on under PID 1."""
    import signal
    import subprocess
    import time

    from conftest import REPO

    script = tmp_path / "parent.py"  # a file: spawned workers import their task from it
    script.write_text(_ORPHAN_PARENT.format(repo=str(REPO)))
    parent = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(workers) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in workers if _running(pid)]
    assert alive == []


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # Linux: a zombie (ended, not yet reaped) is not running
            return stat.read().split()[2] != "Z"
    except OSError:
        return True
