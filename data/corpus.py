"""A corpus -> token shards val_000000.bin, train_000000.bin, ... as llm.c's fineweb.py: each document (a .txt file, a
.jsonl line's or a Hugging Face row's "text") becomes <|endoftext|> + its tokens. No torch: workers import little."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import sys
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

from common.errors import DataError, first_line
from data.source import read_utf8
from data.tokenizers import BpeTokenizer

if TYPE_CHECKING:  # data.prepare imports this module
    from data.prepare import DataConfig

# A shard has llm.c's FineWeb layout (dev/data/fineweb.py), so each reads the other's: a 256-int32 header (magic,
# version, token count), then the tokens as uint16.
MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * np.dtype(np.int32).itemsize
_CHUNKSIZE = 16  # documents per task sent to a worker, as in llm.c's fineweb.py
_CHUNKS_IN_FLIGHT = 4  # per worker: enough to keep each busy, few enough that the stream never sits in memory
START_METHOD: str | None = None  # multiprocessing's: None is the platform's default (fork on Linux before 3.14)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """A new shard in the preparation's own folder, which becomes the dataset's only once meta.json is written."""
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, len(tokens))
    with open(path, "xb") as f:  # exclusive: never through a link planted there
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16, copy=False).tobytes())


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


def default_num_proc() -> int:
    """The CPUs this process may use, less one for the process that feeds them."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus - 1)


def document_files(root: Path) -> list[Path]:
    """The .txt and .jsonl files under root, in the order of their relative paths: the corpus's document order."""
    files = [p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file()]
    if not files:
        raise DataError(f"data.input={root} holds no .txt or .jsonl files; put the corpus's documents there")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def local_documents(root: Path) -> Iterator[str]:
    """Each .txt file whole, and each line of each .jsonl split at newlines only (str.splitlines also cuts at U+2028,
    which JSON strings may hold raw)."""
    for path in document_files(root):
        if path.suffix == ".txt":
            yield read_utf8(path)
            continue
        number = 0
        try:
            with open(path, encoding="utf-8", newline="\n") as lines:
                for number, line in enumerate(lines, start=1):
                    if line.strip():
                        yield _text_field(json.loads(line), f"{path}:{number}")
        except UnicodeDecodeError as err:
            raise DataError(f"{path} is not UTF-8 text ({err.reason} after line {number})") from None
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number} is not a JSON line ({err.msg}); each line must be an object") from None


def hf_documents(path: str, name: str | None) -> Iterator[str]:
    """The "text" of each row of the dataset's train split, streamed: nothing is downloaded ahead."""
    label = f"data.hf_dataset={path}" + (f" (data.hf_name={name})" if name else "")
    try:
        import datasets
    except ImportError:
        raise DataError(f'{label} needs the datasets package: pip install ".[hf]"') from None
    try:
        for row in datasets.load_dataset(path, name=name, split="train", streaming=True):
            yield _text_field(row, label)
    except DataError:
        raise
    except Exception as err:  # offline, a misspelt or private dataset, a broken stream: datasets raises many kinds
        raise DataError(f"could not read {label} ({first_line(err, named=True)}); offline, use "
                        "data.input=DIR instead") from None


def _text_field(row: Any, where: str) -> str:
    text = row.get("text") if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise DataError(f'{where} has no "text" string; each document needs one')
    return text


