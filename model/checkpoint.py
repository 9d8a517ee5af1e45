"""ckpt.pt, the one owner of its format: a flat dict of tensors and plain values (Checkpoint's and Progress's fields,
model_config as a dict) that a resumed run and sample.py need. _upgraded brings older files up to date."""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.errors import CheckpointError, ConfigError
from common.runtime import write_atomically
from model.gpt import GPT, GPTConfig

CKPT_NAME = "ckpt.pt"  # the latest state, to resume from
BEST_NAME = "best.pt"  # with train.keep_best: the state of the lowest val loss so far


@dataclass
class Progress:
    """Where the run is: with the weights, the optimizer and the random state, all a resume needs."""

    iter: int = 0  # optimizer steps taken
    last_eval_iter: int = -1  # the iteration of the last evaluation (-1: none yet)
    val_loss: float = math.nan  # at that evaluation
    best_val_loss: float = math.inf
    kept_best_val_loss: float = math.inf  # that of best.pt (train.keep_best); inf: none kept in this run yet
    elapsed_s: float = 0.0  # the run's wall time at the last save, over all the processes that resumed it
    log_loss_sum: float = 0.0  # the train losses since the last log line, summed: the next line's mean is exact
    log_steps: int = 0  # and their number


@dataclass
class Checkpoint:
    model_config: GPTConfig
    model: dict[str, torch.Tensor]  # the plain module's names (not compiled, wrapped or sharded)
    tokenizer: dict[str, Any]  # data.tokenizers' metadata: the vocabulary samples are decoded with
    config: dict[str, Any] = field(default_factory=dict)  # the run's resolved config
    progress: Progress = field(default_factory=Progress)
    optimizer: dict[str, Any] | None = None  # keyed by parameter name; None before the first step
    scaler: dict[str, Any] = field(default_factory=dict)  # the GradScaler's; empty unless fp16
    rng: list[dict[str, Any]] = field(default_factory=list)  # each rank's dropout generators, in rank order
    dtype: str = ""  # the precision the run trained in (float32, bfloat16, float16); "": not recorded

    def to_dict(self) -> dict[str, Any]:
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "progress"} | vars(self.progress)
        return flat | {"model_config": dict(vars(self.model_config))}

    @classmethod
    def from_dict(cls, raw: Any, path: Path) -> Checkpoint:
        if not isinstance(raw, dict) or "model" not in raw or "model_config" not in raw:
            raise CheckpointError(f"{path} is not a checkpoint written by train.py")
        raw = dict(raw) if raw.keys() == _KEYS else _upgraded(raw)
        progress = Progress(**{f.name: raw.pop(f.name) for f in fields(Progress)})
        try:
            model_config = GPTConfig(**raw.pop("model_config"))
        except (TypeError, ConfigError) as err:
            raise CheckpointError(f"{path} has a model config this version can't build ({err})") from None
        return cls(model_config=model_config, progress=progress, **raw)

    def build_model(self, attn_impl: str | None = None) -> GPT:
        """The trained model; attn_impl may differ from the training run's, since both paths share weights."""
        model = GPT(dataclasses.replace(self.model_config, attn_impl=attn_impl or self.model_config.attn_impl))
        try:
            model.load_state_dict(self.model)
        except (RuntimeError, TypeError) as err:  # missing, unexpected or misshapen weights: the first one named
            detail = " ".join(str(err).split("\n\t")[1:2]) or str(err)
            raise CheckpointError(f"the checkpoint's weights don't fit its model_config: {detail.strip()}") from None
        return model

    def tokenizer_for_decoding(self, path: Path) -> dict[str, Any]:
        """The tokenizer's metadata; a checkpoint without one (an export's input needs none) can't sample or resume."""
        if not self.tokenizer:
            raise CheckpointError(f"{path} holds no tokenizer: it wasn't written by train.py")
        return self.tokenizer

    def optimizer_state_for(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer state keyed by parameter name; older checkpoints' by position are named in the optimizer's
        order, which make_optimizer keeps."""
        state = self.optimizer
        if state is None or not any(isinstance(key, int) for key in state["state"]):
            return state
        names = {id(p): name for name, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        return {
            "state": {order[i]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
        }


_KEYS = {f.name for f in fields(Checkpoint) if f.name != "progress"} | {f.name for f in fields(Progress)}


def _upgraded(old: dict[str, Any]) -> dict[str, Any]:
    """An older layout in today's: keys added since at their defaults, rng a list of each rank's states, an empty
    optimizer state None and an absent scaler's {}."""
    new = {**Checkpoint(GPTConfig(), {}, {}).to_dict(), **{key: old[key] for key in _KEYS & old.keys()}}
    new["rng"] = [new["rng"]] if isinstance(new["rng"], dict) else new["rng"]
    new["optimizer"], new["scaler"] = new["optimizer"] or None, new["scaler"] or {}
    return new


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Written whole or not at all (write_atomically): a crash or a full disk leaves the previous file as it was."""
    write_atomically(path, lambda f: torch.save(checkpoint.to_dict(), f))


def load_checkpoint(path: Path) -> Checkpoint:
    """weights_only: a checkpoint holding anything but tensors and plain values is refused, never unpickled."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; pass out_dir=RUN, a directory written by train.py")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, foreign, or holding objects weights_only won't build
        raise CheckpointError(f"{path} is not a readable checkpoint: {_unreadable(err)}") from None
    return Checkpoint.from_dict(raw, path)


def _unreadable(err: Exception) -> str:
    """Why torch.load refused a checkpoint, in words."""
    if isinstance(err, pickle.UnpicklingError) and "global" in str(err).lower():  # a class or a function
        return "it holds objects other than tensors and plain values, and unpickling those could run code"
    return f"damaged, or not a checkpoint ({type(err).__name__})"


def saved_config(path: Path) -> dict[str, Any] | None:
    """The config the run at `path` saved, read through a memory map (the weights stay on disk): what resume=true
    continues. None where there is no readable checkpoint holding one; load_checkpoint then says why."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, damaged, foreign, or an old format without memory maps: load_checkpoint's to report
        return None
    config = raw.get("config") if isinstance(raw, dict) else None
    return config if isinstance(config, dict) and config else None
