"""Rotary position embeddings (RoFormer): each query and key channel pair is rotated by an angle that grows with
the position, so a query-key score depends on how far apart the two tokens are, not where they sit."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (positions, head_dim/2)
        # Derived, not learned: kept out of the state dict so checkpoints don't depend on them.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate x (B, n_head, T, head_dim) as positions start .. start + T - 1."""
        T, half = x.size(-2), x.size(-1) // 2
        if start + T <= self.cos.size(0):
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        else:  # past the table (a rolling model's generation): the same angles, computed for these positions
            positions = torch.arange(start, start + T, dtype=torch.float32, device=x.device)
            angles = torch.outer(positions, self.inv_freq.float())
            cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
