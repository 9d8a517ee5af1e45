"""The machine a run runs on: device, precision (autocast, TF32), memory and speed; and torchrun's processes (World:
which rank does what, the collectives, the model wrapped for DDP or FSDP2). Files: common/files.py."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import timeit
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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


@dataclass(frozen=True)
class World:
    """One process: every collective is the identity, so the loop has one code path (torchrun's: Torchrun)."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # rank 0 alone logs, writes metrics and checkpoints, and talks to wandb

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def open(self, device: torch.device) -> None:
        """Join the other processes (Torchrun)."""

    def close(self) -> None:
        """Leave them (Torchrun)."""

    def wrap(self, model: nn.Module, blocks: nn.ModuleList, parallel: str, device: torch.device) -> nn.Module:
        return model  # Torchrun's: DDP or FSDP2 (blocks: what FSDP2 shards one by one)

    def barrier(self) -> None:
        """Wait for every rank."""

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order, on every rank."""
        return [value]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def agree_on_step(self, step_loss: torch.Tensor, stop_requested: bool) -> tuple[torch.Tensor, bool]:
        """The loss averaged over the ranks, and whether any was asked to stop: all skip or stop at the same step."""
        return step_loss, stop_requested


class Torchrun(World):
    """One of torchrun's processes: the collectives are torch.distributed's."""

    def open(self, device: torch.device) -> None:
        """NCCL between GPUs, gloo between CPU processes; each GPU process on the GPU of its local rank."""
        if dist.is_initialized():
            return
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if cuda else "gloo", device_id=device if cuda else None)

    def close(self) -> None:
        close_process_group()

    def wrap(self, model: nn.Module, blocks: nn.ModuleList, parallel: str, device: torch.device) -> nn.Module:
        """DDP replicates the model; FSDP2 shards parameters, gradients and optimizer state in place."""
        if parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (self.size,))
            for block in blocks:  # one all-gather per block, freed after use
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)  # the rest: embeddings (tied to the head) and the final norm
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def barrier(self) -> None:
        dist.barrier()

    def all_gather(self, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def agree_on_step(self, step_loss: torch.Tensor, stop_requested: bool) -> tuple[torch.Tensor, bool]:
        both = torch.stack((step_loss, torch.tensor(float(stop_requested), device=step_loss.device)))
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        return both[0] / self.size, bool(both[1] > 0)


def world_from_env() -> World:
    """The rank and world size torchrun sets in each process's environment (none: a single process)."""
    size = int(os.environ.get("WORLD_SIZE", 1))
    return (Torchrun if size > 1 else World)(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), size)


def close_process_group() -> None:
    """Free the process groups now: a gloo group kept by FSDP2's DeviceMesh can SIGABRT if freed at interpreter exit."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:  # not isinstance: its metaclass check trips deprecation warnings
            getattr(obj, "_pg_registry", {}).clear()
    gc.collect()  # the trainer's reference cycles hold the sharded model, and with it the group


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients across processes only on the last micro-batch of a step: the others accumulate locally."""
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(enabled)
    with module.no_sync() if hasattr(module, "no_sync") and not enabled else contextlib.nullcontext():  # DDP
        yield


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> tuple[dict, dict]:
    """Whole state keyed by name, loadable by any number of processes; under FSDP2 every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=world.distributed)
    model_state = get_model_state_dict(model, options=options)
    # Before the first step the optimizer has no state, and asking for it would take a step with zero gradients.
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else None
    return model_state, optimizer_state


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict | None) -> None:
    """The inverse of full_state, on every rank (each shards what it reads); the optimizer state keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
