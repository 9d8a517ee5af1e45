"""How the next token is picked from the logits: temperature, then the cut-offs (top_k, top_p, min_p), then a draw.

Each cut-off removes tokens from the draw by setting their logits to -inf; the most likely token always survives.
temperature=0 is greedy decoding: the argmax, no draw, the cut-offs moot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_TEMPERATURE = 0.8  # sample.py's and the wandb sample table's draws (serving follows OpenAI's defaults)
DEFAULT_TOP_K = 200


def row_generators(seed: int | None, count: int, device: torch.device | str = "cpu") -> list[torch.Generator] | None:
    """Random streams for `count` rows drawn from seed: row i's is seeded with seed + i. sample.py's sample i and
    a served request's choice i, both with seed S, so draw the same tokens. None without a seed: torch's global
    generator."""
    if seed is None:
        return None
    return [torch.Generator(device=device).manual_seed(seed + i) for i in range(count)]


TINY = torch.finfo(torch.float32).tiny  # a temperature below it is greedy: logits are divided in float32


@dataclass(frozen=True)
class Decoding:
    temperature: float = 1.0  # 0: greedy (argmax); below 1 sharper, above 1 flatter
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the fewest most likely tokens whose probabilities add up to p (nucleus)
    min_p: float | None = None  # keep tokens at least min_p times as likely as the most likely one

    def __post_init__(self) -> None:
        """Bugs in a caller, not user errors: the sample config checks the same ranges with one line each."""
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1")
        for name in ("top_p", "min_p"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name}={value} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        """Every draw is the likeliest token: repeated samples of one prompt are the same text."""
        return self.temperature < TINY or self.top_k == 1

    def next_token(
        self, logits: torch.Tensor, generators: Sequence[torch.Generator | None] | None = None
    ) -> torch.Tensor:
        """(B, V) logits of the last position -> (B, 1) token ids. In float32: under autocast they may be half
        precision, too coarse for the probability sums of top_p and min_p. generators: one per row, so a row's
        draws don't depend on the rows beside it (a server's batch); None, or a None in it: torch's global one."""
        logits = logits.float()
        if self.temperature < TINY:  # 0, or too small for float32 to divide by
            return logits.argmax(dim=-1, keepdim=True)
        # the largest logit subtracted first: a tiny temperature (1e-40) then sends the others to -inf, not the
        # largest to inf (inf - inf is NaN); softmax and the cut-offs don't change under a shift
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(self.cut(logits / self.temperature), dim=-1)
        if generators is None:
            return torch.multinomial(probs, num_samples=1)
        rows = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
        return torch.stack(rows)

    def cut(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token outside the cut-offs at -inf (after temperature, as it is applied)."""
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = torch.sort(logits, dim=-1, descending=True)
            mass = ordered.softmax(dim=-1).cumsum(dim=-1)
            # outside: the likelier ones' mass reaches top_p; never the likeliest, which has none before it (a
            # top_p below float32's smallest number, 1e-46, rounds to 0, and 0 >= 0 would drop every token)
            first = torch.zeros_like(mass[:, :1], dtype=torch.bool)
            outside = torch.cat((first, mass[:, :-1] >= self.top_p), dim=-1)
            drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, outside)
            logits = logits.masked_fill(drop, float("-inf"))
        if self.min_p is not None:
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < self.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits
