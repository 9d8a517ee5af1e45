"""Model FLOPs utilisation needs the hardware's peak: from a datasheet for known GPUs, else measured here.

Peers hard-code one GPU's peak, which is how users end up with MFU above 100% or near 0%.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from training.runtime import dtype_name, synchronize

# Dense (no sparsity) tensor-core peaks in FLOP/s: (bf16/fp16, tf32), from NVIDIA's datasheets. Matched against
# torch.cuda.get_device_name(), as whole words, most specific first; others get a measured peak.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835e12, 417.5e12),
    ("H200", 989e12, 494.5e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12),
    ("H100", 989e12, 494.5e12),
    ("A100", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 60e12),
    ("RTX 4090", 165e12, 82.6e12),
)


@dataclass(frozen=True)
class Peak:
    flops: float
    source: str  # what the figure is: "datasheet H100 bf16" or "measured fp32 matmul"

    @property
    def measured(self) -> bool:
        """Measured here (a CPU, an unknown GPU), not a datasheet's figure."""
        return self.source.startswith("measured")


def peak_flops(device: torch.device, dtype: torch.dtype) -> Peak:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, half, tf32 in GPU_PEAKS:
            if re.search(rf"\b{key}\b", name):
                if dtype in (torch.bfloat16, torch.float16):
                    return Peak(half, f"datasheet {key} {dtype_name(dtype)}")
                return Peak(tf32, f"datasheet {key} tf32")
    return Peak(measure_matmul_flops(device, dtype), f"measured {dtype_name(dtype)} matmul")


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    """The best of a few n×n matmuls: a practical peak for CPUs and GPUs without a datasheet entry.

    On a GPU a single matmul is over before a launch and a sync are, so each timing covers ten."""
    per_timing = 10 if device.type != "cpu" else 1
    n = n or (4096 if device.type != "cpu" else 1024)
    a = torch.ones(n, n, device=device, dtype=dtype)  # values don't matter; the global RNG stays untouched
    b = torch.ones(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        synchronize(device)
        start = time.perf_counter()
        for _ in range(per_timing):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / per_timing)
    return 2 * n**3 / best
