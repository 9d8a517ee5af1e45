"""Keys and values for a batch of independent sequences (continuous batching), unlike KVCache's lockstep batch: each
row has its own length; it joins with the KVCache its prompt filled (add), decodes one token a step, and leaves.

Each layer's buffer is a ring of `slots` positions a row (position p at slot p % slots): block_size for a full layer,
`window` for a windowed one, so a rolling model's rows roll forever in bounded memory. Once a row writes its new key,
its filled slots hold exactly the keys its query may see, so its mask is just slot < min(length + 1, slots):
attention is order-free, and positions are already in the keys (rope) or the embeddings (learned)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model.attention import CausalSelfAttention, KVCache

if TYPE_CHECKING:
    from model.gpt import GPTConfig


class BatchKVCache:
    def __init__(self, config: GPTConfig) -> None:
        self.slots = [
            config.block_size if window is None else min(window, config.block_size)
            for window in config.layer_windows()
        ]
        self.buffers: list[torch.Tensor | None] = [None] * len(self.slots)  # (2, rows, n_head, slots, head_dim)
        self.lengths: list[int] = []  # tokens each row has run: its next token's position
        self.last_token: torch.Tensor | None = None  # (rows, 1): each row's newest token, the bigram of its next
        self._steps: dict[str, torch.Tensor] = {}  # per step, shared by the layers: positions, slot, mask

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """The longest row's: the model checks it against block_size."""
        return max(self.lengths, default=0)

    def add(self, prefilled: KVCache, row: int = 0) -> int:
        """A new row holding the keys and values of a prefilled KVCache's row `row`; its index."""
        length = prefilled.length
        for layer, (source, slots) in enumerate(zip(prefilled.layers, self.slots, strict=True)):
            assert source.buffer is not None
            first = length - source.stored  # the position of the source's first stored token (a rolled window's)
            buffer = self.buffers[layer]
            if buffer is None or buffer.size(1) == self.rows:  # full: room for as many rows again
                two, _, n_head, _, head_dim = source.buffer.shape
                grown = source.buffer.new_zeros(two, max(1, 2 * self.rows), n_head, slots, head_dim)
                if buffer is not None:
                    grown[:, : self.rows] = buffer[:, : self.rows]
                self.buffers[layer] = buffer = grown
            kept = torch.arange(max(first, length - slots), length, device=source.buffer.device)
            buffer[:, self.rows, :, kept % slots] = source.buffer[:, row, :, kept - first]
        assert prefilled.last_token is not None
        last = prefilled.last_token[row].reshape(1, 1)
        self.last_token = last if self.last_token is None else torch.cat((self.last_token, last))
        self.lengths.append(length)
        self._steps = {}
        return self.rows - 1

    def remove(self, row: int) -> None:
        """Drop a row: the last row moves into its place (callers renumber theirs the same way)."""
        last = self.rows - 1
        assert self.last_token is not None
        if row != last:
            for buffer in self.buffers:
                assert buffer is not None
                buffer[:, row] = buffer[:, last]
            self.last_token[row] = self.last_token[last]
            self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        self.last_token = self.last_token[:last]
        self._steps = {}

    @property
    def position(self) -> int | torch.Tensor:
        """Each row's new token's position, (rows, 1), made once a step; an int when every row is at the same one."""
        if "position" not in self._steps:
            if len(set(self.lengths)) == 1:
                return self.lengths[0]
            device = self.last_token.device if self.last_token is not None else None
            self._steps["position"] = torch.tensor(self.lengths, device=device).unsqueeze(1)
        return self._steps["position"]

    def attend(self, attn: CausalSelfAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each row's new token's attention over the keys its row may see."""
        position = self.position
        if attn.rotary is not None:
            q, k = attn.rotary(q, position), attn.rotary(k, position)
        k, v = self._extend(attn.layer_index, k, v)
        return attn.attend(q, k, v, self._key_mask(attn.layer_index))

    def _extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each row's new key and value (rows, n_head, 1, head_dim) in its slot; return every row's slots
        up to the furthest any row has filled."""
        assert k.size(2) == 1, "rows decode one token a step; prompts run alone, in a KVCache"
        buffer, slots = self.buffers[layer], self.slots[layer]
        assert buffer is not None
        position = self.position
        if isinstance(position, int):  # every row writes the same slot
            buffer[0, : self.rows, :, position % slots] = k[:, :, 0]
            buffer[1, : self.rows, :, position % slots] = v[:, :, 0]
        else:
            rows, slot = self._slots(slots)
            buffer[:, rows, :, slot] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)  # indexed dims come first
        used = min(slots, self.length + 1)
        keys, values = buffer[:, : self.rows, :, :used].unbind(0)
        return keys, values

    def _slots(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's index and the slot its new token goes to, in rings of `slots` (once a step per size)."""
        key = f"slot{slots}"
        if key not in self._steps:
            position = self._steps["position"][:, 0]
            self._steps[key] = torch.arange(self.rows, device=position.device)
            self._steps[key + "at"] = position % slots
        return self._steps[key], self._steps[key + "at"]

    def _key_mask(self, layer: int) -> torch.Tensor:
        """(rows, 1, 1, used): True where the row's query may attend (once a step per size)."""
        slots = self.slots[layer]
        key = f"mask{slots}"
        if key not in self._steps:
            assert self.last_token is not None
            filled = torch.tensor(self.lengths, device=self.last_token.device).add(1).clamp(max=slots)
            used = torch.arange(min(slots, self.length + 1), device=filled.device)
            self._steps[key] = (used < filled[:, None])[:, None, None, :]
        return self._steps[key]

    def advance(self, new_tokens: torch.Tensor) -> None:
        """Called with the step's tokens (rows, 1) once all layers have stored them."""
        self.lengths = [n + 1 for n in self.lengths]
        self.last_token = new_tokens[:, -1:]
        self._steps = {}
