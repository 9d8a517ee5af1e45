"""Causal multi-head self-attention, fused (flash) or textbook (math), full or windowed, with rotary positions or
none; and generation's KV cache."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from model.gpt import GPTConfig


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """softmax(QKᵀ/√d_k, -inf where `mask` is False) @ V, and the (pre-dropout) weights: the only copy of the formula.
    q: (..., m, d); k, v: (..., n, d); mask: bool, broadcastable to (..., m, n), True where a query may attend."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return F.dropout(weights, p=dropout_p) @ v, weights


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str | None = None,
                window: int | None = None) -> Tensor:
    """Causal mask for the last `n_queries` of `n_keys` positions; with a window, query i sees keys i-window+1 .. i."""
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    mask = ones.tril(diagonal=n_keys - n_queries)
    if window is not None:
        mask &= ones.triu(diagonal=n_keys - n_queries - window + 1)
    return mask


QUERY_BLOCK = 64  # queries per SDPA call off CUDA: smaller blocks waste fewer keys, but each call has overhead


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, window: int, dropout_p: float = 0.0) -> Tensor:
    """Sliding-window attention linear in T: FlexAttention on CUDA, else SDPA per query block on the keys it reaches."""
    if window >= q.size(-2):
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
        outputs.append(F.scaled_dot_product_attention(block, block_keys, block_values, attn_mask=mask,
                                                      dropout_p=dropout_p))
    return torch.cat(outputs, dim=-2)


