"""Device, precision (autocast, TF32), memory and speed: the machine a run runs on. Files: common/files.py."""

from __future__ import annotations

import contextlib
import os
import re
import timeit
from dataclasses import dataclass

import torch

from common.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda", "mps")  # the `device` key's values; auto: cuda > mps > cpu
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES = ("auto", *_TORCH_DTYPES)  # `dtype` values; auto: bf16 autocast on CUDA GPUs that support it, else float32
# Dense (no sparsity) tensor-core peaks in FLOP/s, (bf16/fp16, tf32), from NVIDIA's datasheets: MFU's denominator.
# Matched against torch.cuda.get_device_name() as whole words, most specific first; elsewhere train.peak_tflops.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835e12, 417.5e12), ("H200", 989e12, 494.5e12), ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12), ("H100", 989e12, 494.5e12), ("A100", 312e12, 156e12), ("L40S", 362e12, 183e12),
    ("L40", 181e12, 90.5e12), ("L4", 121e12, 60e12), ("RTX 4090", 165e12, 82.6e12),
)


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")  # float32, bfloat16 or float16, as the dtype key names them

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def make_runtime(device: str, dtype: str, gpu_index: int | None = None) -> Runtime:
    """device and dtype: the keys' values; gpu_index: a torchrun process's GPU (its local rank)."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if device == "auto":
        device = next(kind for kind, there in available.items() if there)
    elif not available[device]:
        raise ConfigError(f"device={device} is not available on this machine; use device=cpu or device=auto")
    dev = torch.device("cuda", gpu_index) if device == "cuda" and gpu_index is not None else torch.device(device)
    bf16 = dtype == "auto" and dev.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if dev.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
    return Runtime(dev, torch.bfloat16 if bf16 else _TORCH_DTYPES.get(dtype, torch.float32))


def memory_bytes(device: torch.device) -> int | None:
    """The most memory a run on `device` can have: a GPU's own, else this machine's RAM (None: not POSIX)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None


def check_memory(need: float, device: torch.device, what: str, fix: str) -> None:
    """A ConfigError before allocating when `need` bytes (for `what`) outgrow memory_bytes; `fix`: what to lower."""
    memory = memory_bytes(device)
    if memory is not None and need > memory:
        have = f"{'the GPU' if device.type == 'cuda' else 'this machine'}'s {memory / 2**30:,.1f} GiB"
        raise ConfigError(f"{what} needs about {need / 2**30:,.1f} GiB, more than {have}; {fix}")


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """The CUDA GPU's datasheet peak in FLOP/s for `dtype` (GPU_PEAKS), or None where none is known."""
    name = torch.cuda.get_device_name(device)
    for model, half, tf32 in GPU_PEAKS:
        if re.search(rf"\b{re.escape(model)}\b", name):
            return half if dtype in (torch.bfloat16, torch.float16) else tf32
    return None


def cpu_matmul_flops(threads: int, n: int = 256, repeats: int = 64) -> float:
    """FLOP/s of float32 n x n matmuls on the CPU with this many threads, over some 20 ms (torch's own count is put
    back). One thread's rate is a steady measure of the CPU; more threads going far slower than one say that other
    processes hold the cores: a thread descheduled mid-matmul leaves the others waiting for it."""
    own, a = torch.get_num_threads(), torch.ones(n, n)
    torch.set_num_threads(threads)
    try:
        a @ a  # warm-up
        return 2 * n**3 * repeats / timeit.timeit(lambda: a @ a, number=repeats)
    finally:
        torch.set_num_threads(own)
