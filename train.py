"""Train a GPT. Examples:

python train.py experiment=shakespeare_char_cpu        # CPU, a few minutes
python train.py model=shakespeare train.max_iters=5000  # GPU
python train.py --cfg job                              # show the resolved config
python train.py -m train.learning_rate=1e-3,3e-3       # a sweep: one run directory per job under multirun/
torchrun --standalone --nproc_per_node=8 train.py experiment=gpt2   # 8 GPUs (DDP; train.parallel=fsdp: FSDP2)
"""

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from common.cli import check_overrides, exit_on_user_error
from common.files import write_text_atomically
from training.distributed import world_from_env
from training.loop import train
from training.resume import resumed_config
from training.schema import TrainRunConfig, register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    job = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        job = f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)})"
        if not any(o.lstrip("+").startswith("out_dir=") for o in hydra_cfg.overrides.task):
            cfg.out_dir = hydra_cfg.runtime.output_dir  # one run directory per job, under the sweep directory
    with exit_on_user_error(job):
        on_run_opened = _hydra_files(cfg, hydra_cfg)
        if cfg.resume:
            cfg = resumed_config(cfg, list(hydra_cfg.overrides.task), TrainRunConfig)
        result = train(cfg, on_run_opened=on_run_opened)
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


def _quiet_hydra_on_other_ranks(argv: list[str]) -> list[str]:
    """Under torchrun only rank 0 writes Hydra's files (train.py writes .hydra/ on rank 0; Hydra train.log); the
    others log to the console and stay in the current directory, since their ${now:} may differ from rank 0's
    (the run dir is rank 0's)."""
    if world_from_env().is_main:
        return argv
    return [*argv, "hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


if __name__ == "__main__":
    check_overrides(sys.argv[1:], TrainRunConfig)
    sys.argv = _quiet_hydra_on_other_ranks(sys.argv)
    main()
