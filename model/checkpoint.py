"""ckpt.pt, the one owner of its format: a flat dict of tensors and plain values (Checkpoint's and Progress's fields,
model_config as a dict) that a resumed run and sample.py need. _upgraded brings older files up to date."""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from common.config import check_fields, check_override, option, typed_config
from common.errors import CheckpointError, ConfigError
from common.runtime import check_regular_file, write_atomically
from model.gpt import GPT, GPTConfig

CKPT_NAME = "ckpt.pt"  # the latest state, to resume from
BEST_NAME = "best.pt"  # with train.keep_best: the state of the lowest val loss so far
REMOVED_OPTIONS = ("value_embeds", "untied_head", "zero_init_proj")  # off: dropped on load; on: GPTConfig refuses


@dataclass
class Progress:
    """Where the run is: with the weights, the optimizer and the random state, all a resume needs."""

    iter: int = option(0, at_least=0)  # optimizer steps taken
    last_eval_iter: int = option(-1, at_least=-1)  # the iteration of the last evaluation (-1: none yet)
    val_loss: float = math.nan  # at that evaluation
    best_val_loss: float = math.inf
    kept_best_val_loss: float = math.inf  # that of best.pt (train.keep_best); inf: none kept in this run yet
    # the run's wall time at the last save, over all the processes that resumed it
    elapsed_s: float = option(0.0, at_least=0.0)
    log_loss_sum: float = 0.0  # the train losses since the last log line, summed: the next line's mean is exact
    log_steps: int = option(0, at_least=0)  # and their number


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
    def from_dict(cls, raw: Any, path: Path, resuming: bool = False) -> Checkpoint:
        """Every value used checked here, once, before anything is built or written: a damaged or crafted file is one
        line naming the field, never a traceback, an allocation its weights don't back, or a run's history cut. The
        optimizer and random states only when resuming: nothing else reads them."""
        if not isinstance(raw, dict) or "model" not in raw or "model_config" not in raw:
            raise CheckpointError(f"{path} is not a checkpoint written by train.py")
        raw = dict(raw) if raw.keys() == _KEYS else _upgraded(raw)
        progress = _typed(Progress, {f.name: raw.pop(f.name) for f in fields(Progress)}, path)
        options = raw.pop("model_config")
        if isinstance(options, dict):
            options = {k: v for k, v in options.items() if not (k in REMOVED_OPTIONS and v is False)}
        model_config = _typed(GPTConfig, options, path, "model_config ")
        for name, kind in _PLAIN_TYPES.items():
            if not isinstance(raw[name], kind):
                raise CheckpointError(f"{path} can't be used: its {name} is a {type(raw[name]).__name__}")
        _check_weights(raw["model"], model_config, path)
        raw["optimizer"] = raw["optimizer"] or None  # {}: no step taken, as None says
        if resuming:
            _check_optimizer(raw["optimizer"], raw["model"], path)
            _check_rng(raw["rng"], path)
        if raw["dtype"] not in ("", "float32", "bfloat16", "float16"):
            raise CheckpointError(f"{path} can't be used: dtype={raw['dtype']} is no precision train.py runs in")
        return cls(model_config=model_config, progress=progress, **raw)

    def build_model(self, attn_impl: str | None = None) -> GPT:
        """The trained model (from_dict checked that its weights fit); attn_impl may differ from the training run's,
        since both paths share weights."""
        model = GPT(dataclasses.replace(self.model_config, attn_impl=attn_impl or self.model_config.attn_impl))
        model.load_state_dict(self.model)
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
_PLAIN_TYPES = {"model": dict, "tokenizer": dict, "config": dict, "optimizer": (dict, type(None)), "scaler": dict,
                "rng": list, "dtype": str}
Config = TypeVar("Config")


def _typed(schema: type[Config], values: Any, path: Path, what: str = "") -> Config:
    """values as `schema`, checked as a Hydra config's keys are (types, bounds, choices), or one line naming one."""
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} can't be used: its {what}is a {type(values).__name__}, not a mapping")
    try:
        typed = typed_config(values, schema)
        check_fields(typed)  # bounds GPTConfig checks itself, Progress's
        return typed
    except ConfigError as err:
        problem = str(err)
    except OmegaConfBaseException as err:  # a type: said as a command line's key=value would be
        problem = f"{err.full_key}: {err.msg}"
        try:
            check_override(schema, str(err.full_key), values.get(err.full_key))
        except ConfigError as named:
            problem = str(named)
    raise CheckpointError(f"{path} can't be used: its {what}{problem}") from None


