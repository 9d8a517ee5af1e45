"""Where the model runs and in which precision: device detection, autocast, TF32."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

import torch

from common.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda", "mps")  # the `device` key's values; auto: cuda > mps > cpu
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the `dtype` keys' values; auto: bf16 autocast on CUDA GPUs that support it, float32 elsewhere
DTYPES = ("auto", *_TORCH_DTYPES)
# Dense (no sparsity) tensor-core peaks in FLOP/s, (bf16/fp16, tf32), from NVIDIA's datasheets: MFU's denominator.
# Matched against torch.cuda.get_device_name() as whole words, most specific first; elsewhere train.peak_tflops.
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
class Runtime:
    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def synchronize(self) -> None:
        synchronize(self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """float32, bfloat16, float16: the dtype keys' names."""
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def make_runtime(device: str, dtype: str, gpu_index: int | None = None) -> Runtime:
    """device and dtype: names from DEVICES and DTYPES (the config checked them); gpu_index: the GPU of a
    torchrun process (its local rank)."""
    dev = _resolve_device(device)
    if dev.type == "cuda" and gpu_index is not None:
        dev = torch.device("cuda", gpu_index)
    if dtype == "auto":
        native_bf16 = dev.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)  # Ampere on
        resolved = torch.bfloat16 if native_bf16 else torch.float32
    else:
        resolved = _TORCH_DTYPES[dtype]
    if dev.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
    return Runtime(dev, resolved)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is available; use device=cpu or device=auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but MPS is not available; use device=cpu or device=auto")
    return torch.device(name)


def memory_bytes(device: torch.device) -> int | None:
    """The most memory a run on `device` can have: a GPU's own, else this machine's RAM; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None


def check_memory(need: float, device: torch.device, what: str, fix: str) -> None:
    """A ConfigError, before allocating, when `need` bytes (what `what` is predicted to take) outgrow the device's
    memory (memory_bytes); `fix` says what to lower."""
    memory = memory_bytes(device)
    if memory is not None and need > memory:
        where = "the GPU's" if device.type == "cuda" else "this machine's"
        raise ConfigError(
            f"{what} needs about {need / 2**30:,.1f} GiB, more than {where} {memory / 2**30:,.1f} GiB; {fix}"
        )


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """The GPU's datasheet peak in FLOP/s for `dtype` (GPU_PEAKS), or None where none is known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for model, half, tf32 in GPU_PEAKS:
        if re.search(rf"\b{re.escape(model)}\b", name):
            return half if dtype in (torch.bfloat16, torch.float16) else tf32
    return None
