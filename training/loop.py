"""train(cfg): the entry point of train.py (which bench.py and scripts/gpu_check.py run too) and of the tests.
One process's part of the run: all of it alone, or one rank's under torchrun. The loop itself is Trainer.fit
(training/trainer.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from common.config import typed_config
from common.errors import ConfigError
from training.build import build_trainer
from training.distributed import World, barrier, close_process_group, init_process_group, world_from_env
from training.run_lock import run_lock
from training.runtime import make_runtime
from training.schema import OptimConfig, TrainRunConfig
from training.trainer import TrainResult

log = logging.getLogger("train")


def train(cfg: DictConfig | TrainRunConfig, before_step: Callable[[int], None] | None = None) -> TrainResult:
    """cfg: Hydra's config (typed and checked here, before anything runs) or a TrainRunConfig.
    before_step: called with the iteration before each optimizer step (a seam for tests)."""
    world = world_from_env()
    if not world.is_main:
        log.setLevel(logging.WARNING)  # one voice: rank 0's
    config = typed_config(cfg, TrainRunConfig)
    check_for_world(config.train, world)
    runtime = make_runtime(config.device, config.train.dtype, world.local_rank if world.distributed else None)
    init_process_group(world, runtime.device)
    try:
        # Rank 0 writes the run, so it alone holds the lock; the others follow its out_dir.
        with run_lock(Path(config.out_dir)) if world.is_main else contextlib.nullcontext():
            result = build_trainer(config, world, runtime, before_step).fit()
            barrier(world)  # leave together: none tears its process group down while rank 0 still writes
        return result
    finally:
        close_process_group()


def check_for_world(opt: OptimConfig, world: World) -> None:
    """The one check that needs the number of processes."""
    if opt.grad_accum % world.size:
        raise ConfigError(
            f"train.grad_accum={opt.grad_accum} (micro-batches per step, all processes together) is not divisible "
            f"by the {world.size} processes; use a multiple of {world.size}"
        )
