"""`train.py resume=true`: the saved settings, changed only in CHANGEABLE_ON_RESUME keys unless resume_with_changes."""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.config import shown, typed_config
from common.errors import CheckpointError, ConfigError
from common.files import CKPT_NAME, HYDRA_NAME
from model import GPTConfig
from model.checkpoint import Checkpoint, saved_config
from model.hf_gpt2 import SETTINGS as PRETRAINED_SETTINGS

log = logging.getLogger("train")
CONFIG_GROUPS = ("experiment", "model", "data")  # train.py's Hydra groups: configs/<group>/NAME.yaml, as group=NAME

# Keys a resume may change freely: where and how the steps run (attn_impl: the same function), evaluation, logs
CHANGEABLE_ON_RESUME = frozenset({
    "out_dir", "device", "model.attn_impl", "data.num_proc",
    *(f"train.{key}" for key in ("eval_interval", "eval_from", "eval_iters", "full_val", "target_val_loss", "keep_best",
                                 "log_interval", "compile", "activation_checkpointing", "dtype", "on_nonfinite",
                                 "peak_tflops", "parallel", "hellaswag_every", "hellaswag_file", "head_scores")),
})
# model.* keys a checkpoint's weights don't fix (the rest is its shape, never changed: check_same_shape says so)
FREE_MODEL_KEYS = ("attn_impl", "dropout")


def resumed_config(cfg: DictConfig, overrides: list[str], schema: type) -> DictConfig:
    """The checkpoint's saved config, then the command's overrides as composed into cfg; a config group must be the
    run's own (.hydra/hydra.yaml). No readable checkpoint: cfg as is, for the run's start to report."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out_dir = Path(cfg.out_dir)
    saved = saved_config(out_dir / CKPT_NAME)
    if saved is None:
        return cfg
    base = OmegaConf.create(_known_keys(saved, schema, out_dir / CKPT_NAME))
    if isinstance(base.get("model"), DictConfig) and "vocab_multiple" not in base.model:  # saved before the key
        base.model.vocab_multiple = 1  # those runs' tables were unpadded
    base.resume, base.resume_with_changes = True, False  # asked anew each time, never inherited from a resume
    try:  # the config groups the run was started with (Hydra's runtime.choices, which train.py keeps in .hydra/)
        recorded = dict(OmegaConf.select(OmegaConf.load(out_dir / HYDRA_NAME / "hydra.yaml"), "hydra.runtime.choices"))
    except Exception:  # missing, unreadable, not YAML, or without choices: no record
        recorded = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key, raw = override.key_or_group, override.value()
        if override.is_hydra_override():
            continue
        if key in CONFIG_GROUPS and not override.is_delete():
            if key in recorded and recorded[key] == raw:
                continue  # the start command repeated
            was = f"was started with {key}={shown(recorded[key])}" if key in recorded else "keeps no record of them"
            raise ConfigError(f"{key}={shown(raw)}: resume=true continues {out_dir} with the settings it was started "
                              f"with, and it {was}; drop {key}={shown(raw)} (set the keys you mean to change, with "
                              "resume_with_changes=true)")
        if override.is_delete():
            raise ConfigError(f"~{key}: resume=true continues the run with its saved settings, so there is nothing "
                              f"to delete; set {key}=VALUE instead")
        value = raw if isinstance(raw, str) and "${" in raw else OmegaConf.select(cfg, key)  # ${..}: the run's
        OmegaConf.update(base, key, value, merge=False, force_add=True)
    base.out_dir = str(out_dir)  # the directory whose checkpoint was read (where the run writes train.log)
    try:  # a saved value of another type, or an interpolation in one, said here (train() would quote OmegaConf)
        typed_config(base, schema)
    except OmegaConfBaseException as err:
        why = str(err.msg).partition("\n")[0]
        raise CheckpointError(f"{out_dir / CKPT_NAME} can't be used: its config's {err.full_key}: {why}") from None
    return base


def _known_keys(saved: dict[str, Any], schema: type, path: Path, prefix: str = "") -> dict[str, Any]:
    """The saved config less keys this version's schema no longer has (nothing reads them); a group of keys saved as
    anything but a mapping is refused."""
    hints = typing.get_type_hints(schema)
    for key in saved.keys() & {key for key, hint in hints.items() if dataclasses.is_dataclass(hint)}:
        if not isinstance(saved[key], dict):
            raise CheckpointError(f"{path} can't be used: its config's {prefix}{key} is a "
                                  f"{type(saved[key]).__name__}, not a mapping")
    return {key: _known_keys(value, hints[key], path, f"{prefix}{key}.") if dataclasses.is_dataclass(hints[key])
            else value for key, value in saved.items() if key in hints}


def check_resume(checkpoint: Checkpoint, config: Any) -> None:
    """Before any data is prepared: the checkpoint's optimizer and model shape (a finetune's is checked once loaded),
    the changes this command makes to what the run trains, and a max_iters it has already passed."""
    before, optimizer = checkpoint.config.get("train", {}).get("optimizer", "adamw"), config.train.optimizer
    if before != optimizer:  # one optimizer's state is no start for another's
        raise CheckpointError(f"resume=true with train.optimizer={optimizer}, but the checkpoint's run was trained "
                              f"with {before}; resume with train.optimizer={before}, or start a new run")
    if config.init_from is None:
        check_same_shape(checkpoint.model_config, config.model.with_vocabulary(checkpoint.model_config.vocab_size))
    done = checkpoint.progress.iter
    if config.train.max_iters < done:
        raise ConfigError(f"train.max_iters={config.train.max_iters} is below the {done} iterations the run already "
                          f"took; resume with train.max_iters={done} or more, or sample and evaluate the run as it is")
    check_resume_changes(checkpoint.config, dataclasses.asdict(config), config.resume_with_changes)


def check_resume_changes(saved: dict[str, Any], current: dict[str, Any], allowed: bool) -> None:
    """Log each key changed from the saved run; refuse those outside CHANGEABLE_ON_RESUME and wandb.* unless allowed.
    The optimizer and the model's shape have their own refusals, whatever resume_with_changes says."""
    changes = [(key, old, new) for key, old, new in _differences(saved, current) if key != "train.optimizer"
               and not (key.startswith("model.") and key.removeprefix("model.") not in FREE_MODEL_KEYS)]
    meaningful = [(key, old, new) for key, old, new in changes
                  if key not in CHANGEABLE_ON_RESUME and not key.startswith("wandb.")]
    if meaningful and not allowed:
        listed = ", ".join(f"{key} {shown(old)} -> {shown(new)}" for key, old, new in meaningful)
        raise ConfigError(f"resume=true would change what the run trains ({listed}); drop those overrides to "
                          "continue the run as it was, or add resume_with_changes=true to resume with them")
    for key, old, new in changes:
        log.info(f"resume: {key} changed from {shown(old)} to {shown(new)}")


