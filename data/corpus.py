"""A corpus -> token shards val_000000.bin, train_000000.bin, ... Documents (a directory's .txt files and .jsonl lines'
"text", or a streamed Hugging Face dataset) become <|endoftext|> + their tokens, encoded by a process pool in order and
cut into fixed-size shards byte for byte as llm.c's fineweb.py does. No torch here: fresh workers import little."""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tiktoken
from tqdm import tqdm

from common.errors import DataError
from common.runtime import write_text_atomically
from data.source import read_utf8
from data.tokenizers import BpeTokenizer

if TYPE_CHECKING:  # data.prepare imports this module
    from data.prepare import DataConfig

# Token shard files: a 256-int32 header (magic, version, token count), then the tokens as uint16: llm.c's FineWeb
# shards' layout (dev/data/fineweb.py), so each reads the other's.
MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * np.dtype(np.int32).itemsize


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write beside the target and rename: a killed preparation never leaves a short shard."""
    if len(tokens) and int(tokens.max()) > np.iinfo(np.uint16).max:
        raise DataError(f"token id {int(tokens.max())} does not fit in a uint16 shard")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, len(tokens))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "xb") as f:  # exclusive: never through a link planted there
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16, copy=False).tobytes())
    os.replace(tmp, path)


def read_shard(path: Path) -> np.memmap:
    """The shard's tokens, memory-mapped, after checking the header against the file's size."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS) if size >= HEADER_BYTES else None
    if header is None or header[0] != MAGIC or header[1] != VERSION:
        raise DataError(f"{path} is not a token shard (version {VERSION}); delete {path.parent} to prepare it again")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise DataError(f"{path} holds {(size - HEADER_BYTES) // 2} tokens, its header says {count}; delete "
                        f"{path.parent} to prepare it again")
    return map_shard(path, count)


def map_shard(path: Path, count: int) -> np.memmap:
    """The tokens of a shard already checked by read_shard, without reading its header again."""
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))


DOCUMENT_SUFFIXES = (".txt", ".jsonl")
_CHUNKSIZE = 16  # documents per task sent to a worker, as in llm.c's fineweb.py
_CHUNKS_IN_FLIGHT = 4  # per worker: enough to keep each busy, few enough that the stream never sits in memory
START_METHOD: str | None = None  # multiprocessing's: None is the platform's default (fork on Linux before 3.14)


def default_num_proc() -> int:
    """The CPUs this process may use, less one for the process that feeds them."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus - 1)


def document_files(root: Path) -> list[Path]:
    """The .txt and .jsonl files under root, in the order of their relative paths: the corpus's document order."""
    files = [p for p in root.rglob("*") if p.suffix in DOCUMENT_SUFFIXES and p.is_file()]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"data.input={root} holds no .txt or .jsonl files; put the corpus's documents there")
    return files


def local_documents(root: Path) -> Iterator[str]:
    for path in document_files(root):
        if path.suffix == ".txt":
            yield read_utf8(path)
        else:
            yield from _jsonl_documents(path)


def _jsonl_documents(path: Path) -> Iterator[str]:
    """Line by line, split at newlines only (str.splitlines also cuts at U+2028, which JSON strings may hold raw)."""
    number = 0
    try:
        with open(path, encoding="utf-8", newline="\n") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield _text_field(_json_line(line, path, number), f"{path}:{number}")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} after line {number})") from None


def hf_documents(path: str, name: str | None) -> Iterator[str]:
    """The "text" of each row of the dataset's train split, streamed: nothing is downloaded ahead."""
    try:
        import datasets
    except ImportError:
        raise DataError(f'data.hf_dataset={path} needs the datasets package: pip install ".[hf]"') from None
    label = f"data.hf_dataset={path}" + (f" (data.hf_name={name})" if name else "")
    try:
        rows = iter(datasets.load_dataset(path, name=name, split="train", streaming=True))
    except Exception as err:  # offline, a misspelt name, a private dataset: datasets raises many kinds
        raise DataError(f"could not load {label}: {_first_line(err)}; offline, use data.input=DIR instead") from None
    return _rows_text(rows, label)


def _rows_text(rows: Iterator[dict[str, Any]], label: str) -> Iterator[str]:
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as err:  # the stream broke off (network)
            raise DataError(f"reading {label} failed: {_first_line(err)}") from None
        yield _text_field(row, label)


