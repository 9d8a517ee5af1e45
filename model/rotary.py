"""Rotary position embeddings (RoFormer): each query and key channel pair is rotated by an angle that grows with
the position, so a query-key score depends on how far apart the two tokens are, not where they sit."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0) -> None:
        super().__init__()
        # float64 on the CPU, not a buffer (MPS has no float64): a rolling model's positions grow without bound,
        # and position x frequency in float32 would drift by 1e-3 of a radian by position 100,000.
        self.inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        cos, sin = self._cos_sin(0, max_positions)  # (positions, head_dim/2)
        # Derived, not learned: kept out of the state dict so checkpoints don't depend on them.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _cos_sin(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(torch.arange(start, end, dtype=torch.float64), self.inv_freq)
        return angles.cos().float(), angles.sin().float()

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate x (B, n_head, T, head_dim) as positions start .. start + T - 1."""
        T, half = x.size(-2), x.size(-1) // 2
        if start + T <= self.cos.size(0):
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        else:  # past the table (a rolling model's generation): the same angles, computed for these positions
            cos, sin = (t.to(x.device) for t in self._cos_sin(start, start + T))
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
