"""Train a GPT: `python train.py experiment=shakespeare_char_cpu`; --help: settings; torchrun: docs/scaling.md."""

import logging
import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from common.config import exit_on_user_error, presets, run_hydra
from training.config import TrainRunConfig, register_schemas
from training.resume import CONFIG_GROUPS, resumed_config
from training.run import train

register_schemas()
log = logging.getLogger("train")


def usage() -> str:
    """`python train.py --help`: the keys set most; every key: --cfg job, docs/reference.md."""
    return f"""Train a GPT. Settings are Hydra overrides, key=value, no dashes.

  python train.py experiment=shakespeare_char_cpu                 # a CPU, about 2 minutes
  python train.py experiment=speedrun_cpu out_dir=runs/fast       # the CPU speedrun: docs/speedrun.md

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
  python train.py experiment=speedrun_cpu --cfg job --resolve     # every key, out_dir's date filled in

Every key: docs/reference.md. Hydra's own flags: --hydra-help."""


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    job, task = None, hydra_cfg.overrides.task
    if hydra_cfg.mode == RunMode.MULTIRUN:  # a job's run directory is its own, under the sweep's, unless out_dir is set
        job = f"job {hydra_cfg.job.num} ({' '.join(task)})"
        if not any(o.lstrip("+").startswith("out_dir=") for o in task):
            cfg.out_dir = hydra_cfg.runtime.output_dir
    elif not task:  # `python train.py` alone runs something: said, so that nobody mistakes it for a chosen recipe
        choices = hydra_cfg.runtime.choices
        log.info(f"no settings given: configs/config.yaml's defaults, model={choices.model} on data={choices.data} for "
                 f"{cfg.train.max_iters:,} iterations into out_dir {cfg.out_dir} (the log lines' ETA says how long); "
                 "python train.py --help lists the experiments")
    with exit_on_user_error(job):
        if cfg.resume:
            cfg = resumed_config(cfg, list(task), TrainRunConfig)
        result = train(cfg, hydra_record=_hydra_record(cfg, hydra_cfg))
    if result.stopped_by is not None:
        sys.exit(128 + signal.Signals[result.stopped_by].value)  # the shell's convention for "killed by"


def _hydra_record(cfg: DictConfig, hydra_cfg: DictConfig) -> dict[str, str]:
    """Hydra's record of the command, for out_dir/.hydra/ (Hydra itself writes none: the run does, once it holds
    out_dir); interpolations unresolved."""
    records = {"config.yaml": cfg, "hydra.yaml": {"hydra": hydra_cfg}, "overrides.yaml": hydra_cfg.overrides.task}
    return {name: OmegaConf.to_yaml(record) for name, record in records.items()}


if __name__ == "__main__":
    run_hydra(main, TrainRunConfig, CONFIG_GROUPS, usage)
