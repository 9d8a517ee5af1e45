"""ckpt.pt, the one owner of the checkpoint's format: the weights with the model's shape, the run's config and
progress, the optimizer's and random states. Training writes it; every command that reads one validates it here,
once, before anything is built from it."""

from __future__ import annotations

import dataclasses
import math
import pickle
import zipfile
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from common.config import check_fields, check_override, option, typed_config
from common.errors import CheckpointError, ConfigError, DataError
from common.files import why_not_a_file
from model.gpt import GPT, GPTConfig

# Options removed from the model, dropped on load: the first two only when off (on, the weights have parts this
# model lacks), zero_init_proj always (it only changed the initial weights).
REMOVED_OPTIONS = ("value_embeds", "untied_head", "zero_init_proj")


@dataclass
class Progress:
    """Where the run is: with the weights, the optimizer and the random state, all a resume needs."""

    iter: int = option(0, at_least=0)  # optimizer steps taken
    last_eval_iter: int = option(-1, at_least=-1)  # the iteration of the last evaluation (-1: none yet)
    val_loss: float = math.nan  # at that evaluation
    best_val_loss: float = math.inf
    kept_best_val_loss: float = math.inf  # that of best.pt (train.keep_best); inf: none kept in this run yet
    elapsed_s: float = option(0.0, at_least=0.0)  # wall time at the last save, summed over every resumed process
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
    built: GPT | None = field(default=None, repr=False)  # the model the weights fill, made once by from_dict

    def write(self, f: BinaryIO) -> None:
        """The file's bytes: torch.save of to_dict() (RunDir.write makes the write atomic)."""
        torch.save(self.to_dict(), f)

    def to_dict(self) -> dict[str, Any]:
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("progress", "built")}
        flat |= vars(self.progress)
        return flat | {"model_config": dict(vars(self.model_config))}

    @classmethod
    def from_dict(cls, raw: Any, path: Path, resuming: bool = False, attn_impl: str | None = None) -> Checkpoint:
        """Every value checked once, before anything is built: a damaged or crafted file is one line naming the field,
        never a traceback or an allocation its weights don't back. The optimizer and rng only when resuming."""
        if not isinstance(raw, dict) or "model" not in raw or "model_config" not in raw:
            raise CheckpointError(f"{path} is not a checkpoint written by train.py")
        raw = dict(raw) if raw.keys() == _KEYS else _upgraded(raw)
        progress = _typed(Progress, {f.name: raw.pop(f.name) for f in fields(Progress)}, path)
        options = raw.pop("model_config")
        if isinstance(options, dict) and options.keys() & set(REMOVED_OPTIONS):
            options = _without_removed_options(options, path)
        model_config = _typed(GPTConfig, options, path, "model_config ")
        for name, kind in _PLAIN_TYPES.items():
            if not isinstance(raw[name], kind):
                raise CheckpointError(f"{path} can't be used: its {name} is a {type(raw[name]).__name__}")
        run_as = dataclasses.replace(model_config, attn_impl=attn_impl) if attn_impl else model_config
        built = _model_of(raw["model"], run_as, path)
        raw["optimizer"] = raw["optimizer"] or None  # {}: no step taken, as None says
        if resuming:
            raw["optimizer"] = _named_optimizer(raw["optimizer"], dict(built.named_parameters()), path)
            _check_rng(raw["rng"], path)
        if raw["dtype"] not in ("", "float32", "bfloat16", "float16"):
            raise CheckpointError(f"{path} can't be used: dtype={raw['dtype']} is no precision train.py runs in")
        return cls(model_config=model_config, progress=progress, built=built, **raw)

    def build_model(self) -> GPT:
        """The model load_checkpoint built and filled with the weights (on attn_impl's path, if it was given one)."""
        if self.built is None:  # a checkpoint made in memory, not loaded
            self.built = _model_of(self.model, self.model_config, Path("weights"))
        return self.built

    def tokenizer_for_decoding(self, path: Path) -> dict[str, Any]:
        """The tokenizer's metadata; a checkpoint without one (an export's input needs none) can't sample or resume."""
        if not self.tokenizer:
            raise CheckpointError(f"{path} holds no tokenizer: it wasn't written by train.py")
        return self.tokenizer

    def optimizer_state_for(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer state keyed by name (from_dict named older files' positions), each group with this run's
        kernel: one saved unfused (an older MPS run's) would refuse the found_inf that skips a non-finite step."""
        if self.optimizer is None:
            return None
        kernels = [{"fused": group["fused"]} if "fused" in group else {} for group in optimizer.param_groups]
        # a file's other number of groups is harmless: the state loads by name, restore() sets the groups' settings
        groups = zip(self.optimizer["param_groups"], kernels, strict=False)
        return {**self.optimizer, "param_groups": [{**saved, **kernel} for saved, kernel in groups]}


_KEYS = {f.name for f in fields(Checkpoint) if f.name not in ("progress", "built")} | {f.name for f in fields(Progress)}
_PLAIN_TYPES = {"model": dict, "tokenizer": dict, "config": dict, "optimizer": (dict, type(None)), "scaler": dict,
                "rng": list, "dtype": str}
Config = TypeVar("Config")


def _typed(schema: type[Config], values: Any, path: Path, what: str = "") -> Config:
    """values as `schema`, checked as a Hydra config's keys are (types, bounds, choices), or one line naming one."""
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} can't be used: its {what}is a {type(values).__name__}, not a mapping")
    try:
        typed = typed_config(values, schema)
        check_fields(typed)  # Progress's bounds (GPTConfig checks its own as it is built)
        return typed
    except (ConfigError, OmegaConfBaseException) as err:
        raise CheckpointError(f"{path} can't be used: its {what}{_one_line(err, schema, values)}") from None


def _one_line(err: Exception, schema: type, values: dict[str, Any]) -> str:
    """A config's error in one line; a type's as a command line's key=value would be said (OmegaConf's takes three)."""
    if isinstance(err, OmegaConfBaseException):
        try:
            check_override(schema, str(err.full_key), values.get(err.full_key))
        except ConfigError as named:
            return str(named)
        first_line = str(err.msg).partition("\n")[0]
        return f"{err.full_key}: {first_line}"
    return str(err)


def _model_of(weights: dict[str, Any], config: GPTConfig, path: Path) -> GPT:
    """The model the weights fill: built once on the meta device (nothing allocated), the weights assigned as they
    are (PyTorch names a missing, unexpected or misshapen one), the tied head tied again; dense, floating point and
    finite. A config far larger than its file is refused before that model, which takes a second per 100 layers."""
    if len(weights) < 4 * config.n_layer:  # every block has at least four weight matrices
        raise CheckpointError(f"{path} can't be used: its {len(weights)} weights are too few for its model_config "
                              f"n_layer={config.n_layer}")
    try:
        with torch.device("meta"):
            model = GPT(config)
    except (RuntimeError, MemoryError):  # rotary's tables are made on the CPU, even here
        raise CheckpointError(f"{path} can't be used: its model_config's tables don't fit in memory") from None
    try:
        model.load_state_dict(weights, assign=True)
    except RuntimeError as err:  # its first line says only that loading failed
        raise CheckpointError(f"{path} can't be used: {str(err).splitlines()[1].strip()[:300]}") from None
    model.lm_head.weight = model.transformer.wte.weight  # assigned, each name got a tensor of its own
    model.float()  # float32 parameters, as training keeps them, whatever a file stored (no copy when it is float32)
    for name, weight in model.state_dict().items():
        backed = weight.layout == torch.strided and weight.untyped_storage().nbytes() >= weight.nbytes  # not stride 0
        if not backed or not weight.is_floating_point():
            raise CheckpointError(f"{path} can't be used: its weight {name} is not a dense floating-point tensor")
        if not torch.isfinite(weight).all():
            raise CheckpointError(f"{path} can't be used: its weight {name} holds NaN or inf; use an earlier "
                                  "checkpoint")
    return model


def _named_optimizer(state: dict[str, Any] | None, parameters: dict[str, nn.Parameter],
                     path: Path) -> dict[str, Any] | None:
    """The optimizer's state_dict keyed by parameter name, checked before torch's fused kernels see it: they read a
    moment of another shape out of bounds, and a group naming something else corrupts the heap. Its groups list each
    parameter once, each has a state, and every tensor in one has the weight's shape (its step: one number). Files
    from before torchrun keyed them by position, in the order of AdamW's groups, the only optimizer then: the
    matrices, then the vectors."""
    if state is None:
        return None
    entries, groups = state.get("state"), state.get("param_groups")
    if not (isinstance(entries, dict) and isinstance(groups, list)
            and all(isinstance(part, dict) for part in [*entries.values(), *groups])
            and all(isinstance(group.get("params"), list) for group in groups)):
        raise CheckpointError(f"{path} can't be used: its optimizer is not an optimizer's state")
    order = sorted(parameters, key=lambda name: parameters[name].dim() < 2)  # AdamW's groups: matrices, then vectors

    def named(key: Any) -> Any:
        return order[key] if isinstance(key, int) and 0 <= key < len(order) else key

    entries = {named(key): values for key, values in entries.items()}
    groups = [{**group, "params": [named(key) for key in group["params"]]} for group in groups]
    listed = [name for group in groups for name in group["params"]]
    for name in [*listed, *entries]:
        if not isinstance(name, str) or name not in parameters:
            raise CheckpointError(f"{path} can't be used: its optimizer names {name!r:.80}, no parameter of its model")
    times = Counter(listed)
    for name, parameter in parameters.items():
        if name not in entries:
            raise CheckpointError(f"{path} can't be used: its optimizer holds no state for {name}")
        if times[name] != 1:
            raise CheckpointError(f"{path} can't be used: its optimizer's param_groups list {name} "
                                  f"{times[name]} times, not once")
        for key, value in entries[name].items():
            shape = torch.Size() if key == "step" else parameter.shape
            if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.shape != shape):
                found = _shown(value.shape) if value.layout == torch.strided else "sparse"
                wanted = "not one number" if key == "step" else f"the weight {_shown(shape)}"
                raise CheckpointError(f"{path} can't be used: its optimizer's {key} for {name} is {found}, {wanted}")
    return {**state, "state": entries, "param_groups": groups}


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


def _without_removed_options(options: dict[str, Any], path: Path) -> dict[str, Any]:
    """An older model config less its removed options, unless one is on: then the weights have parts we lack."""
    removed = [k for k in REMOVED_OPTIONS[:2] if options.get(k) not in (None, False)]
    if removed:
        raise CheckpointError(f"{path} can't be used: it was trained with model.{removed[0]}, an option this version "
                              "no longer has")
    return {k: v for k, v in options.items() if k not in REMOVED_OPTIONS}


def _upgraded(old: dict[str, Any]) -> dict[str, Any]:
    """An older layout in today's: keys added since at their defaults, rng a list of each rank's states, scaler {}
    where it was None (from_dict makes an empty optimizer state None)."""
    new = {**Checkpoint(GPTConfig(), {}, {}).to_dict(), **{key: old[key] for key in _KEYS & old.keys()}}
    new["rng"] = [new["rng"]] if isinstance(new["rng"], dict) else new["rng"]
    new["scaler"] = new["scaler"] or {}
    return new


def load_checkpoint(path: Path, resuming: bool = False, attn_impl: str | None = None) -> Checkpoint:
    """weights_only: a checkpoint holding anything but tensors and plain values is refused, never unpickled. The model
    runs attn_impl's path if given (both paths share the weights), else the training run's."""
    if not path.is_file():  # nothing there, or a FIFO, which would block torch.load forever
        if path.exists():
            raise DataError(f"{path} {why_not_a_file(path)}; a checkpoint is a regular file: remove it")
        raise CheckpointError(f"no checkpoint at {path}; pass out_dir=RUN, a directory written by train.py")
    try:
        stored = _stored_as_saved(path)
        raw = torch.load(path, map_location="cpu", weights_only=True) if stored else None
    except Exception as err:  # truncated, foreign, or holding objects weights_only won't build
        why = f"damaged, or not a checkpoint ({type(err).__name__})"
        if isinstance(err, pickle.UnpicklingError) and "global" in str(err).lower():  # a class or a function
            why = "it holds objects other than tensors and plain values, and unpickling those could run code"
        raise CheckpointError(f"{path} is not a readable checkpoint: {why}") from None
    if not stored:
        raise CheckpointError(f"{path} can't be used: its records are compressed, which torch.save never does, and "
                              "unpacking them could take gigabytes; use the file as train.py wrote it")
    return Checkpoint.from_dict(raw, path, resuming, attn_impl)


def _stored_as_saved(path: Path) -> bool:
    """Whether every record of the file's zip is stored as torch.save stores it, not compressed: then reading it
    takes no more memory than the file's size, and a misshapen weight is refused before gigabytes unpacked from a
    few megabytes. (torch.load's mmap=True would read a compressed record's bytes as the weights themselves.)"""
    with zipfile.ZipFile(path) as archive:
        return all(record.compress_type == zipfile.ZIP_STORED for record in archive.infolist())


def saved_config(path: Path) -> dict[str, Any] | None:
    """The config resume=true continues, read through a memory map (the weights stay on disk); None if unreadable."""
    if not path.is_file():  # a FIFO would block torch.load forever
        return None
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True) if _stored_as_saved(path) else None
    except Exception:  # missing, damaged, foreign, or an old format without memory maps: load_checkpoint's to report
        return None
    config = raw.get("config") if isinstance(raw, dict) else None
    return config if isinstance(config, dict) and config else None
