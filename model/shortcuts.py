"""What a block reads besides the residual stream: Shortcuts (the input embeddings for x0_mix, the token ids for
value_embeds; value_residual's values travel beside it), and the bigram embedding of (previous token, token) pairs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from model.gpt import GPTConfig


@dataclass(frozen=True)
class Shortcuts:
    """Read, never written, by every block: value_residual's first-layer values travel as a block's argument and
    return: FSDP2 copies arguments (dropping writes), and a write breaks torch.compile's graph under checkpointing."""

    x0: torch.Tensor  # the input embeddings (B, T, C), after dropout
    idx: torch.Tensor  # the token ids (B, T)


class BigramEmbedding(nn.Module):
    """A row per (previous token, token) pair, so pair statistics needn't be learnt through attention. Row
    vocab_size * vocab_size + token: no previous token; past GPTConfig.bigram_rows, pairs share rows (id modulo)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.table = nn.Embedding(config.bigram_rows, config.n_embd)

    def forward(self, idx: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """Embeddings (B, T, n_embd) of idx (B, T); previous (B, 1): the token before idx[:, 0], if any."""
        before = torch.full_like(idx[:, :1], self.vocab_size) if previous is None else previous
        pairs = torch.cat((before, idx[:, :-1]), dim=1) * self.vocab_size + idx
        return self.table(pairs % self.table.num_embeddings)
