"""A corpus -> token shards (data/corpus.py), offline: directories, and Hugging Face's path on local .jsonl files."""

import json
import os
import pydoc_data.topics
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

import data.corpus as corpus
from common.errors import ConfigError, DataError
from common.files import CKPT_NAME
from conftest import REPO, TINY_BPE, compose_config, run_in_process, tiny_encoding, tiny_run_overrides
from data.corpus import HEADER_BYTES, MAGIC, VERSION, read_shard, write_shard
from data.prepare import DataConfig, PreparedData, TokenFiles, ensure_prepared, every_window, get_batch
from data.tokenizers import BpeTokenizer, CharTokenizer
from model.checkpoint import load_checkpoint
from train import train

SHARD = 8_000
TOPICS = list(pydoc_data.topics.topics.values())
GPT2_RANKS = pytest.mark.skipif(not os.environ.get("TIKTOKEN_CACHE_DIR"), reason="GPT-2 ranks not provided (set "
                                "TIKTOKEN_CACHE_DIR as .ci/run does)")


def _prepare(data_dir: Path, input: Path | None = None, tokenizer: str = TINY_BPE, **keys: object) -> PreparedData:
    options = {"shard_tokens": SHARD, "num_proc": 1, **keys}
    return ensure_prepared(DataConfig("corpus", tokenizer, input and str(input), None, str(data_dir), 0.1, **options))


def _write_docs(root: Path, docs: dict[str, list[str]]) -> list[str]:
    """Files of documents (a .txt holds one, a .jsonl one a line); returns them in the corpus's order."""
    for name, texts in docs.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)]
        path.write_text("".join(lines) if name.endswith(".jsonl") else texts[0], encoding="utf-8")
    return [t for name in sorted(docs) for t in docs[name]]


@pytest.fixture
def docs_dir(tmp_path: Path) -> tuple[Path, list[str]]:
    """About 100k characters of English in .txt files (two folders deep) and a .jsonl, plus one non-ASCII text."""
    files = {f"{i:02d}.txt": [TOPICS[i]] for i in range(12)}
    files["b.jsonl"] = TOPICS[12:24]
    files.update({f"c/{i:02d}.txt": [TOPICS[i]] for i in range(24, 30)})
    files["c/unicode.txt"] = ["naïve café — 日本語, <|endoftext|> as plain text 🙂"]
    files["d.jsonl"] = ["a line\u2028separator and\x85 next line, unescaped in JSON", "\r\n\tspace ", ""]
    return tmp_path / "docs", _write_docs(tmp_path / "docs", files)


def _stream(docs: list[str]) -> np.ndarray:
    """What the shards must hold, end to end: <|endoftext|> before each document's tokens."""
    encoding = tiny_encoding()
    return np.array([t for d in docs for t in [encoding.eot_token, *encoding.encode_ordinary(d)]], dtype=np.uint16)


def _shard_stream(data: PreparedData) -> np.ndarray:
    return np.concatenate([read_shard(p) for p in data.val.paths + data.train.paths])


def _shard_files(data: PreparedData) -> list[bytes]:
    return [p.read_bytes() for p in data.val.paths + data.train.paths]


def test_a_directory_becomes_shards_of_its_documents_in_order_up_to_max_tokens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, docs_dir: tuple[Path, list[str]]
) -> None:
    root, docs = docs_dir
    data = _prepare(tmp_path / "one", root)
    expected = _stream(docs)
    assert np.array_equal(_shard_stream(data), expected)
    names = [p.name for p in data.val.paths + data.train.paths]
    assert names[:3] == ["val_000000.bin", "train_000000.bin", "train_000001.bin"]  # the first shard is val
    lengths = list(data.val.lengths + data.train.lengths)
    assert lengths[:-1] == [SHARD] * (len(lengths) - 1) and 0 < lengths[-1] <= SHARD  # the last one is partial
    meta = json.loads((data.dir / "meta.json").read_text())
    assert meta["sharded"] and meta["tokenizer"] == {"kind": "bpe", "encoding": TINY_BPE}
    assert (meta["val_tokens"], meta["train_tokens"]) == (SHARD, len(expected) - SHARD)
    assert (meta["documents"], meta["val_shards"], meta["train_shards"]) == (len(docs), 1, len(lengths) - 1)
    capped = _prepare(tmp_path / "capped", root, max_tokens=3 * SHARD + 123)  # stops inside a document
    assert np.array_equal(_shard_stream(capped), expected[: 3 * SHARD + 123]) and capped.meta["train_shards"] == 3
    with pytest.raises(DataError, match="not enough for a train shard .*; lower data.shard_tokens"):
        _prepare(tmp_path / "small", root, shard_tokens=10**6)
    # A pool of workers started fresh (spawn on macOS, forkserver from Python 3.14), where tiny_test_bpe isn't
    # registered: they get the encoding's ranks, and write the same bytes.
    monkeypatch.setattr(corpus, "START_METHOD", "spawn")
    assert _shard_files(_prepare(tmp_path / "two", root, num_proc=2)) == _shard_files(data)


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
    assert len(list(remade.dir.glob("*.bin"))) == remade.meta["train_shards"] + 1 < data.meta["train_shards"] + 1
    assert np.array_equal(_shard_stream(remade), _stream(docs[:5] + ["a shorter document"] + docs[6:24] + docs[-3:]))


