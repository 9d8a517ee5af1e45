"""Causal multi-head self-attention, with a fused (flash) path and the textbook (math) path."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import GPTConfig
from model.kv_cache import KVCache
from model.rotary import Rotary


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QKᵀ/√d_k, masked to -inf where `mask` is False) @ V, for m queries against n keys.

    q: (..., m, d); k, v: (..., n, d); mask: boolean, broadcastable to (..., m, n), True where a
    query may attend: causal, a KV-cache decode, cross-attention or a sliding window are all masks.
    Returns the output and the (pre-dropout) attention weights, whose rows sum to 1.
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
    """Both paths share the same parameters, so weights trained with one run with the other.

    `captured`: while it is a list (GPT.attention_weights sets it), every call runs the math path and appends
    its softmax weights (B, n_head, T, n_keys) there; the output is the same either way.
    """

    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.attn_impl = config.attn_impl
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        head_size = config.n_embd // config.n_head
        self.rotary = Rotary(head_size, config.block_size) if config.pos_emb == "rope" else None
        self.captured: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x: (B, T, C) for T new tokens, after the cache's tokens if a cache is given."""
        B, T, C = x.shape
        # (3, B, n_head, T, head_dim): one reshape for queries, keys and values
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        n_past = 0 if cache is None else cache.length
        if self.rotary is not None:
            q, k = self.rotary(q, n_past), self.rotary(k, n_past)
        if cache is not None:
            k, v = cache.extend(self.layer_index, k, v)
        dropout_p = self.dropout if self.training else 0.0
        if self.attn_impl == "math" or self.captured is not None:
            y, weights = masked_attention(q, k, v, causal_mask(T, n_past + T, x.device), dropout_p)
            if self.captured is not None:
                self.captured.append(weights)
        elif n_past == 0:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        elif T == 1:
            # is_causal aligns the mask to the first key; a single query after the cache may see every key.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:
            raise ValueError("the flash path extends a non-empty KV cache one token at a time")
        y = y.transpose(1, 2).reshape(B, T, C)
        return F.dropout(self.c_proj(y), dropout_p)