def _check_weights(weights: dict[str, Any], config: GPTConfig, path: Path) -> None:
    """The names and shapes the config implies (a model built on the meta device: nothing allocated), floating point
    and finite. A config far larger than its file is refused before that model, which takes a second per 100 layers."""
    if len(weights) < 4 * config.n_layer:  # every block has at least four weight matrices
        raise CheckpointError(f"{path} can't be used: its {len(weights)} weights are too few for its model_config "
                              f"n_layer={config.n_layer}")
    with torch.device("meta"):
        expected = GPT(config).state_dict()
    for name, meta in expected.items():
        weight = weights.get(name)
        if not isinstance(weight, torch.Tensor) or weight.shape != meta.shape:
            found = "missing" if weight is None else getattr(weight, "shape", type(weight).__name__)
            raise CheckpointError(f"{path} can't be used: its weight {name} is {_shown(found)}; its model_config "
                                  f"implies shape {tuple(meta.shape)}")
        if not weight.is_floating_point():
            raise CheckpointError(f"{path} can't be used: its weight {name} is {weight.dtype}, not floating point")
        if not torch.isfinite(weight).all():
            raise CheckpointError(f"{path} can't be used: its weight {name} holds NaN or inf; use an earlier "
                                  "checkpoint")
    unexpected = sorted(weights.keys() - expected.keys(), key=str)
    if unexpected:
        raise CheckpointError(f"{path} can't be used: its model_config has no weight {unexpected[0]}")


def _check_optimizer(state: dict[str, Any] | None, weights: dict[str, torch.Tensor], path: Path) -> None:
    """An optimizer's state_dict keyed by weight name (or position: older files), each tensor of its weight's shape:
    another shape would be read out of bounds by the optimizer's kernels."""
    entries, groups = (state.get("state"), state.get("param_groups")) if state is not None else ({}, [])
    if not isinstance(entries, dict) or not isinstance(groups, list):
        raise CheckpointError(f"{path} can't be used: its optimizer is not an optimizer's state")
    for name, values in entries.items():
        shape = weights[name].shape if name in weights else None
        known = shape is not None or isinstance(name, int) and 0 <= name < len(weights)
        if not known or not isinstance(values, dict):
            raise CheckpointError(f"{path} can't be used: its optimizer holds a state for {name}, no weight of it")
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() and shape is not None and value.shape != shape:
                raise CheckpointError(f"{path} can't be used: its optimizer's {key} for {name} is {_shown(value.shape)}"
                                      f", the weight {_shown(shape)}")
    if not all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
        raise CheckpointError(f"{path} can't be used: its optimizer's param_groups are not an optimizer's")


def _check_rng(states: list[Any], path: Path) -> None:
    """Each rank's random state as torch.get_rng_state gives it, and its CUDA generators' as a list."""
    size = torch.get_rng_state().shape
    for state in states:
        cpu = state.get("torch") if isinstance(state, dict) else None
        if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.shape != size or not (
                isinstance(state.get("cuda"), list) and all(isinstance(t, torch.Tensor) for t in state["cuda"])):
            raise CheckpointError(f"{path} can't be used: its rng is not the random states train.py saves")


def _shown(shape: Any) -> str:
    return f"of shape {tuple(shape)}" if isinstance(shape, torch.Size) else str(shape)


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


def load_checkpoint(path: Path, resuming: bool = False) -> Checkpoint:
    """weights_only: a checkpoint holding anything but tensors and plain values is refused, never unpickled."""
    check_regular_file(path)  # a FIFO would block torch.load forever
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; pass out_dir=RUN, a directory written by train.py")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, foreign, or holding objects weights_only won't build
        raise CheckpointError(f"{path} is not a readable checkpoint: {_unreadable(err)}") from None
    return Checkpoint.from_dict(raw, path, resuming)


def _unreadable(err: Exception) -> str:
    """Why torch.load refused a checkpoint, in words."""
    if isinstance(err, pickle.UnpicklingError) and "global" in str(err).lower():  # a class or a function
        return "it holds objects other than tensors and plain values, and unpickling those could run code"
    return f"damaged, or not a checkpoint ({type(err).__name__})"


def saved_config(path: Path) -> dict[str, Any] | None:
    """The config the run at `path` saved, read through a memory map (the weights stay on disk): what resume=true
    continues. None where there is no readable checkpoint holding one; load_checkpoint then says why."""
    if not path.is_file():  # a FIFO would block torch.load forever
        return None
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, damaged, foreign, or an old format without memory maps: load_checkpoint's to report
        return None
    config = raw.get("config") if isinstance(raw, dict) else None
    return config if isinstance(config, dict) and config else None
