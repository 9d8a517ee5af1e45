"""Keys and values of every layer for the tokens seen so far, so each new token costs one position."""

from __future__ import annotations

import torch

from model.config import GPTConfig


class KVCache:
    """Preallocated to block_size: appending writes in place instead of concatenating every step."""

    def __init__(self, config: GPTConfig) -> None:
        self.capacity = config.block_size
        self.kv: list[torch.Tensor | None] = [None] * config.n_layer  # per layer: (2, B, n_head, capacity, head_dim)
        self.length = 0  # tokens already cached; new queries sit at positions length, length + 1, ...

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's keys and values (B, n_head, T, head_dim) for the T new tokens; return the keys
        and the values of every cached token."""
        if self.kv[layer] is None:  # allocated on first use: batch, device and dtype (autocast) as given
            B, n_head, _, head_dim = k.shape
            self.kv[layer] = k.new_empty(2, B, n_head, self.capacity, head_dim)
        buffer, end = self.kv[layer], self.length + k.size(2)
        buffer[0, :, :, self.length : end] = k
        buffer[1, :, :, self.length : end] = v
        keys, values = buffer[:, :, :, :end].unbind(0)
        return keys, values

    def advance(self, n_tokens: int) -> None:
        """Called once all layers have stored the new tokens."""
        self.length += n_tokens
