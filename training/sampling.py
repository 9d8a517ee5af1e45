"""Load a run's checkpoint and generate text from a prompt."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from data.errors import DataError
from data.tokenizers import tokenizer_from_metadata
from training.checkpoint import CKPT_NAME, load_checkpoint, model_from_checkpoint
from training.errors import ConfigError
from training.runtime import make_runtime


def read_prompt(start: str) -> str:
    """The prompt itself, or the contents of a file given as FILE:path."""
    if not start.startswith("FILE:"):
        return start
    path = Path(start.removeprefix("FILE:")).expanduser()
    if not path.is_file():
        raise DataError(f"start=FILE:{path}: no such file")
    return path.read_text(encoding="utf-8")


def sample(cfg: DictConfig) -> Iterator[str]:
    if OmegaConf.is_missing(cfg, "out_dir"):
        raise ConfigError("out_dir is required: pass out_dir=RUN, a directory written by train.py")
    if cfg.temperature <= 0:
        raise ConfigError(f"temperature={cfg.temperature} must be > 0; use top_k=1 for greedy decoding")
    if cfg.top_k is not None and cfg.top_k < 1:
        raise ConfigError(f"top_k={cfg.top_k} must be at least 1 (or null for no cut-off)")
    runtime = make_runtime(cfg.device, cfg.dtype)
    ckpt = load_checkpoint(Path(cfg.out_dir) / CKPT_NAME)
    try:
        model = model_from_checkpoint(ckpt, cfg.attn_impl)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model.to(runtime.device).eval()
    tokenizer = tokenizer_from_metadata(ckpt["tokenizer"])

    prompt_ids = tokenizer.encode(read_prompt(cfg.start))
    if not prompt_ids:
        raise ConfigError('start is empty; give a prompt such as start="ROMEO:"')
    block_size = model.config.block_size
    if len(prompt_ids) > block_size:
        print(
            f"warning: the prompt has {len(prompt_ids)} tokens; the model sees only its last {block_size}",
            file=sys.stderr,
        )
    torch.manual_seed(cfg.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=runtime.device)
    with runtime.autocast():
        for _ in range(cfg.num_samples):
            out = model.generate(idx, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k)
            yield tokenizer.decode(out[0].tolist())
