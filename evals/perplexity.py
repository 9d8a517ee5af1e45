"""Loss, perplexity and bits per byte of a token sequence, every target scored exactly once, by sliding windows.

Windows hold `context` inputs and advance by `stride`: the first scores all its targets, each later one only the
targets no window has scored yet (its last `stride`), so most tokens see between context - stride + 1 and
context tokens before them (Hugging Face's perplexity guide). The last window is moved back to end where the
sequence ends, so it is full too. stride = context scores disjoint windows: train.full_val's.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm


@dataclass(frozen=True)
class Window:
    start: int  # index of its first input token
    length: int  # inputs, and targets: tokens start + 1 ... start + length
    scored: int  # its last `scored` targets count


def windows(n_tokens: int, context: int, stride: int) -> Iterator[Window]:
    """The windows over a sequence of n_tokens: each of its n_tokens - 1 targets (every token but the first,
    which has no context) in exactly one window's scored part."""
    targets = n_tokens - 1
    if targets < 1:
        return
    if targets <= context:
        yield Window(0, targets, targets)
        return
    scored_to, offset = 0, 0  # targets scored so far; where the next window would start
    while scored_to < targets:
        start = min(offset, targets - context)
        yield Window(start, context, start + context - scored_to)
        scored_to, offset = start + context, offset + stride


def count_windows(n_tokens: int, context: int, stride: int) -> int:
    targets = n_tokens - 1
    if targets < 1:
        return 0
    return 1 if targets <= context else 1 + math.ceil((targets - context) / stride)


@dataclass(frozen=True)
class TextScore:
    nats: float  # summed over every scored token
    tokens: int  # scored tokens: every token of each sequence but its first
    text_nats: float  # over the tokens that are text (special tokens such as <|endoftext|> left out)
    bytes: int  # UTF-8 bytes of those tokens

    @classmethod
    def of(cls, sums: Sequence[float]) -> TextScore:
        """From token_sums' four sums (added up over batches and processes)."""
        nats, count, text_nats, n_bytes = sums
        return cls(nats, round(count), text_nats, round(n_bytes))

    @property
    def loss(self) -> float:
        """Mean nats per token."""
        return self.nats / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bpb(self) -> float:
        """Bits per byte of text: comparable across tokenizers."""
        return self.text_nats / (math.log(2) * self.bytes) if self.bytes else math.nan


@torch.no_grad()
def score_sequences(
    model: torch.nn.Module,
    sequences: Sequence[np.ndarray],
    byte_lengths: torch.Tensor,
    context: int,
    stride: int,
    batch_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    progress: bool = False,
) -> TextScore:
    """Each sequence (token ids; a split's files are separate sequences, as no training window spans two) scored
    by its own windows, `batch_size` windows a forward pass. byte_lengths: UTF-8 bytes of each token id (0: a
    special token), on the model's device. The model is called as model(x) -> (logits, _), in eval mode."""
    if not 1 <= stride <= context:
        raise ValueError(f"stride {stride} must be in [1, context={context}]")
    device = byte_lengths.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    total = sum(count_windows(len(s), context, stride) for s in sequences)
    with tqdm(total=total, unit="window", desc="scoring", disable=not progress) as bar:
        for tokens in sequences:
            for batch in _batches(windows(len(tokens), context, stride), batch_size):
                sums += _batch_sums(model, tokens, batch, byte_lengths, autocast)
                bar.update(len(batch))
    return TextScore.of(sums.tolist())


def token_sums(
    logits: torch.Tensor, targets: torch.Tensor, byte_lengths: torch.Tensor, scored: torch.Tensor | None = None
) -> torch.Tensor:
    """(4,) float64: the nats and the count of the targets (where `scored`, if given), and the nats and UTF-8 bytes
    of those that are text: special tokens such as <|endoftext|> count 0 bytes and are left out of both, as in
    nanochat's bits per byte. Sums, so batches and processes add up."""
    nats = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").double()
    targets = targets.flatten()
    if scored is not None:
        nats, targets = nats[scored.flatten()], targets[scored.flatten()]
    n_bytes = byte_lengths[targets]
    return torch.stack((nats.sum(), nats.new_tensor(targets.numel()), nats[n_bytes > 0].sum(), n_bytes.sum()))


def _batches(items: Iterable[Window], size: int) -> Iterator[list[Window]]:
    items = iter(items)
    return iter(lambda: list(itertools.islice(items, size)), [])


def _batch_sums(
    model: torch.nn.Module,
    tokens: np.ndarray,
    batch: list[Window],
    byte_lengths: torch.Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> torch.Tensor:
    """Nats and count of the scored targets, nats and bytes of the text ones. A sequence's windows all have
    one length, so a batch is one (B, length) tensor."""
    device = byte_lengths.device
    length = batch[0].length
    rows = np.stack([np.asarray(tokens[w.start : w.start + length + 1], dtype=np.int64) for w in batch])
    rows = torch.from_numpy(rows).to(device)
    x, y = rows[:, :-1], rows[:, 1:]
    scored = torch.tensor([w.scored for w in batch], device=device)
    mask = torch.arange(length, device=device) >= (length - scored)[:, None]  # each window's last `scored`
    with autocast():
        logits, _ = model(x)
    return token_sums(logits, y, byte_lengths, mask)