def source_fingerprint(input: str | None, hf_dataset: str | None, hf_name: str | None) -> dict[str, Any]:
    """What the shards were made from: a dataset's name, or the files' paths, sizes and mtimes (not their contents)."""
    if hf_dataset:
        return {"hf_dataset": hf_dataset, "hf_name": hf_name}
    root = Path(os.path.expanduser(input))  # type: ignore[arg-type]
    listing = [(p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in document_files(root)]
    return {"files_sha256": hashlib.sha256(json.dumps(listing).encode()).hexdigest(), "files": len(listing)}


def fingerprint(config: DataConfig) -> dict[str, Any]:
    """What a corpus's shards are made from and how: meta.json's record, against which a folder is reused."""
    return {
        "source": source_fingerprint(config.input, config.hf_dataset, config.hf_name),
        "tokenizer_spec": config.tokenizer,
        "shard_tokens": config.shard_tokens,
        "max_tokens": config.max_tokens,
    }


def prepare_corpus(config: DataConfig, fingerprint: dict[str, Any], into: Path) -> dict[str, Any]:
    """The corpus's shards written into the folder `into`; their meta."""
    bpe = corpus_tokenizer(config.tokenizer)
    hf = config.hf_dataset
    documents = hf_documents(hf, config.hf_name) if hf else local_documents(Path(config.input))  # type: ignore[arg-type]
    procs = config.num_proc or default_num_proc()
    return write_corpus(documents, bpe, into, config.shard_tokens, config.max_tokens, procs, fingerprint)


def corpus_tokenizer(spec: str) -> BpeTokenizer:
    if spec == "char":
        raise DataError("data.tokenizer=char can't encode a corpus (its vocabulary would need every character "
                        "first); use a BPE such as data.tokenizer=r50k_base")
    tokenizer = BpeTokenizer.from_name(spec)
    _ = tokenizer.eot_token  # fails here if there is none: a worker that fails to start is restarted forever
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise DataError(f"data.tokenizer={spec} has {tokenizer.vocab_size} tokens, too many for uint16 shards")
    return tokenizer


class DocumentEncoder:
    """<|endoftext|> + the tokens of each document, in document order, from num_proc processes (1: this one). The
    workers get the encoding's ranks, not its name, which a fresh worker (spawn, forkserver) may not know."""

    def __init__(self, tokenizer: BpeTokenizer, num_proc: int) -> None:
        self.tokenizer, self.num_proc = tokenizer, num_proc
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> DocumentEncoder:
        if self.num_proc > 1:
            self._pool = ProcessPoolExecutor(self.num_proc, mp_context=multiprocessing.get_context(START_METHOD),
                                             initializer=_init_worker,
                                             initargs=(_encoding_args(self.tokenizer), os.getpid()))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            # also when stopped early (data.max_tokens, an error): the chunks not yet started are dropped
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def encode(self, documents: Iterable[str]) -> Iterator[np.ndarray]:
        if self._pool is None:
            encoding, eot = self.tokenizer.encoding, self.tokenizer.eot_token
            return (_encode(encoding, eot, doc) for doc in documents)
        return self._encode_in_pool(self._pool, documents)

    def _encode_in_pool(self, pool: ProcessPoolExecutor, documents: Iterable[str]) -> Iterator[np.ndarray]:
        """Chunks of documents submitted ahead, a bounded window of them, and their results taken in order."""
        in_flight: deque[Future[list[np.ndarray]]] = deque()
        documents = iter(documents)
        try:
            while chunk := list(itertools.islice(documents, _CHUNKSIZE)):
                if len(in_flight) >= _CHUNKS_IN_FLIGHT * self.num_proc:
                    yield from in_flight.popleft().result()
                in_flight.append(pool.submit(_encode_chunk_in_worker, chunk))
            while in_flight:
                yield from in_flight.popleft().result()
        except BrokenProcessPool:
            raise DataError(f"an encoding process died (out of memory?); lower data.num_proc={self.num_proc} and "
                            "prepare again") from None


_worker: tuple[tiktoken.Encoding, int] | None = None


def _encoding_args(tokenizer: BpeTokenizer) -> dict[str, Any]:
    enc = tokenizer.encoding
    # tiktoken's own pickled form of an unregistered encoding (Encoding.__getstate__)
    return {"name": enc.name, "pat_str": enc._pat_str, "mergeable_ranks": enc._mergeable_ranks,
            "special_tokens": enc._special_tokens}


def _init_worker(encoding_args: dict[str, Any], main: int) -> None:
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: one KeyboardInterrupt, the main process's
    exit_with_parent(main)
    encoding = tiktoken.Encoding(**encoding_args)
    _worker = (encoding, encoding.eot_token)


def exit_with_parent(main: int, every_s: float = 0.5) -> None:
    """End this worker once `main`, its pool's maker, is gone (not getppid: a forkserver is its workers' parent)."""

    def gone() -> bool:
        try:
            os.kill(main, 0)
        except (ProcessLookupError, PermissionError):  # PermissionError: the PID reused by someone else's process
            return True
        return False

    def watch() -> None:
        while not gone():
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _encode_chunk_in_worker(docs: list[str]) -> list[np.ndarray]:
    assert _worker is not None, "worker not initialized"
    return [_encode(*_worker, doc) for doc in docs]


def _encode(encoding: tiktoken.Encoding, eot: int, doc: str) -> np.ndarray:
    tokens = [eot]
    tokens.extend(encoding.encode_ordinary(doc))  # a literal "<|endoftext|>" in the text is plain text
    return np.asarray(tokens, dtype=np.uint16)  # the vocabulary was checked to fit


def write_shards(
    token_docs: Iterable[np.ndarray], out_dir: Path, shard_tokens: int, max_tokens: int | None
) -> dict[str, int]:
    """Shards of shard_tokens tokens (the first val, the last maybe short) up to max_tokens; counts for meta.json."""
    buffer = np.empty(shard_tokens, dtype=np.uint16)
    filled = shards = documents = total = 0
    counts = {"val_tokens": 0, "train_tokens": 0}

    def flush() -> None:
        nonlocal filled, shards
        split, index = ("val", 0) if shards == 0 else ("train", shards - 1)
        write_shard(out_dir / f"{split}_{index:06d}.bin", buffer[:filled])
        counts[f"{split}_tokens"] += filled
        shards, filled = shards + 1, 0

    with tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="tokenizing") as bar:
        for tokens in token_docs:
            if max_tokens is not None:
                tokens = tokens[: max_tokens - total]
            documents += 1
            total += len(tokens)
            bar.update(len(tokens))
            while len(tokens):
                take = min(len(tokens), shard_tokens - filled)
                buffer[filled : filled + take] = tokens[:take]
                filled, tokens = filled + take, tokens[take:]
                if filled == shard_tokens:
                    flush()
            if max_tokens is not None and total >= max_tokens:
                break
    if filled:
        flush()
    if shards < 2:
        raise DataError(f"the corpus gave {total:,} tokens, not enough for a train shard after the val shard "
                        f"(data.shard_tokens={shard_tokens}); lower data.shard_tokens")
    return {**counts, "val_shards": 1, "train_shards": shards - 1, "documents": documents}


def write_corpus(documents: Iterable[str], tokenizer: BpeTokenizer, out_dir: Path, shard_tokens: int,
                 max_tokens: int | None, num_proc: int, extra_meta: dict[str, Any]) -> dict[str, Any]:
    """Encode and shard the documents, then write meta.json (last, atomically: only then is the folder prepared)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with DocumentEncoder(tokenizer, num_proc) as encoder:
        counts = write_shards(encoder.encode(documents), out_dir, shard_tokens, max_tokens)
    meta = {"tokenizer": tokenizer.metadata(), "vocab_size": tokenizer.vocab_size, "sharded": True, **counts,
            **extra_meta}
    write_text_atomically(out_dir / "meta.json", json.dumps(meta, ensure_ascii=False))
    return meta


def _json_line(line: str, path: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number} is not a JSON line ({err.msg}); each line must be an object") from None


def _text_field(row: Any, where: str) -> str:
    text = row.get("text") if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise DataError(f'{where} has no "text" string; each document needs one')
    return text


def _first_line(err: BaseException) -> str:
    message = str(err).strip().splitlines()
    return f"{type(err).__name__}: {message[0]}" if message else type(err).__name__