def flex_windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """FlexAttention with the band as a block mask, one fused kernel on CUDA; elsewhere eager, all scores
    materialised (there it only checks the mask, without gradients on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # traced into the model's graph, as modded-nanogpt builds its masks
        # v contiguous: inductor's CPU kernel misreads v as a view of the fused QKV beside new q and k (rotary's), up to
        # 5 off (docs/gpu.md has the reproduction); one copy of v a layer
        return flex_attention(q, k, v.contiguous(), block_mask=_band_block_mask(q.size(-2), window, q.device))
    kernel = _compiled_flex_attention() if q.is_cuda else flex_attention
    return kernel(q, k, v, block_mask=_cached_band_block_mask(q.size(-2), window, q.device))


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


class Rotary(nn.Module):
    """Rotary embeddings (RoFormer): query and key channel pairs rotate with position, so scores depend only on the
    distance between query and key."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0) -> None:
        super().__init__()
        # float64 angles: a rolling model's positions grow unbounded; in float32 they drift 5e-3 rad by position 1e5.
        # Not a buffer, so it stays float64 when the model moves or casts; a copy per device (CPU for MPS: no float64).
        self.inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {self.inv_freq.device: self.inv_freq}
        cos, sin = self._cos_sin(0, max_positions, self.inv_freq.device)  # (positions, head_dim/2)
        self.register_buffer("cos", cos, persistent=False)  # both derived, not learned: kept out of checkpoints
        self.register_buffer("sin", sin, persistent=False)

    def _cos_sin(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of positions start .. end - 1, computed in float64 on `device` (CPU for MPS)."""
        if device.type == "mps":
            device = torch.device("cpu")
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self.inv_freq.to(device)
        angles = torch.arange(start, end, dtype=torch.float64, device=device).unsqueeze(-1) * self._inv_freq_on[device]
        return angles.cos().float(), angles.sin().float()

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate x (B, n_head, T, head_dim) as positions start .. start + T - 1."""
        T, half = x.size(-2), x.size(-1) // 2
        if start + T <= self.cos.size(0):
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        else:  # past the table (a rolling model's generation): the same angles, computed for these positions
            cos, sin = (t.to(x.device, self.cos.dtype) for t in self._cos_sin(start, start + T, x.device))
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    """attn_impl picks the path, on the same parameters. While `captured` is a list (GPT.capturing), every
    call runs the math path and appends its softmax weights (B, n_head, T, n_keys) there."""

    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index, self.n_head, self.dropout = layer_index, config.n_head, config.dropout
        self.attn_impl, self.qk_norm = config.attn_impl, config.qk_norm
        self.window = config.layer_windows()[layer_index]  # None: every earlier key
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.rotary = Rotary(config.n_embd // config.n_head, config.block_size) if config.pos_emb == "rope" else None
        self.first_values_kept = config.value_residual and layer_index == 0  # for the layers after it to mix in
        self.value_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if config.value_residual and layer_index else None
        self.captured: list[torch.Tensor] | None = None

    def forward(self, x: Tensor, first_values: Tensor | None = None,
                cache: KVCache | None = None) -> tuple[Tensor, Tensor | None]:
        """The new tokens' attention over themselves and the cached tokens; and value_residual's first-layer values."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        if self.value_mix is not None:
            v = self.value_mix[0] * v + self.value_mix[1] * first_values
        first_values = v if self.first_values_kept else first_values
        if self.qk_norm:  # scores then measure direction only: they can't grow large, which steadies training
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if self.rotary is not None:  # the new tokens' positions start where the cached ones end
            start = 0 if cache is None else cache.length
            q, k = self.rotary(q, start), self.rotary(k, start)
        if cache is not None:  # generation: the earlier tokens' keys and values go before the new ones'
            k, v = cache.layers[self.layer_index].extend(k, v)
        y = self.c_proj(self.attend(q, k, v).transpose(1, 2).reshape(B, T, C))
        return F.dropout(y, self.dropout, self.training), first_values

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax(QKᵀ/√d_k) @ V, the queries being the last keys: each sees those up to its own, within the window."""
        dropout_p = self.dropout if self.training else 0.0
        if self.attn_impl == "math" or self.captured is not None:
            mask = causal_mask(q.size(-2), k.size(-2), q.device, self.window)
            y, weights = masked_attention(q, k, v, mask, dropout_p)
            if self.captured is not None:
                self.captured.append(weights)
            return y
        if q.size(-2) < k.size(-2):  # after cached keys: the mask aligns the queries with the last keys
            mask = causal_mask(q.size(-2), k.size(-2), q.device, self.window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        if self.window is not None:
            return windowed_attention(q, k, v, self.window, dropout_p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


ROLL_SLACK = 64  # a windowed layer's spare slots: it moves its live tokens to the front once per this many steps


class LayerCache:
    """One layer's keys and values (2, B, n_head, slots, head_dim), oldest first. A full layer has block_size slots;
    a windowed one keeps its last window - 1 tokens in twice that plus ROLL_SLACK, moving them to the front when it
    fills: bounded memory, and always one contiguous, oldest-first slice for the kernels."""

    def __init__(self, block_size: int, window: int | None) -> None:
        self.keep = block_size if window is None else window - 1  # earlier tokens a new query may still see
        self.slots = min(block_size, 2 * self.keep + ROLL_SLACK)
        self.buffer: Tensor | None = None  # allocated on first use: batch, device and dtype as given
        self.stored = 0

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' keys and values (B, n_head, T, head_dim); return theirs and the keep before them."""
        if self.buffer is not None and self.stored + k.size(2) > self.buffer.size(3):
            self._roll(k.size(2))
        start, end = max(0, self.stored - self.keep), self.stored + k.size(2)
        if self.buffer is None:  # a prompt longer than a window's slots gets as many; its next roll shrinks them
            self.buffer = k.new_empty(2, k.size(0), k.size(1), max(self.slots, end), k.size(3))
        self.buffer[0, :, :, self.stored : end] = k
        self.buffer[1, :, :, self.stored : end] = v
        self.stored = end
        return self.buffer[0, :, :, start:end], self.buffer[1, :, :, start:end]

    def _roll(self, n_new: int) -> None:
        """Move the tokens still in the window to the front of a buffer with room for n_new more."""
        assert self.buffer is not None
        kept = min(self.stored, self.keep)
        live = self.buffer[:, :, :, self.stored - kept : self.stored].clone()  # source and destination may overlap
        slots = max(self.slots, kept + n_new)
        if slots != self.buffer.size(3):
            self.buffer = self.buffer.new_empty(*self.buffer.shape[:3], slots, self.buffer.size(4))
        self.buffer[:, :, :, :kept] = live
        self.stored = kept


class KVCache:
    """Every layer's keys and values for the tokens run so far, so that each new token costs one position. Its rows
    run in lockstep: a batch of sequences of one length."""

    def __init__(self, config: GPTConfig) -> None:
        self.layers = [LayerCache(config.block_size, window) for window in config.layer_windows()]
        self.length = 0  # tokens already run: the new ones sit at positions length, length + 1, ...
        self.last_token: torch.Tensor | None = None  # (B, 1): the newest token run, the bigram of the next