def fingerprint(config: DataConfig) -> dict[str, Any]:
    """meta.json's record of what the shards are made from and how (files by path, size and mtime, not content)."""
    if config.hf_dataset:
        source = {"hf_dataset": config.hf_dataset, "hf_name": config.hf_name}
    else:
        root = Path(config.input)  # type: ignore[arg-type]
        files = document_files(root)
        listing = [(p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        source = {"files_sha256": hashlib.sha256(json.dumps(listing).encode()).hexdigest(), "files": len(listing)}
    return {"source": source, "tokenizer_spec": config.tokenizer, "shard_tokens": config.shard_tokens,
            "max_tokens": config.max_tokens}


def prepare_corpus(config: DataConfig, into: Path) -> dict[str, Any]:
    """The corpus's shards written into the folder `into`; the tokenizer and the counts."""
    if config.tokenizer == "char":
        raise DataError("data.tokenizer=char can't encode a corpus (its vocabulary would need every character "
                        "first); use a BPE such as data.tokenizer=r50k_base")
    tokenizer = BpeTokenizer.from_name(config.tokenizer)
    if tokenizer.end_of_text_id is None:  # checked here: a worker that fails to start is restarted forever
        raise DataError(f"data.tokenizer={config.tokenizer} has no <|endoftext|> token to separate documents; use one "
                        "that has, such as r50k_base")
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise DataError(f"data.tokenizer={config.tokenizer} has {tokenizer.vocab_size} tokens, too many for uint16 "
                        "shards")
    hf = config.hf_dataset
    documents = hf_documents(hf, config.hf_name) if hf else local_documents(Path(config.input))  # type: ignore[arg-type]
    with contextlib.closing(encode_documents(documents, tokenizer, config.num_proc or default_num_proc())) as encoded:
        counts = write_shards(encoded, into, config.shard_tokens, config.max_tokens)
    return {"tokenizer": tokenizer.metadata(), "vocab_size": tokenizer.vocab_size, "sharded": True, **counts}


def encode_documents(documents: Iterable[str], tokenizer: BpeTokenizer, num_proc: int) -> Iterator[np.ndarray]:
    """<|endoftext|> + the tokens of each document, in order, from num_proc processes (1: this one), a window ahead."""
    if num_proc == 1:
        yield from (_encode(tokenizer.encoding, doc) for doc in documents)
        return
    enc = tokenizer.encoding  # sent as its ranks (tiktoken's own pickled form): a fresh worker may not know its name
    ranks = {"name": enc.name, "pat_str": enc._pat_str, "mergeable_ranks": enc._mergeable_ranks,
             "special_tokens": enc._special_tokens}
    pool = ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context(START_METHOD),
                               initializer=_init_worker, initargs=(ranks, os.getpid()))
    in_flight: deque[Future[list[np.ndarray]]] = deque()
    documents = iter(documents)
    try:
        while chunk := list(itertools.islice(documents, _CHUNKSIZE)):
            if len(in_flight) >= _CHUNKS_IN_FLIGHT * num_proc:
                yield from in_flight.popleft().result()
            in_flight.append(pool.submit(_encode_chunk, chunk))
        while in_flight:
            yield from in_flight.popleft().result()
    except BrokenProcessPool:
        raise DataError(f"an encoding process died (out of memory?); lower data.num_proc={num_proc} and prepare "
                        "again") from None
    finally:  # also when stopped early (data.max_tokens, an error): the chunks not yet started are dropped
        pool.shutdown(wait=True, cancel_futures=True)


_worker: tiktoken.Encoding  # set in each worker by _init_worker


def _init_worker(encoding_args: dict[str, Any], main: int) -> None:
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: one KeyboardInterrupt, the main process's
    exit_with_parent(main)
    _worker = tiktoken.Encoding(**encoding_args)


def exit_with_parent(main: int, every_s: float = 0.5) -> None:
    """End this worker once `main`, its pool's maker, is gone (not getppid: a forkserver is its workers' parent)."""

    def watch() -> None:
        while True:
            try:
                os.kill(main, 0)
            except (ProcessLookupError, PermissionError):  # PermissionError: the PID reused by someone else's process
                os._exit(1)
            time.sleep(every_s)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _encode_chunk(docs: list[str]) -> list[np.ndarray]:
    return [_encode(_worker, doc) for doc in docs]


def _encode(encoding: tiktoken.Encoding, doc: str) -> np.ndarray:
    # A literal "<|endoftext|>" in the text is plain text; the vocabulary was checked to fit uint16.
    return np.asarray([encoding.eot_token, *encoding.encode_ordinary(doc)], dtype=np.uint16)


def write_shards(token_docs: Iterable[np.ndarray], out_dir: Path, shard_tokens: int,
                 max_tokens: int | None) -> dict[str, int]:
    """Shards of shard_tokens tokens (the first val, the last maybe short) up to max_tokens; counts for meta.json."""
    buffer = np.empty(shard_tokens, dtype=np.uint16)
    filled = documents = total = 0
    limit = sys.maxsize if max_tokens is None else max_tokens
    lengths: list[int] = []  # of the shards written, val's first

    def flush() -> None:
        split, index = ("train", len(lengths) - 1) if lengths else ("val", 0)
        write_shard(out_dir / f"{split}_{index:06d}.bin", buffer[:filled])
        lengths.append(filled)

    with tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="tokenizing") as bar:
        for tokens in token_docs:
            tokens = tokens[: limit - total]
            documents, total = documents + 1, total + len(tokens)
            bar.update(len(tokens))
            while len(tokens):
                take = min(len(tokens), shard_tokens - filled)
                buffer[filled : filled + take] = tokens[:take]
                filled, tokens = filled + take, tokens[take:]
                if filled == shard_tokens:
                    flush()
                    filled = 0
            if total >= limit:
                break
    if filled:
        flush()
    if len(lengths) < 2:
        raise DataError(f"the corpus gave {total:,} tokens, not enough for a train shard after the val shard "
                        f"(data.shard_tokens={shard_tokens}); lower data.shard_tokens")
    return {"val_tokens": lengths[0], "train_tokens": sum(lengths[1:]), "val_shards": 1,
            "train_shards": len(lengths) - 1, "documents": documents}
