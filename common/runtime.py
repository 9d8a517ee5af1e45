"""Device, precision (autocast, TF32), memory, whole-file writes (a temporary renamed over the target: old or new)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from common.errors import ConfigError, DataError, DiskFull

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
FULL_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # no space left, a spent quota
NEARLY_FULL = 1 << 20  # free bytes under which a failed write counts as a full disk's


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


@contextlib.contextmanager
def unless_disk_full(path: Path) -> Iterator[None]:
    """A full disk while writing `path` is one line (numpy and torch.save don't always say ENOSPC: nearly full)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else NEARLY_FULL
        if getattr(err, "errno", None) not in FULL_ERRNOS and free >= NEARLY_FULL:
            raise
        where = f"the disk holding {path.parent} is full ({free / 2**20:,.1f} MiB free)"
        raise DiskFull(f"{path} not written: {where}") from None


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """write(f) fills PATH.tmp, synced, then renamed over `path`: a reader sees one whole file, and the directory synced
    makes the rename durable (Windows can't open a directory, some filesystems can't sync one). One writer at a time
    (a run's lock, a data folder's): a killed writer's PATH.tmp is overwritten; a link there is removed, never
    written through."""
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with unless_disk_full(path):
            tmp.unlink(missing_ok=True)
            with open(tmp, "xb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        replace_file(tmp, path)
    except BaseException:  # a full disk, a second Ctrl-C: the previous file stays as it was
        tmp.unlink(missing_ok=True)
        raise
    try:
        handle = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))


def replace_file(source: Path, target: Path) -> None:
    """os.replace, the atomic step on every platform. Windows won't replace a file another process has open (sample.py
    reading it); readers are brief, so there it is tried again, waiting longer each time."""
    for attempt in range(1, 10 if sys.platform == "win32" else 1):
        with contextlib.suppress(PermissionError):
            return os.replace(source, target)
        time.sleep(0.05 * attempt)
    os.replace(source, target)


def why_not_a_file(path: Path) -> str:
    """What stands at a path that is no regular file, in words: nothing, a directory, a link, or something else."""
    if not path.exists():
        return "is a broken symbolic link" if path.is_symlink() else "does not exist"
    if path.is_dir():
        return "is a directory"
    if path.is_symlink():
        return "is a symbolic link"
    return "is not a regular file (a pipe, a device or a socket)"


def check_regular_file(path: Path) -> None:
    """Refuse anything at `path` but a regular file (or a link to one): a FIFO there would block its reader forever."""
    if path.exists() and not path.is_file():
        raise DataError(f"{path} {why_not_a_file(path)}; remove it, or name another directory")


def make_directory(path: Path, named: str) -> None:
    """A directory (with its parents) made unless there; `named`, how its one-line errors name it (out_dir=runs/x)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _not_made(err, path, named) from None


def _not_made(err: OSError, path: Path, named: str) -> Exception:
    """A directory's mkdir error as one line: a file where it goes, no permission, a full disk or no inodes left."""
    if isinstance(err, FileExistsError | NotADirectoryError):
        return ConfigError(f"{named}: {err.filename or path} is a file, not a directory; name another")
    if isinstance(err, PermissionError):
        return ConfigError(f"{named} is not writable ({err.strerror}: {err.filename}); name a folder you can write to")
    if err.errno in FULL_ERRNOS:
        return DiskFull(f"{named} not made: the disk holding it is full (no space or no inodes left)")
    return err
