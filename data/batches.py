"""Random training windows from a uint16 token file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch


def num_tokens(bin_path: Path) -> int:
    return bin_path.stat().st_size // np.dtype(np.uint16).itemsize


def get_batch(
    bin_path: Path, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (batch_size, block_size), y shifted by one token.

    The memmap is opened per call: a long-lived one keeps every page it touched resident.
    """
    data = np.memmap(bin_path, dtype=np.uint16, mode="r")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator).tolist()
    windows = np.stack([data[s : s + block_size + 1] for s in starts]).astype(np.int64)
    windows = torch.from_numpy(windows)
    return windows[:, :-1], windows[:, 1:]


def every_window(bin_path: Path, batch_size: int, block_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """All consecutive non-overlapping windows of the file, in order and in batches: a full-split loss."""
    data = np.memmap(bin_path, dtype=np.uint16, mode="r")
    n_windows = (len(data) - 1) // block_size
    for first in range(0, n_windows, batch_size):
        count = min(batch_size, n_windows - first)
        tokens = torch.from_numpy(data[first * block_size : (first + count) * block_size + 1].astype(np.int64))
        yield tokens[:-1].view(count, block_size), tokens[1:].view(count, block_size)
