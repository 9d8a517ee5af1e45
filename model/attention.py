"""Causal multi-head self-attention, with a fused (flash) path and the textbook (math) path."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import GPTConfig


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QKᵀ/√d_k, masked to -inf where `mask` is False) @ V, for m queries against n keys.

    q: (..., m, d); k, v: (..., n, d); mask: boolean, broadcastable to (..., m, n), True where a
    query may attend. Returns the output and the (pre-dropout) attention weights, whose rows sum to 1.
    This is the only place the formula is written out.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return F.dropout(weights, p=dropout_p) @ v, weights


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Lower-triangular mask for queries that are the last `n_queries` of `n_keys` positions."""
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    return ones.tril(diagonal=n_keys - n_queries)


class CausalSelfAttention(nn.Module):
    """Both paths share the same parameters, so weights trained with one run with the other."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attn_impl = config.attn_impl
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for t in self.c_attn(x).split(self.n_embd, dim=2)
        )
        dropout_p = self.dropout if self.training else 0.0
        if self.attn_impl == "flash":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y, _ = masked_attention(q, k, v, causal_mask(T, T, x.device), dropout_p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))
