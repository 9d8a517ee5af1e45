"""Train a GPT. Examples:

python train.py experiment=shakespeare_char_cpu        # CPU, a few minutes
python train.py model=shakespeare train.max_iters=5000  # GPU
python train.py --cfg job                              # show the resolved config
python train.py -m train.learning_rate=1e-3,3e-3       # a sweep: one run directory per job under multirun/
torchrun --standalone --nproc_per_node=8 train.py experiment=gpt2   # 8 GPUs (DDP; train.parallel=fsdp: FSDP2)
"""

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hydra
from filelock import FileLock, Timeout
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from common.cli import check_overrides, exit_on_user_error, presets
from common.files import check_writable, write_text_atomically
from training.distributed import world_from_env
from training.loop import train
from training.resume import resumed_config
from training.run_lock import HOLDER_NAME, LOCK_NAME
from training.schema import CONFIG_GROUPS, TrainRunConfig, register_schemas

register_schemas()


def usage() -> str:
    """`python train.py --help`: the keys set most; every key: --cfg job, docs/reference.md."""
    return f"""Train a GPT. Settings are Hydra overrides, key=value, no dashes.

  python train.py experiment=shakespeare_char_cpu                 # a CPU, about 2 minutes
  python train.py experiment=speedrun_cpu out_dir=runs/fast       # the CPU speedrun, about 20 s

Presets (group=NAME):
  experiment   {", ".join(presets("experiment"))}
  model        {", ".join(presets("model"))}
  data         {", ".join(presets("data"))}

Keys set most:
  out_dir=DIR             the run directory (ckpt.pt, metrics.jsonl, config.yaml); default outputs/DATE/TIME
  resume=true             continue the run in out_dir with its saved settings
                          (changing what it trains, e.g. train.max_iters: add resume_with_changes=true)
  data.input=FILE         train on your own UTF-8 text instead of tiny Shakespeare
  device=cpu|cuda|mps     default: the best there is
  train.max_iters=N       optimizer steps; the learning rate decays to train.min_lr over them
  train.learning_rate=X   the peak learning rate
  train.batch_size=N      sequences per micro-batch (train.grad_accum=N micro-batches per step)
  train.eval_interval=N   evaluate, log and save ckpt.pt every N steps
  model.n_layer=N model.n_head=N model.n_embd=N model.block_size=N   the model's shape
  train.compile=true      torch.compile the model (default: on for CUDA)

Examples:
  python train.py experiment=shakespeare_char_cpu train.max_iters=500 out_dir=runs/short
  python train.py out_dir=runs/short resume=true                  # after Ctrl-C: the run goes on as it was
  python train.py -m experiment=speedrun_cpu train.learning_rate=3e-3,6e-3   # a sweep, one run per value
  python train.py experiment=speedrun_cpu --cfg job               # the resolved config, every key

Every key: docs/reference.md. Hydra's own flags: --hydra-help."""


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    job = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        job = f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)})"
        if not any(o.lstrip("+").startswith("out_dir=") for o in hydra_cfg.overrides.task):
            cfg.out_dir = hydra_cfg.runtime.output_dir  # one run directory per job, under the sweep directory
    opened: list[Path] = []
    save_hydra_files = _hydra_files(cfg, hydra_cfg)

    def on_run_opened(out_dir: Path) -> None:
        opened.append(out_dir)
        save_hydra_files(out_dir)

    try:
        with exit_on_user_error(job):
            if cfg.resume:
                cfg = resumed_config(cfg, list(hydra_cfg.overrides.task), TrainRunConfig)
            result = train(cfg, on_run_opened=on_run_opened)
    except BaseException:  # a user's error (SystemExit 2 by now), Ctrl-C, a bug
        if not opened and job is None and world_from_env().is_main:  # failed before the run was opened
            _remove_unopened_run_dir(Path(cfg.out_dir), BEFORE_HYDRA)
        raise
    if result.stopped_by is not None:
        sys.exit(128 + signal.Signals[result.stopped_by].value)  # the shell's convention for "killed by"


def _hydra_files(cfg: DictConfig, hydra_cfg: DictConfig) -> Callable[[Path], None]:
    """Hydra's record of the command (.hydra/: config.yaml, hydra.yaml, overrides.yaml), written once this
    process holds the run and the run accepted the command. Hydra would write it before train.py could check
    either, so the config turns Hydra's own writing off (hydra.output_subdir: null)."""
    records = {
        "config.yaml": OmegaConf.create(OmegaConf.to_container(cfg)),  # as composed, interpolations unresolved
        "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
        "overrides.yaml": OmegaConf.create(list(hydra_cfg.overrides.task)),
    }

    def save(out_dir: Path) -> None:
        if cfg.resume and (out_dir / ".hydra" / "hydra.yaml").is_file():
            return  # the record of the command that started the run stays: a resume reads its config groups
        (out_dir / ".hydra").mkdir(exist_ok=True)
        for name, record in records.items():
            write_text_atomically(out_dir / ".hydra" / name, OmegaConf.to_yaml(record))

    return save


