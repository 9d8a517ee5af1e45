"""Keys and values of every layer for the tokens seen so far, so each new token costs one position."""

from __future__ import annotations

import torch

from model.config import GPTConfig

ROLL_SLACK = 64  # a windowed layer's spare slots: it moves its live tokens to the front once per this many steps


class LayerCache:
    """One layer's keys and values (2, B, n_head, slots, head_dim), oldest first.

    A full layer keeps every token, preallocated to block_size, so appending writes in place. A windowed layer
    needs only its last window - 1 tokens: its buffer holds twice that plus ROLL_SLACK (block_size at most), and
    when it fills, the live tokens move to the front and the rest is overwritten. Memory stays bounded however
    long generation runs, and the live part is always one contiguous, oldest-first slice, ready for the
    attention kernels.
    """

    def __init__(self, block_size: int, window: int | None) -> None:
        self.keep = None if window is None else window - 1  # earlier tokens a new query may still see
        self.slots = block_size if window is None else min(block_size, 2 * (window - 1) + ROLL_SLACK)
        self.buffer: torch.Tensor | None = None  # allocated on first use: batch, device and dtype as given
        self.stored = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the T new tokens' keys and values (B, n_head, T, head_dim); return those the new queries can
        see: every stored token for a full layer, the last window - 1 before the new ones for a windowed one."""
        T = k.size(2)
        if self.keep is not None and self.buffer is not None and self.stored + T > self.buffer.size(3):
            self._roll(T)
        if self.buffer is None:  # a prompt longer than the slots gets as many; the next roll shrinks them back
            B, n_head, _, head_dim = k.shape
            self.buffer = k.new_empty(2, B, n_head, max(self.slots, T), head_dim)
        end = self.stored + T
        self.buffer[0, :, :, self.stored : end] = k
        self.buffer[1, :, :, self.stored : end] = v
        start = 0 if self.keep is None else max(0, self.stored - self.keep)
        self.stored = end
        keys, values = self.buffer[:, :, :, start:end].unbind(0)
        return keys, values

    def _roll(self, n_new: int) -> None:
        """Move the tokens still in the window to the front of a buffer with room for n_new more."""
        assert self.buffer is not None and self.keep is not None
        kept = min(self.stored, self.keep)
        live = self.buffer[:, :, :, self.stored - kept : self.stored]
        slots = max(self.slots, kept + n_new)
        if slots != self.buffer.size(3):
            resized = self.buffer.new_empty(*self.buffer.shape[:3], slots, self.buffer.size(4))
            resized[:, :, :, :kept] = live
            self.buffer = resized
        else:
            self.buffer[:, :, :, :kept] = live.clone()  # source and destination may overlap
        self.stored = kept


class KVCache:
    """Every layer's LayerCache, and how many tokens the model has run (their positions)."""

    def __init__(self, config: GPTConfig) -> None:
        self.layers = [LayerCache(config.block_size, window) for window in config.layer_windows()]
        self.length = 0  # tokens already run; new queries sit at positions length, length + 1, ...
        self.last_token: torch.Tensor | None = None  # (B, 1): the newest token run, the bigram of the next

    @property
    def position(self) -> int:
        """The new tokens' first position (BatchKVCache: each row's)."""
        return self.length

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].extend(k, v)

    def key_mask(self, layer: int) -> None:
        """None: the returned keys end at the newest token, so the causal mask (or the window's band) applies."""
        return None

    def advance(self, new_tokens: torch.Tensor) -> None:
        """Called with the new tokens (B, T) once all layers have stored them."""
        self.length += new_tokens.size(1)
        self.last_token = new_tokens[:, -1:]
