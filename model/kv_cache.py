"""Keys and values of every layer for the tokens seen so far, so each new token costs one position."""

from __future__ import annotations

import torch

from model.config import GPTConfig


class LayerCache:
    """One layer's keys and values (2, B, n_head, capacity, head_dim), oldest first.

    A full layer keeps every token, preallocated to block_size, so appending writes in place. A windowed
    layer needs only its last window - 1 tokens: when the buffer fills, those move to its front and the rest
    is overwritten, so memory stays bounded however long generation runs (a rolling buffer whose live part
    is always one contiguous, oldest-first slice, ready for the attention kernels).
    """

    def __init__(self, block_size: int, window: int | None) -> None:
        self.keep = None if window is None else window - 1  # earlier tokens a new query may still see
        self.capacity = block_size if window is None else block_size + window
        self.buffer: torch.Tensor | None = None  # allocated on first use: batch, device and dtype as given
        self.stored = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the T new tokens' keys and values (B, n_head, T, head_dim); return those the new queries can
        see: every stored token for a full layer, the last window - 1 before the new ones for a windowed one."""
        T = k.size(2)
        if self.keep is not None and self.stored + T > self.capacity:
            self._roll(T)
        if self.buffer is None:
            B, n_head, _, head_dim = k.shape
            self.buffer = k.new_empty(2, B, n_head, self.capacity, head_dim)
        end = self.stored + T
        self.buffer[0, :, :, self.stored : end] = k
        self.buffer[1, :, :, self.stored : end] = v
        start = 0 if self.keep is None else max(0, self.stored - self.keep)
        self.stored = end
        keys, values = self.buffer[:, :, :, start:end].unbind(0)
        return keys, values

    def _roll(self, n_new: int) -> None:
        """Move the tokens still in the window to the front; grow if n_new tokens would still not fit."""
        assert self.keep is not None
        kept = min(self.stored, self.keep)
        if self.buffer is not None and kept:
            self.buffer[:, :, :, :kept] = self.buffer[:, :, :, self.stored - kept : self.stored].clone()
        self.stored = kept
        if kept + n_new > self.capacity:
            self.capacity = kept + n_new
            self.buffer = None if self.buffer is None else _grown(self.buffer, self.capacity, kept)


def _grown(buffer: torch.Tensor, capacity: int, n_live: int) -> torch.Tensor:
    bigger = buffer.new_empty(*buffer.shape[:3], capacity, buffer.size(4))
    bigger[:, :, :, :n_live] = buffer[:, :, :, :n_live]
    return bigger


class KVCache:
    """Every layer's LayerCache, and how many tokens the model has run (their positions)."""

    def __init__(self, config: GPTConfig) -> None:
        self.layers = [LayerCache(config.block_size, window) for window in config.layer_windows()]
        self.length = 0  # tokens already run; new queries sit at positions length, length + 1, ...

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].extend(k, v)

    def advance(self, n_tokens: int) -> None:
        """Called once all layers have stored the new tokens."""
        self.length += n_tokens