_KILLED_WORKER = r"""
import contextlib, itertools, os, signal, sys, time
from pathlib import Path
import tiktoken
import data.corpus as corpus
from data.tokenizers import BpeTokenizer

ranks = {bytes([b]): b for b in range(256)}
encoding = tiktoken.Encoding("bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})
corpus.START_METHOD = "fork"  # the workers inherit the patched _encode
encode = corpus._encode

def encode_or_die(encoding, doc):
    if doc == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
    return [signal.getsignal(signal.SIGINT) == signal.SIG_IGN] if doc == "SIGINT?" else encode(encoding, doc)

def shards(docs, folder, max_tokens):
    start = time.monotonic()
    (Path(sys.argv[1]) / folder).mkdir()
    try:
        with contextlib.closing(corpus.encode_documents(docs, BpeTokenizer(encoding), 2)) as encoded:
            counts = corpus.write_shards(encoded, Path(sys.argv[1]) / folder, 1000, max_tokens)
        print(f"{counts['train_tokens'] + counts['val_tokens']} tokens in {time.monotonic() - start:.1f} s")
    except Exception as err:
        print(f"{type(err).__name__} in {time.monotonic() - start:.1f} s: {err}")

corpus._encode = encode_or_die
print("worker SIGINT ignored:", list(corpus.encode_documents(["SIGINT?"], BpeTokenizer(encoding), 2)) == [[True]])
shards(itertools.repeat("some text, " * 20), "capped", 5000)  # endless: only a bounded window is ever submitted
shards(["text"] * 5000 + ["die"] + ["text"] * 5000, "killed", None)
"""


def test_a_killed_worker_is_a_one_line_error_not_a_hang(tmp_path: Path) -> None:
    """multiprocessing.Pool.imap waits forever for a worker the OOM killer took; the executor's pool breaks."""
    result = subprocess.run([sys.executable, "-c", _KILLED_WORKER, str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)  # a hang fails here rather than stalling the suite
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[0] == "worker SIGINT ignored: True", result.stdout
    capped = re.fullmatch(r"5000 tokens in ([0-9.]+) s", lines[1])
    assert capped and float(capped[1]) < 10, lines[1]
    died = re.fullmatch(r"DataError in ([0-9.]+) s: an encoding process died \(out of memory\?\); lower .*", lines[2])
    assert died and float(died[1]) < 10, lines[2]


_ORPHAN_PARENT = """
import multiprocessing, os, time
from concurrent.futures import ProcessPoolExecutor
from data.corpus import exit_with_parent


def watch_then_say_so(parent):  # the pool's initializer; its PID on stdout once it watches
    exit_with_parent(parent, 0.1)
    print(os.getpid(), flush=True)


if __name__ == "__main__":
    context = multiprocessing.get_context("forkserver")  # Python 3.14's default on Linux: not the workers' parent
    pool = ProcessPoolExecutor(2, mp_context=context, initializer=watch_then_say_so, initargs=(os.getpid(),))
    futures = [pool.submit(time.sleep, 60) for i in range(2)]  # both busy: two workers start
    time.sleep(60)
"""


def test_encoding_workers_end_when_their_parent_is_killed(tmp_path: Path) -> None:
    """Workers of a parent killed with SIGKILL don't live on under PID 1. The parent is killed once both workers say
    they watch it, however slowly a busy machine started them."""
    script = tmp_path / "parent.py"  # a file, not -c: the forkserver's workers import its initializer from it
    script.write_text(_ORPHAN_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    workers = [int(parent.stdout.readline()) for _ in range(2)]
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def running(pid: int) -> bool:  # a zombie (ended, not yet reaped) is not running
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 120  # they look every 0.1 s: this bounds a hang, not a wait
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, workers))


