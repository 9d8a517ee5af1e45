"""Token shard files for corpora too big for one file: a 256-int32 header (magic, version, token count),
then the tokens as uint16: the layout of llm.c's FineWeb shards (dev/data/fineweb.py), so each reads the other's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from data.errors import DataError

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
        raise DataError(f"{path} is not a token shard (version {VERSION}); prepare the data again")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise DataError(f"{path} holds {(size - HEADER_BYTES) // 2} tokens, its header says {count}; prepare again")
    return map_shard(path, count)


def map_shard(path: Path, count: int) -> np.memmap:
    """The tokens of a shard already checked by read_shard, without reading its header again."""
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))
