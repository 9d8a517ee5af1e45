"""The model a command runs: a train.py run's checkpoint (latest or best), or OpenAI's GPT-2 via init_from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.errors import CheckpointError
from data.tokenizers import BpeTokenizer, Tokenizer, tokenizer_from_metadata
from model import GPT
from model.checkpoint import BEST_NAME, CKPT_NAME, Checkpoint, load_checkpoint
from model.hf_gpt2 import load_pretrained

GPT2_ENCODING = "r50k_base"  # tiktoken's name for GPT-2's BPE


@dataclass
class LoadedModel:
    model: GPT  # on the CPU, in training mode as built
    tokenizer: Tokenizer
    checkpoint: Checkpoint | None  # None for init_from: no run, no data config


def load_model(out_dir: str | None, init_from: str | None, ckpt: str, attn_impl: str | None) -> LoadedModel:
    """init_from's GPT-2 weights as they are, with GPT-2's own BPE; else out_dir's ckpt.pt (ckpt=latest) or best.pt
    (ckpt=best) with the tokenizer the run was trained with. attn_impl None: the checkpoint's (flash for GPT-2)."""
    if init_from is not None:
        model = load_pretrained(init_from, attn_impl=attn_impl or "flash")
        return LoadedModel(model, BpeTokenizer.from_name(GPT2_ENCODING), None)
    assert out_dir is not None, "the config requires out_dir or init_from"
    path = Path(out_dir) / (BEST_NAME if ckpt == "best" else CKPT_NAME)
    if ckpt == "best" and not path.is_file() and (Path(out_dir) / CKPT_NAME).is_file():
        raise CheckpointError(f"no {BEST_NAME} in {out_dir}: train with train.keep_best=true, or use ckpt=latest")
    checkpoint = load_checkpoint(path)
    tokenizer = tokenizer_from_metadata(checkpoint.tokenizer_for_decoding(path))
    return LoadedModel(checkpoint.build_model(attn_impl), tokenizer, checkpoint)
