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
from common.files import check_writable, discard_temporaries
from training.build import build_trainer
from training.checkpoint import BEST_NAME, CKPT_NAME
from training.distributed import (
    World,
    barrier,
    broadcast_from_main,
    close_process_group,
    init_process_group,
    world_from_env,
)
from training.errors import RunLocked
from training.run_lock import before_opening, log_to_run_dir, remove_unopened_run_dir, run_lock
from training.runtime import make_runtime
from training.schema import OptimConfig, TrainRunConfig
from training.trainer import TrainResult

log = logging.getLogger("train")


def train(
    cfg: DictConfig | TrainRunConfig,
    before_step: Callable[[int], None] | None = None,
    on_run_opened: Callable[[Path], None] | None = None,
) -> TrainResult:
    """cfg: Hydra's config (typed and checked here, before anything runs) or a TrainRunConfig.
    before_step: called with the iteration before each optimizer step (a seam for tests).
    on_run_opened: called on rank 0 with out_dir once it holds the run and every check passed, just before the
    run's config.yaml is written (train.py writes Hydra's files then). A start that fails before then takes back
    what it made."""
    world = world_from_env()
    if not world.is_main:
        log.setLevel(logging.WARNING)  # one voice: rank 0's
    config = typed_config(cfg, TrainRunConfig)
    check_for_world(config.train, world)
    runtime = make_runtime(config.device, config.train.dtype, world.local_rank if world.distributed else None)
    out_dir = Path(config.out_dir)
    if world.is_main:
        check_writable(out_dir, "out_dir")
    before, opened = before_opening(out_dir), False
    init_process_group(world, runtime.device)
    try:
        with contextlib.ExitStack() as held:
            _lock_run(out_dir, world, held)
            trainer = build_trainer(config, world, runtime, before_step, on_run_opened)
            opened = True
            result = trainer.fit()
            barrier(world)  # leave together: none tears its process group down while rank 0 still writes
        return result
    except BaseException:  # a user's error, Ctrl-C, a bug
        if not opened and world.is_main:
            remove_unopened_run_dir(out_dir, before)
        raise
    finally:
        close_process_group()


def _lock_run(out_dir: Path, world: World, held: contextlib.ExitStack) -> None:
    """Rank 0 writes the run, so it alone holds the lock; if it can't (or fails trying), every rank stops. Then
    no other writer is mid-save: a killed one's checkpoint temporaries go."""
    error = None
    if world.is_main:
        try:
            held.enter_context(run_lock(out_dir))
            held.enter_context(log_to_run_dir(out_dir))
            for name in (CKPT_NAME, BEST_NAME):
                discard_temporaries(out_dir / name)
        except Exception as err:
            error = err
    message = broadcast_from_main(None if error is None else str(error), world)
    if error is not None:
        raise error
    if message is not None:  # the other ranks
        raise RunLocked(message)


def check_for_world(opt: OptimConfig, world: World) -> None:
    """The checks that need the number of processes."""
    if opt.grad_accum % world.size:
        raise ConfigError(
            f"train.grad_accum={opt.grad_accum} (micro-batches per step, all processes together) is not divisible "
            f"by the {world.size} processes; use a multiple of {world.size}"
        )
    if world.distributed and opt.parallel == "fsdp" and opt.optimizer == "muon":
        raise ConfigError(
            "train.optimizer=muon needs each hidden matrix whole, and train.parallel=fsdp shards them; "
            "use train.parallel=ddp (or train.optimizer=adamw)"
        )