def _differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    found = []
    for key in [key for key in current if key in saved]:
        old, new = saved[key], current[key]
        if isinstance(old, dict) and isinstance(new, dict):
            found += _differences(old, new, f"{prefix}{key}.")
        elif old != new and f"{prefix}{key}" not in ("resume", "resume_with_changes"):
            found.append((f"{prefix}{key}", old, new))
    return found


def check_same_shape(saved: GPTConfig, current: GPTConfig) -> None:
    old, new = dataclasses.asdict(saved), dataclasses.asdict(current)
    changed = [k for k in new if k not in FREE_MODEL_KEYS and old[k] != new[k]]
    if "vocab_size" in changed:  # the data's, not an override
        raise CheckpointError(f"resume=true, but the data's vocabulary has {new['vocab_size']} tokens and the "
                              f"checkpoint's model {old['vocab_size']}: resume with the data.* the run was trained on, "
                              "or start a new run")
    if changed:
        diffs = ", ".join(f"{k}: {old[k]} -> {new[k]}" for k in changed)
        raise CheckpointError(f"resume=true with a model that differs from the checkpoint's ({diffs}); drop the "
                              "model.* overrides that change it (none given: the checkpoint contradicts its config)")


def resumed_model_config(checkpoint: Checkpoint, config: Any, data_meta: dict[str, Any]) -> GPTConfig:
    """The model a resume builds: model.*, refused if it changes the checkpoint's shape (a finetune's shape is the
    pretrained model's as saved, with block_size and the settings its weights leave open from model.*); data of
    another vocabulary or tokenizer is refused."""
    if config.init_from is None:
        model_config = config.model.with_vocabulary(data_meta["vocab_size"])
    else:
        settings = {k: getattr(config.model, k) for k in ("block_size", *PRETRAINED_SETTINGS)}
        model_config = dataclasses.replace(checkpoint.model_config, **settings)
    check_same_shape(checkpoint.model_config, model_config)
    if checkpoint.tokenizer_for_decoding(Path(config.out_dir) / CKPT_NAME) != data_meta["tokenizer"]:
        raise CheckpointError("resume=true with data tokenized differently from the checkpoint's; use its data")
    return model_config


def resume_command(out_dir: Path) -> str:
    return f"python train.py {resume_argument(out_dir)} resume=true"


def resume_argument(out_dir: Path) -> str:
    """out_dir=PATH that the shell, then Hydra, read back as PATH: bare if plain, else quoted for Hydra, then shell."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = str(out_dir)
    plain = re.fullmatch(r"[A-Za-z0-9_./:+@%-]+", path)  # and read back as this text, not a number or a bool
    if plain and OverridesParser.create().parse_overrides([f"out_dir={path}"])[0].value() == path:
        return f"out_dir={path}"
    # Hydra: a quote is escaped, and so are the backslashes right before a quote or the closing one
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", path)
    argument = "out_dir='" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body) + "'"
    return f'"{argument}"' if not re.search(r'["$`\\!]', argument) else shlex.quote(argument)
