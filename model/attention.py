"""Causal multi-head self-attention, fused (flash) or textbook (math), full or windowed; and generation's KV cache."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.rotary import Rotary
from model.shortcuts import Shortcuts

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from model.batch_cache import BatchKVCache
    from model.gpt import GPTConfig

    Cache: TypeAlias = "KVCache | BatchKVCache"


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QKᵀ/√d_k, -inf where `mask` is False) @ V, and the (pre-dropout) weights: the only copy of the formula.
    q: (..., m, d); k, v: (..., n, d); mask: bool, broadcastable to (..., m, n), True where a query may attend."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return F.dropout(weights, p=dropout_p) @ v, weights


def causal_mask(
    n_queries: int, n_keys: int, device: torch.device | str | None = None, window: int | None = None
) -> torch.Tensor:
    """Causal mask for the last `n_queries` of `n_keys` positions; with a window, query i sees keys i-window+1 .. i."""
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    mask = ones.tril(diagonal=n_keys - n_queries)
    if window is not None:
        mask &= ones.triu(diagonal=n_keys - n_queries - window + 1)
    return mask


QUERY_BLOCK = 64  # queries per SDPA call off CUDA: smaller blocks waste fewer keys, but each call has overhead


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dropout_p: float = 0.0
) -> torch.Tensor:
    """Sliding-window attention linear in T: FlexAttention on CUDA, else SDPA per query block on the keys it reaches."""
    T = q.size(-2)
    if window >= T:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if q.is_cuda and dropout_p == 0.0:  # FlexAttention has no dropout: with dropout, the blocks below
        return flex_windowed_attention(q, k, v, window)
    # Blocks of QUERY_BLOCK queries, each against its own keys and the `reach` blocks before it its window touches.
    # split and cat (not slicing), so that backward is linear too: a slice's gradient is a zero tensor of full size.
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
    """FlexAttention with the band as a block mask, one fused kernel on CUDA; elsewhere eager, all scores
    materialised (there it only checks the mask, without gradients on CPU)."""
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
    """attn_impl picks the path, on the same parameters. While `captured` is a list (GPT.attention_weights), every
    call runs the math path and appends its softmax weights (B, n_head, T, n_keys) there."""

    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index, self.n_head, self.dropout = layer_index, config.n_head, config.dropout
        self.attn_impl, self.qk_norm = config.attn_impl, config.qk_norm
        self.window = config.layer_windows()[layer_index]  # None: every earlier key
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.rotary = Rotary(config.n_embd // config.n_head, config.block_size) if config.pos_emb == "rope" else None
        self.value_embed = nn.Embedding(config.vocab_size, config.n_embd) if config.value_embeds else None
        self.first_values_kept = config.value_residual and layer_index == 0  # for the layers after it
        # value_residual: v = a*v + b*v_first, learned, from an even mix
        self.value_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if config.value_residual and layer_index else None
        self.captured: list[torch.Tensor] | None = None

    def forward(self, x: Tensor, shortcuts: Shortcuts, first_values: Tensor | None = None,
                cache: Cache | None = None) -> tuple[Tensor, Tensor | None]:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        if self.value_embed is not None or self.value_mix is not None:
            v = self.mixed_values(v, shortcuts, first_values)
        if self.qk_norm:  # scores then measure direction only: they can't grow large, which steadies training
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if cache is None:
            if self.rotary is not None:
                q, k = self.rotary(q, 0), self.rotary(k, 0)
            y = self.attend(q, k, v)
        else:  # generation: the cache adds the earlier tokens' keys and values (KVCache.attend)
            y = cache.attend(self, q, k, v)
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return F.dropout(y, self.dropout, self.training), v if self.first_values_kept else None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """softmax(QKᵀ/√d_k) @ V, causal (within the layer's window), or where a cache's `mask` is True."""
        dropout_p = self.dropout if self.training else 0.0
        if self.attn_impl == "math" or self.captured is not None:
            mask = causal_mask(q.size(-2), k.size(-2), q.device, self.window) if mask is None else mask
            y, weights = masked_attention(q, k, v, mask, dropout_p)
            if self.captured is not None:
                self.captured.append(weights)
            return y
        if mask is None and self.window is not None:
            return windowed_attention(q, k, v, self.window, dropout_p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None)

    def mixed_values(self, v: Tensor, shortcuts: Shortcuts, first_values: Tensor | None) -> Tensor:
        """The values plus this layer's token embedding (value_embeds), mixed with layer 0's (value_residual)."""
        if self.value_embed is not None:
            B, n_head, T, head_dim = v.shape
            v = v + self.value_embed(shortcuts.idx).view(B, T, n_head, head_dim).transpose(1, 2)
        if self.value_mix is not None:
            v = self.value_mix[0] * v + self.value_mix[1] * first_values
        return v


ROLL_SLACK = 64  # a windowed layer's spare slots: it moves its live tokens to the front once per this many steps


class LayerCache:
    """A full layer's keys and values (2, B, n_head, slots, head_dim), oldest first, preallocated to block_size."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.buffer: Tensor | None = None  # allocated on first use: batch, device and dtype as given
        self.stored = 0

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' keys and values (B, n_head, T, head_dim); return all those stored."""
        end = self.stored + k.size(2)
        if self.buffer is None:  # a prompt longer than a window's slots gets as many; its next roll shrinks them
            self.buffer = k.new_empty(2, k.size(0), k.size(1), max(self.slots, end), k.size(3))
        self.buffer[0, :, :, self.stored : end] = k
        self.buffer[1, :, :, self.stored : end] = v
        self.stored = end
        return self.buffer[0, :, :, :end], self.buffer[1, :, :, :end]


class WindowedLayerCache(LayerCache):
    """A windowed layer's last window - 1 tokens in a buffer of twice that plus ROLL_SLACK, whose live tokens move to
    the front when it fills: bounded memory, and always one contiguous, oldest-first slice for the kernels."""

    def __init__(self, block_size: int, window: int) -> None:
        super().__init__(min(block_size, 2 * (window - 1) + ROLL_SLACK))
        self.keep = window - 1  # earlier tokens a new query may still see

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' keys and values; return theirs and the last window - 1 before them."""
        if self.buffer is not None and self.stored + k.size(2) > self.buffer.size(3):
            self._roll(k.size(2))
        start = max(0, self.stored - self.keep)
        keys, values = super().extend(k, v)
        return keys[:, :, start:], values[:, :, start:]

    def _roll(self, n_new: int) -> None:
        """Move the tokens still in the window to the front of a buffer with room for n_new more."""
        assert self.buffer is not None
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
    """Every layer's keys and values for the tokens run so far, so that each new token costs one position."""

    def __init__(self, config: GPTConfig) -> None:
        size = config.block_size
        self.layers = [LayerCache(size) if w is None else WindowedLayerCache(size, w) for w in config.layer_windows()]
        self.length = 0  # tokens already run: the new ones sit at positions length, length + 1, ...
        self.last_token: torch.Tensor | None = None  # (B, 1): the newest token run, the bigram of the next

    @property
    def position(self) -> int:  # the new tokens' first (a BatchKVCache's: each row's)
        return self.length

    def attend(self, attn: CausalSelfAttention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The new tokens' attention over their own keys and the earlier ones in reach."""
        if attn.rotary is not None:
            q, k = attn.rotary(q, self.length), attn.rotary(k, self.length)
        k, v = self.layers[attn.layer_index].extend(k, v)
        mask = None if self.length == 0 else causal_mask(q.size(-2), k.size(-2), q.device, attn.window)
        return attn.attend(q, k, v, mask)

    def advance(self, new_tokens: Tensor) -> None:  # once every layer has stored the new tokens (B, T)
        self.length += new_tokens.size(1)
        self.last_token = new_tokens[:, -1:]
