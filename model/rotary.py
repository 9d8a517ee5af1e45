"""Rotary embeddings (RoFormer): query/key channel pairs rotate with position, so scores depend only on distance."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
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
        return self._cos_sin_of(torch.arange(start, end, dtype=torch.float64), device)

    def _cos_sin_of(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of any positions (..., n) -> (..., n, head_dim/2), in float64 on `device`."""
        if device.type == "mps":
            device = torch.device("cpu")
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self.inv_freq.to(device)
        angles = positions.to(device, torch.float64).unsqueeze(-1) * self._inv_freq_on[device]
        return angles.cos().float(), angles.sin().float()

    def forward(self, x: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        """Rotate x (B, n_head, T, head_dim) as positions start .. start + T - 1 (a (B, 1) start: per row)."""
        T, half = x.size(-2), x.size(-1) // 2
        if isinstance(start, torch.Tensor):
            positions = start + torch.arange(T, device=start.device)  # (B, T)
            if int(positions.max()) < self.cos.size(0):
                cos, sin = self.cos[positions], self.sin[positions]
            else:  # past the table (a rolling model's rows)
                cos, sin = (t.to(x.device, self.cos.dtype) for t in self._cos_sin_of(positions, x.device))
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, head_dim/2): every head alike
        elif start + T <= self.cos.size(0):
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        else:  # past the table (a rolling model's generation): the same angles, computed for these positions
            cos, sin = (t.to(x.device, self.cos.dtype) for t in self._cos_sin(start, start + T, x.device))
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
