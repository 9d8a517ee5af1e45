"""What each head does: per-head numbers (TransformerLens's definitions, formulas in docs/attention_explorer.md), as
training goes on too (HeadProbe, train.head_scores), and the weights each KV-cache decode step used (the mask at work
during generation, not the full matrix replayed)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from data.prepare import TokenFiles, every_window
from model import GPT
from model.attention import KVCache

DIAGNOSTIC_NAMES = ("entropy", "mean_distance", "first_token", "previous_token", "induction")
INDUCTION_REPEAT = 50  # random tokens per repeat (fewer when block_size can't hold two)


def head_diagnostics(model: GPT, weights: np.ndarray, induction: np.ndarray | None = None) -> np.ndarray:
    """(n_layer, n_head, 5) in DIAGNOSTIC_NAMES order: four from the sample's `weights` (n_layer, n_head, T, T), and
    the induction score of a repeated random sequence (`induction`, if already known), as a sample rarely repeats."""
    induction = induction_scores(model) if induction is None else induction
    patterns = np.stack([pattern_scores(layer) for layer in weights])  # a layer at a time: float64 copies are large
    return np.concatenate([patterns, induction[..., None]], axis=-1).astype(np.float32)


def pattern_scores(weights: np.ndarray) -> np.ndarray:
    """(..., 4): row entropy (nats), mean attention distance, weight on the first token, previous-token score,
    each a mean over query rows; the last two over rows 1.., as row 0 has all its weight on the first token."""
    p = weights.astype(np.float64)
    T = p.shape[-1]
    entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1).mean(-1)
    mean_distance = (p * (np.arange(T)[:, None] - np.arange(T)[None, :])).sum(-1).mean(-1)  # i - j
    first = p[..., 1:, 0].mean(-1) if T > 1 else np.full(entropy.shape, np.nan)
    previous = np.diagonal(p, offset=-1, axis1=-2, axis2=-1).mean(-1) if T > 1 else np.full(entropy.shape, np.nan)
    return np.stack([entropy, mean_distance, first, previous], axis=-1)


@torch.no_grad()
def induction_scores(model: GPT) -> np.ndarray:
    """(n_layer, n_head): R random tokens repeated twice; mean weight of the second repeat's queries i on key i - R + 1,
    the token after the current one's previous occurrence (TransformerLens's stripe, no BOS). NaN if block_size < 4."""
    config = model.config
    repeat = min(config.block_size // 2, INDUCTION_REPEAT)
    if repeat < 2:
        return np.full((config.n_layer, config.n_head), np.nan)
    half = torch.randint(config.vocab_size, (repeat,), generator=torch.Generator().manual_seed(0))
    idx = torch.cat([half, half])[None].to(next(model.parameters()).device)
    weights = model.attention_weights(idx)[:, 0].float().cpu().numpy()  # (n_layer, n_head, 2R, 2R)
    stripe = np.diagonal(weights, offset=1 - repeat, axis1=-2, axis2=-1)  # (i, i - R + 1) for i = R - 1 .. 2R - 1
    return stripe[..., 1:].mean(-1)  # queries R .. 2R - 1: the second repeat


@dataclass
class HeadProbe:
    """train.head_scores: every head's scores at each evaluation, on the val split's first block and induction_scores'
    repeated sequence. Both come from the data alone, so a resumed run, and every seed, is probed on the same text."""

    idx: torch.Tensor  # (1, block_size)

    @classmethod
    def first_block(cls, val: TokenFiles, block_size: int) -> HeadProbe:
        return cls(next(every_window(val, 1, block_size))[0])

    def __call__(self, model: GPT, iter: int = 0) -> dict[str, dict[str, list]]:
        """{"heads": {name: n_layer x n_head nested lists}} in DIAGNOSTIC_NAMES order, rounded to 3 decimals (None:
        undefined), from the math path in eval mode, at every evaluation; the model's mode is then put back."""
        training = model.training
        model.eval()
        try:
            weights = model.attention_weights(self.idx.to(next(model.parameters()).device))[:, 0].float().cpu().numpy()
            scores = head_diagnostics(model, weights)
        finally:
            model.train(training)
        return {"heads": {name: [[None if math.isnan(v) else round(float(v), 3) + 0.0 for v in layer]
                                 for layer in scores[..., k]] for k, name in enumerate(DIAGNOSTIC_NAMES)}}


@torch.no_grad()
def decode_step_weights(model: GPT, ids: list[int], n_prefill: int, last: int | None = None) -> np.ndarray:
    """Run `ids` as generation does (n_prefill prompt tokens in one pass, then a cached step per token): (steps,
    n_layer, n_head, last), the last `last` tokens' steps over the last `last` keys (0 where none cached), captured on
    the math path from the same queries and cached keys, as the fused path doesn't return its weights."""
    T = len(ids)
    last = T if last is None else min(last, T)
    start = T - last  # the first key position kept
    first_step = max(n_prefill, start)
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    steps = np.zeros((T - first_step, model.config.n_layer, model.config.n_head, last), dtype=np.float32)
    cache = KVCache(model.config)
    model.prefill(idx[:, :n_prefill], cache)  # the prompt on the model's own path: no T x T weights kept
    for t in range(n_prefill, T):
        with model.capturing() if t >= first_step else contextlib.nullcontext([]) as captured:
            model.hidden(idx[:, t : t + 1], cache)
        for layer, weights in enumerate(captured):  # (1, n_head, 1, keys the cache returned, ending at t)
            row = weights[0, :, 0].float().cpu().numpy()
            lo = t - row.shape[-1] + 1  # the first key's position
            steps[t - first_step, layer, :, max(lo, start) - start : t + 1 - start] = row[:, max(0, start - lo) :]
    return steps
