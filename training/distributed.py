"""torchrun's processes: the process group, which rank does what, and the model wrapped for DDP or FSDP2."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


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

    def wrap(self, model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
        return model  # Torchrun's: DDP or FSDP2

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

    def wrap(self, model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
        """DDP replicates the model; FSDP2 shards parameters, gradients and optimizer state in place."""
        if parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (self.size,))
            for block in model.transformer.h:  # one all-gather per block, freed after use
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