RUN_DIR_MAKINGS = {"train.log", LOCK_NAME, HOLDER_NAME}  # what Hydra and the run lock put in a run directory
# Before Hydra made it: the outermost folder of out_dir that didn't exist, and which of RUN_DIR_MAKINGS an
# existing out_dir already held (those stay)
BEFORE_HYDRA: tuple[Path | None, set[str]] = (None, set())
_TIME = "<TIME>"  # stands for the default out_dir's last folder (outputs/DATE/TIME), named once Hydra runs


def _out_dir_named(args: list[str]) -> Path | None:
    named = [a.partition("=")[2] for a in args if a.lstrip("+").startswith("out_dir=")]
    return Path(os.path.expanduser(named[-1])) if named else None


def _before_hydra(args: list[str]) -> tuple[Path | None, set[str]]:
    """What making the run directory will create, as seen before Hydra makes it: the outermost missing folder of
    out_dir=..., or of the default outputs/DATE/TIME; and the run directory's makings already there."""
    path = _out_dir_named(args) or Path("outputs", time.strftime("%Y-%m-%d"), _TIME)
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    present = {name for name in RUN_DIR_MAKINGS if (path / name).exists()}
    return missing, present


def _remove_unopened_run_dir(out_dir: Path, before: tuple[Path | None, set[str]]) -> None:
    """A command that failed before training started (a typo, a missing file) takes back the run directory that
    Hydra (train.log) and the lock (.lock) made for it, and the folders above it that this command created. A
    folder that was there before, or holds anything else, stays."""
    root = logging.getLogger()
    for handler in root.handlers[:]:  # Hydra's train.log, open until the process ends
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == out_dir.absolute():
            handler.close()
            root.removeHandler(handler)
    missing, present = before
    out = out_dir.absolute()
    if missing is not None:  # made for this command: out_dir, and the folders from `top` down to it
        top = out if missing.name == _TIME else missing.absolute()
        if not (top == out or top in out.parents) or not out.is_dir():
            return
        if not {path.name for path in out.iterdir()} <= RUN_DIR_MAKINGS:
            return
    ours = RUN_DIR_MAKINGS - present
    with _unless_locked(out) as free:
        for name in ours - {LOCK_NAME} if free else ():
            (out / name).unlink(missing_ok=True)
    if not free:
        return
    if LOCK_NAME in ours:  # once released: a held lock's file can't go everywhere (Windows)
        (out / LOCK_NAME).unlink(missing_ok=True)
    if missing is None:  # out_dir was there: only what this command added to it went
        return
    folder = out
    while True:
        try:
            folder.rmdir()
        except OSError:  # not empty: something else lives there
            return
        if folder == top:
            return
        folder = folder.parent


@contextlib.contextmanager
def _unless_locked(out_dir: Path) -> Iterator[bool]:
    """Holds out_dir's run lock while the cleanup runs, so no other process starts on the directory meanwhile;
    False when another process holds it (started on the same directory): then its files are not ours."""
    if not (out_dir / LOCK_NAME).exists():
        yield True
        return
    lock = FileLock(out_dir / LOCK_NAME, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _quiet_hydra_on_other_ranks(argv: list[str]) -> list[str]:
    """Under torchrun only rank 0 writes Hydra's files (train.py writes .hydra/ on rank 0; Hydra train.log); the
    others log to the console and stay in the current directory, since their ${now:} may differ from rank 0's
    (the run dir is rank 0's)."""
    if world_from_env().is_main:
        return argv
    return [*argv, "hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


if __name__ == "__main__":
    BEFORE_HYDRA = _before_hydra(sys.argv[1:])
    check_overrides(sys.argv[1:], TrainRunConfig, CONFIG_GROUPS, usage())
    if world_from_env().is_main:  # Hydra makes out_dir first thing: a traceback if it can't
        with exit_on_user_error():
            check_writable(_out_dir_named(sys.argv[1:]) or Path("outputs"), "out_dir")
    sys.argv = _quiet_hydra_on_other_ranks(sys.argv)
    main()
