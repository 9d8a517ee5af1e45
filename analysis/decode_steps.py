"""The weights each KV-cache decode step used: the mask at work during generation, not a replay of the
full-sequence matrix."""

from __future__ import annotations

import numpy as np
import torch

from model import GPT
from model.kv_cache import KVCache


@torch.no_grad()
def decode_step_weights(model: GPT, ids: list[int], n_prefill: int) -> np.ndarray:
    """Run `ids` as generation does, the first n_prefill tokens as the prompt (one pass) then one token per step
    with the cache, and return (len(ids) - n_prefill, n_layer, n_head, len(ids)): for each step's token t, every
    layer's and head's weights over the keys the cache gave it, placed at their positions (0 elsewhere: keys
    after t, and those a windowed layer's cache no longer holds). The step runs the math path (`captured`) on the
    same queries and cached keys: the fused path doesn't return its weights."""
    T = len(ids)
    if not 1 <= n_prefill <= T:
        raise ValueError(f"n_prefill={n_prefill} must be between 1 and the {T} tokens")
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    attentions = [block.attn for block in model.transformer.h]
    captured: list[torch.Tensor] = []
    steps = np.zeros((T - n_prefill, len(attentions), model.config.n_head, T), dtype=np.float32)
    cache = KVCache(model.config)
    for attn in attentions:
        attn.captured = captured
    try:
        model._hidden(idx[:, :n_prefill], cache)
        for t in range(n_prefill, T):
            captured.clear()
            model._hidden(idx[:, t : t + 1], cache)
            for layer, weights in enumerate(captured):  # (1, n_head, 1, keys the cache returned, ending at t)
                n_keys = weights.size(-1)
                steps[t - n_prefill, layer, :, t - n_keys + 1 : t + 1] = weights[0, :, 0].float().cpu().numpy()
    finally:
        for attn in attentions:
            attn.captured = None
    return steps