def test_shards_hold_their_count_and_windows_come_from_every_shard_in_order_never_two(tmp_path: Path) -> None:
    sizes = [1000, 40, 2000, 600]  # distinct token values: a window's first token says where it came from
    starts = np.cumsum([0, *sizes])
    paths = tuple(tmp_path / f"train_{i:06d}.bin" for i in range(len(sizes)))
    for path, start, size in zip(paths, starts, sizes, strict=False):
        write_shard(path, np.arange(start, start + size, dtype=np.uint16))
    assert np.fromfile(paths[1], dtype=np.int32, count=3).tolist() == [MAGIC, VERSION, 40]  # llm.c's header
    assert paths[1].stat().st_size == HEADER_BYTES + 2 * 40 and read_shard(paths[1]).tolist() == list(range(1000, 1040))
    files = TokenFiles(paths, sharded=True)
    x, y = get_batch(files, 2000, 64, torch.Generator().manual_seed(1))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert torch.equal(get_batch(files, 2000, 64, torch.Generator().manual_seed(1))[0], x)  # the generator decides
    first, last = x[:, 0].numpy(), y[:, -1].numpy()
    assert np.array_equal(last - first, np.full(len(first), 64))  # consecutive tokens: never spans two shards
    shard_of = np.searchsorted(starts, first, side="right") - 1
    assert np.all(last < starts[shard_of + 1])
    assert set(shard_of.tolist()) == {0, 2, 3}  # the 40-token shard holds no 64-token window
    rows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in every_window(files, 7, 64)]
    expected = [s + np.arange(i * 64, (i + 1) * 64 + 1) for s, n in zip(starts, sizes, strict=False)
                for i in range((n - 1) // 64)]
    assert np.array_equal(torch.cat(rows).numpy(), np.stack(expected))  # each shard's windows, in order
    for damaged, message in ((paths[1].read_bytes()[:-2], "holds 39 tokens, its header says 40"),  # truncated
                             (b"\0" * 100, "is not a token shard"), (bytes(HEADER_BYTES), "is not a token shard")):
        paths[1].write_bytes(damaged)
        with pytest.raises(DataError, match=f"train_000001.bin {message}") as info:
            read_shard(paths[1])
        assert "\n" not in str(info.value)


def test_hf_streaming_path_gives_the_tokens_of_the_local_path_and_its_errors_say_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    root = tmp_path / "jsonl"
    docs = _write_docs(root, {"a.jsonl": TOPICS[:15], "b.jsonl": TOPICS[15:25]})
    streamed = _prepare(tmp_path / "hf", hf_dataset=str(root), num_proc=2)
    assert _shard_files(streamed) == _shard_files(_prepare(tmp_path / "local", root))
    assert np.array_equal(_shard_stream(streamed), _stream(docs))
    assert streamed.meta["source"] == {"hf_dataset": str(root), "hf_name": None}

    class Offline:
        @staticmethod
        def load_dataset(*args: object, **kwargs: object) -> None:
            raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub\n(details)")

    for module, message in ((None, r'.*pip install "\.\[hf\]"'), (Offline, r".*ConnectionError: Couldn't reach")):
        monkeypatch.setitem(sys.modules, "datasets", module)  # None: not installed
        with pytest.raises(DataError, match=r"data.hf_dataset=HuggingFaceFW/fineweb-edu \(data.hf_name=sample-10BT\)"
                           + message) as info:
            _prepare(tmp_path / "web", hf_dataset="HuggingFaceFW/fineweb-edu", hf_name="sample-10BT")
        assert "\n" not in str(info.value)


def test_bad_corpora_and_corpus_keys_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "doc.txt").write_text("text")
    for keys, message in (({"hf_name": "x"}, "data.hf_name=x needs data.hf_dataset"),
                          ({"shard_tokens": 0}, "data.shard_tokens=0"),
                          ({"hf_dataset": "x/y"}, "data.input and data.hf_dataset=x/y are both set")):
        with pytest.raises(ConfigError, match=message):
            _prepare(tmp_path / "data", tmp_path, **keys)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .txt or .jsonl files"):
        _prepare(tmp_path / "data", tmp_path / "empty")
    with pytest.raises(DataError, match="data.tokenizer=char can't encode a corpus.*r50k_base"):
        _prepare(tmp_path / "data", tmp_path, "char")
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(DataError, match=r'rows.jsonl:2 has no "text"'):
        _prepare(tmp_path / "data", tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(DataError, match=r"rows.jsonl:2 is not a JSON line"):
        _prepare(tmp_path / "data", tmp_path, num_proc=2)  # raised while a pool is reading the documents
    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"rows.jsonl is not UTF-8 text \(invalid continuation byte"):
        _prepare(tmp_path / "data", tmp_path)
    ranks = {bytes([b]): b for b in range(256)}
    no_eot = tiktoken.Encoding(name="no_eot", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "no_eot", no_eot)
    with pytest.raises(DataError, match=re.escape("data.tokenizer=no_eot has no <|endoftext|> token")):
        _prepare(tmp_path / "data", tmp_path, "no_eot")


def test_token_byte_lengths_add_up_to_the_utf8_bytes_of_the_text() -> None:
    text = "naïve café — 日本語 🙂\n" + TOPICS[0][:2000]
    for tokenizer in (CharTokenizer(sorted(set(text))), BpeTokenizer(tiny_encoding())):
        lengths = tokenizer.token_byte_lengths()
        assert lengths.shape == (tokenizer.vocab_size,) and lengths.dtype == np.int32
        assert lengths[tokenizer.encode(text)].sum() == len(text.encode())


def test_web_corpus_presets_stream_with_gpt2s_bpe() -> None:
    for preset, dataset, name in (("fineweb_edu", "HuggingFaceFW/fineweb-edu", "sample-10BT"),
                                  ("openwebtext", "Skylion007/openwebtext", None)):
        data = compose_config([f"data={preset}"]).data
        assert (data.hf_dataset, data.hf_name, data.tokenizer, data.shard_tokens) == (dataset, name, "r50k_base", 10**8)


@GPT2_RANKS
def test_prepare_command_shards_a_directory_with_gpt2s_bpe(tmp_path: Path, docs_dir: tuple[Path, list[str]]) -> None:
    root, docs = docs_dir
    args = [f"data.input={root}", "data.tokenizer=r50k_base", f"data.dir={tmp_path / 'data'}", "data.num_proc=2"]
    result = run_in_process("-m data.prepare", [*args, f"data.shard_tokens={SHARD}"], cwd=REPO)
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert f"{meta['train_tokens']:,} train and {SHARD:,} val tokens in" in result.stdout
    gpt2 = tiktoken.get_encoding("r50k_base")
    stream = _shard_stream(PreparedData(tmp_path / "data", meta))
    assert stream.tolist() == [t for d in docs for t in [50256, *gpt2.encode_ordinary(d)]]


def test_val_bits_per_byte_is_the_text_tokens_nats_over_their_bytes(
    tmp_path: Path, docs_dir: tuple[Path, list[str]]
) -> None:
    """Trained on the shards; bits per byte leaves <|endoftext|> (0 bytes) out of both sums, as nanochat."""
    root, _ = docs_dir
    extra = {"data.tokenizer": TINY_BPE, "data.shard_tokens": SHARD, "data.num_proc": 1, "train.full_val": True,
             "train.max_iters": 2, "train.eval_interval": 2}
    train(compose_config(tiny_run_overrides(tmp_path, root, **extra)))
    reported = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    model = load_checkpoint(tmp_path / "run" / CKPT_NAME).build_model().eval()
    encoding = tiny_encoding()
    nats, all_nats, tokens, n_bytes = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for x, y in every_window(_prepare(tmp_path / "data", root).val, 16, 32):
            losses = torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none")
            text = y.flatten() != encoding.eot_token
            nats += losses[text].sum().item()
            all_nats, tokens = all_nats + losses.sum().item(), tokens + y.numel()
            n_bytes += sum(len(encoding.decode_single_token_bytes(t)) for t in y.flatten()[text].tolist())
    assert nats < all_nats  # the val shard does hold document boundaries: the two sums differ
    assert reported["val_loss"] == pytest.approx(all_nats / tokens, rel=1e-5)
    assert reported["val_bpb"] == pytest.approx(nats / (np.log(2) * n_bytes), rel=1e-5)
