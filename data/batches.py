"""Training windows from one split's token files: train.bin alone, or a corpus's shards."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from data.shards import map_shard, read_shard


@dataclass(frozen=True)
class TokenFiles:
    """A split as an ordered list of token files: raw uint16 streams, or shards with a header.

    Files are opened per call: a long-lived memmap keeps every page it touched resident.
    """

    paths: tuple[Path, ...]
    sharded: bool = False

    def open(self, index: int) -> np.ndarray:
        path = self.paths[index]
        if self.sharded:  # its header was checked once, by lengths
            return map_shard(path, self.lengths[index])
        return np.memmap(path, dtype=np.uint16, mode="r")

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        """Read once: get_batch needs them on every call, and opening 100 shards costs milliseconds."""
        if self.sharded:
            return tuple(len(read_shard(path)) for path in self.paths)
        return tuple(path.stat().st_size // 2 for path in self.paths)  # uint16 tokens; an empty file is 0

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


TRAIN_WINDOWS, EVAL_WINDOWS = 0, 1  # batch_generator's second key: what the windows are for


def batch_generator(*keys: int) -> torch.Generator:
    """A generator determined by (seed, purpose, step, ...) alone, so batches don't depend on history:
    a resumed run sees exactly the windows the uninterrupted one would."""
    seed = int(np.random.SeedSequence(keys).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def get_batch(
    files: TokenFiles, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (batch_size, block_size), y shifted by one token.

    Window starts are drawn uniformly over all files' starts (no window spans two files), from the generator
    alone: the same generator state gives the same windows, whoever asks.
    """
    valid = np.maximum(np.asarray(files.lengths) - block_size, 0)  # starts in each file
    if valid.sum() == 0:
        raise ValueError(f"no file of {files.paths[0].parent} holds more than block_size={block_size} tokens")
    ends = np.cumsum(valid)
    starts = torch.randint(int(ends[-1]), (batch_size,), generator=generator).numpy()
    file_of = np.searchsorted(ends, starts, side="right")
    opened = {int(i): files.open(int(i)) for i in np.unique(file_of)}
    windows = [
        opened[int(f)][s - (ends[f] - valid[f]) :][: block_size + 1] for f, s in zip(file_of, starts, strict=True)
    ]
    batch = torch.from_numpy(np.stack(windows).astype(np.int64))
    return batch[:, :-1], batch[:, 1:]


def every_window(files: TokenFiles, batch_size: int, block_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """All consecutive non-overlapping windows of each file, in order and in batches: a full-split loss."""
    for index in range(len(files.paths)):
        data = files.open(index)
        n_windows = (len(data) - 1) // block_size
        for first in range(0, n_windows, batch_size):
            count = min(batch_size, n_windows - first)
            tokens = torch.from_numpy(data[first * block_size : (first + count) * block_size + 1].astype(np.int64))
            yield tokens[:-1].view(count, block_size), tokens[1:].view(count, block_size)
