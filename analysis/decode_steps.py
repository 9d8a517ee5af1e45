"""The weights each KV-cache decode step used: the mask at work during generation, not a replay of the
full-sequence matrix."""

from __future__ import annotations

import numpy as np
import torch

from model import GPT
from model.attention import KVCache


@torch.no_grad()
def decode_step_weights(model: GPT, ids: list[int], n_prefill: int, last: int | None = None) -> np.ndarray:
    """Run `ids` as generation does, the first n_prefill tokens as the prompt (one pass) then one token per step
    with the cache: (steps, n_layer, n_head, last), the weights of the last `last` tokens' steps (default: all)
    over the last `last` key positions, 0 where the cache held no key. Captured on the math path, from the same
    queries and cached keys: the fused path doesn't return its weights."""
    T = len(ids)
    if not 1 <= n_prefill <= T:
        raise ValueError(f"n_prefill={n_prefill} must be between 1 and the {T} tokens")
    last = T if last is None else min(last, T)
    start = T - last  # the first key position kept
    first_step = max(n_prefill, start)
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    attentions = [block.attn for block in model.transformer.h]
    captured: list[torch.Tensor] = []
    steps = np.zeros((T - first_step, len(attentions), model.config.n_head, last), dtype=np.float32)
    cache = KVCache(model.config)

    def capture(on: bool) -> None:
        for attn in attentions:
            attn.captured = captured if on else None

    try:
        model.hidden(idx[:, :n_prefill], cache)  # the prompt on the model's own path: no T x T weights kept
        for t in range(n_prefill, T):
            capture(t >= first_step)
            captured.clear()
            model.hidden(idx[:, t : t + 1], cache)
            if t < first_step:
                continue
            for layer, weights in enumerate(captured):  # (1, n_head, 1, keys the cache returned, ending at t)
                row = weights[0, :, 0].float().cpu().numpy()
                lo = t - row.shape[-1] + 1  # the first key's position
                steps[t - first_step, layer, :, max(lo, start) - start : t + 1 - start] = row[:, max(0, start - lo) :]
    finally:
        capture(False)
    return steps
