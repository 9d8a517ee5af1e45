"""What a block reads besides the residual stream, for the options that reach past the layer before: the input
embeddings (x0_mix) and the token ids (value_embeds); value_residual's first-layer values travel beside them (see
Shortcuts). And the bigram embedding, which makes the input embeddings of (previous token, token) pairs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from model.gpt import GPTConfig


@dataclass(frozen=True)
class Shortcuts:
    """Read, never written, by every block. The first layer's values (value_residual) travel apart, as a block's
    argument and its return: a wrapper that copies the blocks' arguments (FSDP2) would drop a value written into
    this object, and under torch.compile with activation checkpointing such a write broke the graph."""

    x0: torch.Tensor  # the input embeddings (B, T, C), after dropout
    idx: torch.Tensor  # the token ids (B, T)


class BigramEmbedding(nn.Module):
    """A row per (previous token, token) pair, so the model starts from the pair's statistics instead of
    learning them through attention. Row vocab_size * vocab_size + token is "no previous token" (a sequence's
    first). With more pairs than GPTConfig.bigram_rows, pairs share rows by their id modulo that."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.table = nn.Embedding(config.bigram_rows, config.n_embd)

    def forward(self, idx: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """Embeddings (B, T, n_embd) of idx (B, T); previous (B, 1): the token before idx[:, 0], if any."""
        before = torch.full_like(idx[:, :1], self.vocab_size) if previous is None else previous
        pairs = torch.cat((before, idx[:, :-1]), dim=1) * self.vocab_size + idx
        return self.table(pairs % self.table.num_embeddings)
