"""Loss, perplexity and bits per byte of scored tokens (TextScore, token_sums: training's evaluation uses them too),
and of a token sequence by sliding windows (Hugging Face's perplexity guide):
windows of `context` inputs advance by `stride`, each scoring only targets no window has scored yet (the last moved
back to end at the sequence's end), so most targets see context - stride + 1 to context tokens before them."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

Autocast = Callable[[], contextlib.AbstractContextManager]


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
    def loss(self) -> float:  # mean nats per token
        return self.nats / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bpb(self) -> float:  # bits per byte of text: comparable across tokenizers
        return self.text_nats / (math.log(2) * self.bytes) if self.bytes else math.nan


def token_sums(logits: torch.Tensor, targets: torch.Tensor, byte_lengths: torch.Tensor,
               scored: torch.Tensor | None = None) -> torch.Tensor:
    """Sums of the targets' nats and count, and of the text ones' nats and UTF-8 bytes (for bits per byte)."""
    nats = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").double()
    targets = targets.flatten()
    if scored is not None:
        nats, targets = nats[scored.flatten()], targets[scored.flatten()]
    n_bytes = byte_lengths[targets]
    return torch.stack((nats.sum(), nats.new_tensor(targets.numel()), nats[n_bytes > 0].sum(), n_bytes.sum()))


@dataclass(frozen=True)
class Window:
    start: int  # index of its first input token
    length: int  # inputs, and targets: tokens start + 1 ... start + length
    scored: int  # its last `scored` targets count


def windows(n_tokens: int, context: int, stride: int) -> Iterator[Window]:
    """Windows over n_tokens tokens: each of the n_tokens - 1 targets (all but the first) scored by exactly one."""
    targets, length = n_tokens - 1, min(context, n_tokens - 1)  # a text shorter than the context: one window
    scored_to, offset = 0, 0  # targets scored so far; where the next window would start
    while scored_to < targets:
        start = min(offset, targets - length)
        yield Window(start, length, start + length - scored_to)
        scored_to, offset = start + length, offset + stride


@torch.no_grad()
def score_sequences(model: torch.nn.Module, sequences: Sequence[np.ndarray], byte_lengths: torch.Tensor, context: int,
                    stride: int, batch_size: int, autocast: Autocast = contextlib.nullcontext,
                    progress: bool = False) -> TextScore:
    """Each sequence (a split's files are separate ones) scored by its own windows, `batch_size` windows a forward
    pass. byte_lengths: UTF-8 bytes of each token id (0: a special token), on the model's device."""
    device = byte_lengths.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    total = sum(sum(1 for _ in windows(len(tokens), context, stride)) for tokens in sequences)  # counted, not held
    with tqdm(total=total, unit="window", desc="scoring", disable=not progress) as bar:
        for tokens in sequences:
            found = windows(len(tokens), context, stride)
            while batch := list(itertools.islice(found, batch_size)):
                length = batch[0].length  # a sequence's windows have one length
                rows = np.stack([np.asarray(tokens[w.start : w.start + length + 1], dtype=np.int64) for w in batch])
                rows = torch.from_numpy(rows).to(device)
                scored = torch.tensor([w.scored for w in batch], device=device)
                mask = torch.arange(length, device=device) >= (length - scored)[:, None]  # each window's last `scored`
                with autocast():
                    logits, _ = model(rows[:, :-1])
                sums += token_sums(logits, rows[:, 1:], byte_lengths, mask)
                bar.update(len(batch))
    return TextScore.of(sums.tolist())
