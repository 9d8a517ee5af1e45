"""ckpt.pt, the one owner of its format: what a resumed run and sample.py need, as tensors and plain values.

On disk it is a flat dict, the layout train.py has written since runs resume on the clock: model_config, model,
optimizer, scaler, the Progress fields (iter, last_eval_iter, val_loss, best_val_loss, elapsed_s, log_loss_sum,
log_steps), rng, tokenizer, config and dtype. In memory it is a Checkpoint. Every compatibility rule for older files
is in this module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from common.errors import CheckpointError, ConfigError, NonFiniteState
from common.files import fsync_directory, open_temporary, replace_file, temporary_beside, unless_disk_full
from common.runtime import memory_bytes
from model.config import GPTConfig, parameter_count
from model.gpt import GPT

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

    def build_model(self, attn_impl: str | None = None) -> GPT:
        """The trained model; attn_impl may differ from the training run's, since both paths share weights. Weights
        that don't fit the model (missing, extra, another shape) are a CheckpointError naming the first."""
        config = self.model_config
        if attn_impl is not None:
            config = dataclasses.replace(config, attn_impl=attn_impl)
        model = GPT(config)
        try:
            model.load_state_dict(self.model)
        except RuntimeError as err:
            detail = " ".join(str(err).split("\n\t")[1:2]) or _first_line(err)
            raise CheckpointError(f"the checkpoint's weights don't fit its model_config: {detail.strip()}") from None
        return model

    def tokenizer_for_decoding(self, path: Path) -> dict[str, Any]:
        """The tokenizer's metadata; a checkpoint that has none (an export's input needs none) can't sample or
        resume, and one that data.tokenizers can't rebuild, or whose characters don't cover the model's
        vocabulary, is refused."""
        meta = self.tokenizer
        if not meta:
            raise CheckpointError(f"{path} holds no tokenizer: it wasn't written by train.py")
        kind = meta.get("kind") if isinstance(meta, dict) else None
        if kind == "char":
            chars = meta.get("chars")
            if not isinstance(chars, list) or not all(isinstance(c, str) for c in chars):
                raise CheckpointError(f"{path} has a char tokenizer without its list of characters")
            if len(chars) != self.model_config.vocab_size:
                raise CheckpointError(
                    f"{path} has a tokenizer of {len(chars)} characters for a model of {self.model_config.vocab_size} "
                    "tokens: it wasn't written by train.py, or was altered"
                )
        elif kind != "bpe" or not isinstance(meta.get("encoding"), str):
            raise CheckpointError(f"{path} has a tokenizer this version can't rebuild (kind {kind!r})")
        return meta

    def optimizer_state_for(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer state keyed by parameter name. Checkpoints written before torchrun support keyed it by
        position (optimizer.state_dict()): name each position's parameter in the optimizer's order, which
        make_optimizer keeps the same."""
        state = self.optimizer
        if state is None or not any(isinstance(key, int) for key in state["state"]):
            return state
        names = {id(p): name for name, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        return {
            "state": {order[i]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
        }

    def nonfinite(self) -> list[str]:
        """The weights and optimizer state holding NaN or inf, by name: such a state is never written or read."""
        return nonfinite_tensors({"model": self.model, "optimizer": self.optimizer})

    def to_dict(self) -> dict[str, Any]:
        """The layout on disk, key for key and in the order train.py has always written it (keys added since at
        their place)."""
        p = self.progress
        return {
            "model_config": dataclasses.asdict(self.model_config),
            "model": self.model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "iter": p.iter,
            "last_eval_iter": p.last_eval_iter,
            "val_loss": p.val_loss,
            "best_val_loss": p.best_val_loss,
            "kept_best_val_loss": p.kept_best_val_loss,
            "rng": self.rng,
            "elapsed_s": p.elapsed_s,
            "log_loss_sum": p.log_loss_sum,
            "log_steps": p.log_steps,
            "tokenizer": self.tokenizer,
            "config": self.config,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path) -> Checkpoint:
        """Older layouts: rng as one dict (before torchrun support), no elapsed_s (before timed resumes),
        kept_best_val_loss (before train.keep_best), dtype (before train.dtype=auto measured) or the log line's
        losses (before exact logs on resume: that line's mean starts at the resume), model config keys added since
        (their defaults), optimizer state by position (optimizer_state_for)."""
        if not isinstance(raw, dict) or "model" not in raw or "model_config" not in raw:
            raise CheckpointError(f"{path} is not a checkpoint written by train.py")
        weights = raw["model"]
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise CheckpointError(f"{path} is not a checkpoint written by train.py: its model is no mapping of weights")
        try:
            model_config = GPTConfig(**raw["model_config"])
        except (TypeError, ConfigError) as err:
            raise CheckpointError(f"{path} has a model config this version can't build ({err})") from None
        _check_buildable(model_config, path)
        _check_kinds(raw, path)
        return cls(
            model_config=model_config,
            model=raw["model"],
            tokenizer=raw.get("tokenizer", {}),
            config=raw.get("config", {}),
            progress=_progress(raw, path),
            optimizer=raw.get("optimizer") or None,
            scaler=raw.get("scaler") or {},
            rng=_rng_states(raw, path),
            dtype=raw.get("dtype", "") if isinstance(raw.get("dtype"), str) else "",
        )


def _check_buildable(config: GPTConfig, path: Path) -> None:
    """Before anything is allocated: a model_config whose float32 weights alone outgrow this machine's memory
    (a damaged or crafted file) is refused instead of building it."""
    need = 4 * parameter_count(config)
    memory = memory_bytes(torch.device("cpu"))
    if memory is not None and need > memory:
        raise CheckpointError(
            f"{path} asks for a model of {need / 4:,.0f} parameters ({need / 2**30:,.1f} GiB in float32), more "
            f"than this machine's {memory / 2**30:,.1f} GiB: it is damaged, or not a checkpoint of a model this size"
        )


# What each value of the flat dict must be; a damaged or crafted file is refused here, in one line, not as a
# traceback wherever the value is first used (a config that is a string, a negative iteration).
_KINDS: dict[str, tuple[type, ...]] = {
    "config": (dict,),
    "tokenizer": (dict,),
    "optimizer": (dict, type(None)),
    "scaler": (dict, type(None)),
    "rng": (dict, list),
    **{f.name: (int,) if f.type == "int" else (int, float) for f in dataclasses.fields(Progress)},
}


def _check_kinds(raw: dict[str, Any], path: Path) -> None:
    for name, kinds in _KINDS.items():
        value = raw.get(name)
        if name in raw and (not isinstance(value, kinds) or isinstance(value, bool)):
            _damaged(path, f"its {name} is {_shown(value)}")
    optimizer = raw.get("optimizer")
    if optimizer and not (  # {}: no state, as None
        isinstance(optimizer.get("state"), dict) and isinstance(optimizer.get("param_groups"), list)
    ):
        _damaged(path, "its optimizer state has no state and param_groups")


def _rng_states(raw: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """Each rank's generator states; before torchrun support, one dict."""
    rng = raw.get("rng", [])
    states = [rng] if isinstance(rng, dict) else list(rng)
    if not all(isinstance(state, dict) and "torch" in state for state in states):
        _damaged(path, "its random state is no list of generator states")
    return states


def _progress(raw: dict[str, Any], path: Path) -> Progress:
    progress = Progress(**{f.name: raw[f.name] for f in dataclasses.fields(Progress) if f.name in raw})
    if progress.iter < 0:
        _damaged(path, f"its iter is {progress.iter}")
    if not -1 <= progress.last_eval_iter <= progress.iter:
        _damaged(path, f"its last_eval_iter {progress.last_eval_iter} is not between -1 and its iter {progress.iter}")
    if not 0 <= progress.elapsed_s < math.inf:
        _damaged(path, f"its elapsed_s is {progress.elapsed_s}")
    if progress.log_steps < 0:
        _damaged(path, f"its log_steps is {progress.log_steps}")
    return progress


def _damaged(path: Path, what: str) -> NoReturn:
    raise CheckpointError(f"{path} is damaged or wasn't written by train.py: {what}")


def _shown(value: object) -> str:
    text = repr(value)
    return f"the {type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def nonfinite_tensors(state: Any, prefix: str = "") -> list[str]:
    """The names of the floating-point tensors holding NaN or inf in a state dict, nested ones (an optimizer's)
    included, as dotted paths."""
    tensors = _tensors(state, prefix)
    return [name for name, tensor in tensors if tensor.is_floating_point() and not tensor.isfinite().all()]


def _tensors(state: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, list | tuple):
        for i, value in enumerate(state):
            yield from _tensors(value, f"{prefix}.{i}" if prefix else str(i))


def _names(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write beside the target, fsync, then rename over it: a crash leaves the old or the new file. The
    temporary name is this process's own, so no other writer can rename a half-written file of ours. A state
    with NaN or inf in its weights or optimizer state is never written (NonFiniteState): the file on disk stays
    the last good one."""
    bad = checkpoint.nonfinite()
    if bad:
        raise NonFiniteState(f"{path.name} not written: NaN or inf in {_names(bad)}")
    tmp = temporary_beside(path)
    try:
        with unless_disk_full(path), open_temporary(tmp) as f:
            torch.save(checkpoint.to_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        replace_file(tmp, path)
    except BaseException:  # a full disk (DiskFull), a second Ctrl-C: the previous checkpoint stays as it was
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def load_checkpoint(path: Path) -> Checkpoint:
    """weights_only: a checkpoint holding anything but tensors and plain values is refused, never unpickled. One
    holding NaN or inf (written by a diverged run before save_checkpoint refused such states) is refused too:
    nothing it would sample, evaluate, export or resume is any good."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; pass out_dir=RUN, a directory written by train.py")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign: torch raises whatever its format readers hit
        raise _unreadable(path, err) from None
    checkpoint = Checkpoint.from_dict(raw, path)
    bad = checkpoint.nonfinite()
    if bad:
        raise CheckpointError(
            f"{path} holds NaN or inf ({_names(bad)}): a run that diverged wrote it; use an earlier checkpoint, or "
            "train again with a lower train.learning_rate"
        )
    return checkpoint


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    """Why torch.load refused `path`, in one line."""
    if not isinstance(err, pickle.UnpicklingError):
        return CheckpointError(f"{path} is not a readable checkpoint ({type(err).__name__}: {_first_line(err)})")
    if "global" not in str(err).lower():  # no class or function to build: bytes that are no pickle
        detail = str(err).partition("WeightsUnpickler error:")[2].strip() or str(err)
        return CheckpointError(
            f"{path} is not a readable checkpoint: damaged, or not a checkpoint ({_first_line(detail)})"
        )
    return CheckpointError(  # weights_only refused to build an object: a class or a function
        f"{path} is not a readable checkpoint: it holds objects other than tensors and plain values, "
        "and unpickling those could run code"
    )


def saved_config(path: Path) -> dict[str, Any] | None:
    """The config the run at `path` saved, read through a memory map (the weights stay on disk): what resume=true
    continues. None where there is no readable checkpoint holding one; load_checkpoint then says why."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, damaged, foreign, or an old format without memory maps: load_checkpoint's to report
        return None
    config = raw.get("config") if isinstance(raw, dict) else None
    return config if isinstance(config, dict) and config else None


def _first_line(err: object) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no details"
