"""Causal multi-head self-attention, with a fused (flash) path and the textbook (math) path, over all earlier
tokens or a sliding window of them."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.batch_cache import BatchKVCache
from model.config import GPTConfig
from model.kv_cache import KVCache
from model.rotary import Rotary
from model.shortcuts import Shortcuts

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


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


def causal_mask(
    n_queries: int, n_keys: int, device: torch.device | str | None = None, window: int | None = None
) -> torch.Tensor:
    """Lower-triangular mask for queries that are the last `n_queries` of `n_keys` positions; with a window,
    a band: query position i sees keys i - window + 1 .. i."""
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    mask = ones.tril(diagonal=n_keys - n_queries)
    if window is not None:
        mask &= ones.triu(diagonal=n_keys - n_queries - window + 1)
    return mask


QUERY_BLOCK = 64  # queries per SDPA call off CUDA: smaller blocks waste fewer keys, but each call has overhead


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dropout_p: float = 0.0
) -> torch.Tensor:
    """Fused attention under the sliding-window mask (q, k, v: (B, n_head, T, head_dim), the same T tokens) at a
    cost linear in T. On CUDA, FlexAttention skips the blocks outside the band. Elsewhere, each block of queries
    goes through SDPA with only the key blocks its window reaches instead of all T keys."""
    T = q.size(-2)
    if window >= T:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if q.is_cuda and dropout_p == 0.0:  # FlexAttention has no dropout: with dropout, the blocks below
        return flex_windowed_attention(q, k, v, window)
    # Blocks of QUERY_BLOCK queries, each against its own keys and the `reach` blocks before it that its window
    # touches. split and cat (not slicing), so that backward is linear too: a slice's gradient is a zero tensor
    # of the full size.
    reach = math.ceil((window - 1) / QUERY_BLOCK)
    queries, keys, values = (t.split(QUERY_BLOCK, dim=-2) for t in (q, k, v))
    band = causal_mask(QUERY_BLOCK, (reach + 1) * QUERY_BLOCK, q.device, window)  # a whole block's rows
    outputs = []
    for j, block in enumerate(queries):
        first, n = max(0, j - reach), block.size(-2)  # the first key block the window touches; queries here
        # band's columns span reach + 1 whole key blocks ending with block j: drop those before the sequence
        mask = band[:n, (reach - (j - first)) * QUERY_BLOCK : reach * QUERY_BLOCK + n]
        block_keys, block_values = torch.cat(keys[first : j + 1], -2), torch.cat(values[first : j + 1], -2)
        outputs.append(
            F.scaled_dot_product_attention(block, block_keys, block_values, attn_mask=mask, dropout_p=dropout_p)
        )
    return torch.cat(outputs, dim=-2)


def flex_windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """FlexAttention with the band as a block mask, compiled into one fused kernel on CUDA (inside a compiled
    model, by that compilation). Elsewhere it runs eagerly, materialising all scores: there it only checks the
    mask, without gradients on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    length = q.size(-2)
    if torch.compiler.is_compiling():  # traced into the model's graph, as modded-nanogpt builds its masks
        return flex_attention(q, k, v, block_mask=_band_block_mask(length, window, q.device))
    kernel = _compiled_flex_attention() if q.is_cuda else flex_attention
    return kernel(q, k, v, block_mask=_cached_band_block_mask(length, window, q.device))


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _band_block_mask(length: int, window: int, device: torch.device) -> BlockMask:
    from torch.nn.attention.flex_attention import create_block_mask

    def in_band(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return (key <= query) & (query - key < window)

    return create_block_mask(in_band, None, None, length, length, device=device)


@functools.lru_cache(maxsize=16)
def _cached_band_block_mask(length: int, window: int, device: torch.device) -> BlockMask:
    with torch.inference_mode(False):  # made while sampling, it must still serve training
        return _band_block_mask(length, window, device)


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
        self.window = config.layer_windows()[layer_index]  # None: every earlier key
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        head_size = config.n_embd // config.n_head
        self.rotary = Rotary(head_size, config.block_size) if config.pos_emb == "rope" else None
        self.qk_norm = config.qk_norm
        self.value_embed = nn.Embedding(config.vocab_size, config.n_embd) if config.value_embeds else None
        self.first_values_kept = config.value_residual and layer_index == 0  # for the layers after it
        # value_residual: v = a*v + b*v_first, learned, from an even mix
        self.value_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if config.value_residual and layer_index else None
        self.captured: list[torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        shortcuts: Shortcuts,
        first_values: torch.Tensor | None = None,
        cache: KVCache | BatchKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (B, T, C) for T new tokens, after the cache's tokens if a cache is given (a BatchKVCache: each row
        after its own, with a key mask of its own). shortcuts: what value_embeds reads; first_values: the first
        layer's values, which value_residual mixes in. Returns the output and, from the first layer of a
        value_residual model, its values (B, n_head, T, head_dim) for the layers after it (else None)."""
        B, T, C = x.shape
        # (3, B, n_head, T, head_dim): one reshape for queries, keys and values
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        v = self._with_shortcuts(v, shortcuts, first_values)
        kept = v if self.first_values_kept else None
        if self.qk_norm:  # scores then measure direction only: they can't grow large, which steadies training
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        start = 0 if cache is None else cache.position  # an int, or each row's (B, 1) for a BatchKVCache
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        key_mask = None
        if cache is not None:
            k, v = cache.extend(self.layer_index, k, v)
            key_mask = cache.key_mask(self.layer_index)
        n_past = 0 if cache is None else cache.length
        dropout_p = self.dropout if self.training else 0.0
        if self.attn_impl == "math" or self.captured is not None:
            # A windowed layer's cache returns only the keys its window may reach, ending at the newest token.
            mask = causal_mask(T, k.size(-2), x.device, self.window) if key_mask is None else key_mask
            y, weights = masked_attention(q, k, v, mask, dropout_p)
            if self.captured is not None:
                self.captured.append(weights)
        elif key_mask is not None:  # rows of their own lengths (BatchKVCache)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=dropout_p)
        elif n_past == 0 and self.window is not None:
            y = windowed_attention(q, k, v, self.window, dropout_p)
        elif n_past == 0:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        elif T == 1:
            # is_causal aligns the mask to the first key; a single query after the cache may see every key
            # the cache returned (a windowed layer's cache returns only those in its window).
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:  # T new tokens after the cached ones (a long prompt fed in chunks): the mask aligned to the end
            mask = causal_mask(T, k.size(-2), x.device, self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, C)
        return F.dropout(self.c_proj(y), dropout_p), kept

    def _with_shortcuts(self, v: torch.Tensor, shortcuts: Shortcuts, first_values: torch.Tensor | None) -> torch.Tensor:
        """The values with this layer's token embedding added (value_embeds), then mixed with the first layer's
        (value_residual); the cache stores them so."""
        if self.value_embed is not None:
            B, n_head, T, head_dim = v.shape
            v = v + self.value_embed(shortcuts.idx).view(B, T, n_head, head_dim).transpose(1, 2)
        if self.value_mix is not None:
            v = self.value_mix[0] * v + self.value_mix[1] * first_values
        return v
