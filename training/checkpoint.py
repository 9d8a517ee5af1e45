"""ckpt.pt: everything sample.py and a resumed run need, as tensors and plain Python values only."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from model import GPT, GPTConfig
from training.errors import CheckpointError

CKPT_NAME = "ckpt.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write beside the target, fsync, then rename over it: a crash leaves the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; pass out_dir=RUN, a directory written by train.py")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint: {first_line}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"{path} is not a checkpoint written by train.py")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], attn_impl: str | None = None) -> GPT:
    """Rebuild the model; attn_impl may differ from the training run's, since both paths share weights."""
    config = dict(ckpt["model_config"])
    if attn_impl is not None:
        config["attn_impl"] = attn_impl
    model = GPT(GPTConfig(**config))
    model.load_state_dict(ckpt["model"])
    return model
