"""ckpt.pt: everything sample.py and a resumed run need, as tensors and plain Python values only."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from model import GPT, GPTConfig
from training.errors import CheckpointError

CKPT_NAME = "ckpt.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write beside the target, fsync, then rename over it: a crash leaves the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a second Ctrl-C: the previous checkpoint stays as it was
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; pass out_dir=RUN, a directory written by train.py")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused something that is not plain data
        raise CheckpointError(
            f"{path} is not a readable checkpoint: it holds objects other than tensors and plain values, "
            "and unpickling those could run code"
        ) from None
    except Exception as err:  # truncated or foreign: torch raises whatever its format readers hit
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({type(err).__name__}: {_first_line(err)})"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"{path} is not a checkpoint written by train.py")
    return ckpt


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no details"


def model_from_checkpoint(ckpt: dict[str, Any], attn_impl: str | None = None) -> GPT:
    """Rebuild the model; attn_impl may differ from the training run's, since both paths share weights."""
    config = dict(ckpt["model_config"])
    if attn_impl is not None:
        config["attn_impl"] = attn_impl
    model = GPT(GPTConfig(**config))
    model.load_state_dict(ckpt["model"])
    return model
