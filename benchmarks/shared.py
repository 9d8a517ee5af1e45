"""What bench.py's sections share: the CPU preset's model and a timer."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.runtime import synchronize
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
NANOGPT_SAMPLING = {"temperature": 0.8, "top_k": 200}  # nanoGPT's sample.py defaults, ours too


def cpu_model(block_size: int, **options: object) -> GPT:
    """The CPU preset's shape with random weights, in eval mode."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=block_size, n_layer=4, n_head=4, n_embd=128, bias=False, **options)
    return GPT(config).eval()


def timed(fn: Callable[[], object], device: str | torch.device, times: int = 1) -> float:
    """Seconds `times` calls of fn take, the device's queued work included."""
    synchronize(torch.device(device))
    start = time.perf_counter()
    for _ in range(times):
        fn()
    synchronize(torch.device(device))
    return time.perf_counter() - start
