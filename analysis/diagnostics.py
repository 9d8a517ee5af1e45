"""Per-head numbers that say what a head does, so a reader can find the interesting heads without looking at all
of them: TransformerLens's definitions (formulas in docs/attention_explorer.md)."""

from __future__ import annotations

import numpy as np
import torch

from model import GPT

DIAGNOSTIC_NAMES = ("entropy", "mean_distance", "first_token", "previous_token", "induction")
INDUCTION_REPEAT = 50  # random tokens per repeat (fewer when block_size can't hold two)
INDUCTION_SEED = 0


def head_diagnostics(model: GPT, weights: np.ndarray, induction: np.ndarray | None = None) -> np.ndarray:
    """(n_layer, n_head, 5) in DIAGNOSTIC_NAMES order: four from the sample's `weights` (n_layer, n_head, T, T), and
    the induction score of a repeated random sequence (`induction`, if already known), as a sample rarely repeats."""
    induction = induction_scores(model) if induction is None else induction
    return np.concatenate([pattern_scores(weights), induction[..., None]], axis=-1).astype(np.float32)


def pattern_scores(weights: np.ndarray) -> np.ndarray:
    """(..., 4): row entropy (nats), mean attention distance, weight on the first token, previous-token score,
    each a mean over query rows; the last two over rows 1.., as row 0 has all its weight on the first token."""
    p = weights.astype(np.float64)
    T = p.shape[-1]
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    entropy = -plogp.sum(-1).mean(-1)
    distance = np.arange(T)[:, None] - np.arange(T)[None, :]  # i - j
    mean_distance = (p * distance).sum(-1).mean(-1)
    if T > 1:
        first = p[..., 1:, 0].mean(-1)
        previous = np.diagonal(p, offset=-1, axis1=-2, axis2=-1).mean(-1)
    else:
        first = previous = np.full(entropy.shape, np.nan)
    return np.stack([entropy, mean_distance, first, previous], axis=-1)


@torch.no_grad()
def induction_scores(model: GPT) -> np.ndarray:
    """(n_layer, n_head): R random tokens repeated twice; the mean, over the second repeat's queries i, of the
    weight on key i - R + 1, the token that followed the current token's previous occurrence (the stripe of
    TransformerLens's main demo, without its BOS token). NaN when block_size can't hold two repeats of 2."""
    config = model.config
    repeat = min(config.block_size // 2, INDUCTION_REPEAT)
    if repeat < 2:
        return np.full((config.n_layer, config.n_head), np.nan)
    generator = torch.Generator().manual_seed(INDUCTION_SEED)
    half = torch.randint(config.vocab_size, (repeat,), generator=generator)
    idx = torch.cat([half, half])[None].to(next(model.parameters()).device)
    weights = model.attention_weights(idx)[:, 0].float().cpu().numpy()  # (n_layer, n_head, 2R, 2R)
    stripe = np.diagonal(weights, offset=1 - repeat, axis1=-2, axis2=-1)  # (i, i - R + 1) for i = R - 1 .. 2R - 1
    return stripe[..., 1:].mean(-1)  # queries R .. 2R - 1: the second repeat
