"""A training step's peak memory, predicted (training_memory) and measured in a process of its own: bench.py memory."""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from model import GPT, GPTConfig

BENCH = Path(__file__).resolve().parent.parent / "bench.py"
GIB = 2**30
GPT2_SHAPES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
               "gpt2-xl": (48, 25, 1600)}
GPU_GIB = (24, 40, 80, 141)  # a 4090 or 3090, an A100 40GB, an A100/H100 80GB, an H200
GPU_USABLE = 0.9  # of a GPU's memory for tensors: the CUDA context and the allocator's fragmentation take the rest
STEP_TOKENS = 491_520  # nanoGPT's GPT-2 step (12 x 1024 x 40): grad_accum reaches it from the largest batch
MEMORY_PROBES = {  # (n_layer, n_embd, block_size, batch_size, checkpointing, vocab_size, bf16), seconds each on CPU
    "cpu": [(2, 128, 256, 8, 0, 50257, 0), (8, 128, 512, 16, 1, 65, 0), (6, 384, 256, 16, 0, 65, 0),
            (6, 384, 256, 16, 1, 65, 0), (8, 128, 512, 16, 0, 65, 0), (12, 256, 512, 8, 1, 65, 0),
            (4, 256, 256, 32, 0, 65, 0), (2, 128, 256, 8, 0, 50257, 1), (2, 128, 256, 8, 1, 50257, 1),
            (4, 256, 256, 16, 0, 65, 1)],
    "cuda": [(12, 768, 1024, 16, 0, 50257, 1), (12, 768, 1024, 16, 1, 50257, 1)],
}


def training_memory(config: GPTConfig, batch_size: int, bf16: bool, checkpointing: bool = False) -> int:
    """Predicted peak bytes of an AdamW training step: float32 weights, gradients and two moments (16 bytes a parameter)
    plus one micro-batch's activations, at backward's start (all activations and its largest transient) or after it
    (all gradients), whichever is larger. Per token and layer a GPT-2 block keeps 17C elements for backward (C =
    n_embd; fused attention keeps no T x T matrix): 9C up to c_fc's input, 4C each for GELU's and the MLP c_proj's
    inputs: 68C bytes in float32, 46C under bf16 autocast (casts included); dropout adds a byte mask per residual
    branch. Checkpointed, a block keeps only its float32 input (4C); backward holds one block's activations and their
    gradients. The head keeps its input, the logits and cross-entropy's float32 log-probabilities; backward's transient
    is two float32 logits-sized gradients and half a block. bf16 autocast also keeps a copy of each weight matrix."""
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    n = _parameters(dataclasses.astuple(config))
    layer = (46 if bf16 else 68) * C + (2 * C if config.dropout > 0 else 0)
    blocks = L * 4 * C + 2 * layer if checkpointing else L * layer
    head = 4 * C + (2 if bf16 else 4) * (C + V) + 4 * V
    tokens = batch_size * config.block_size
    kept = tokens * (blocks + head + 4 * C) + (2 * (12 * L * C * C + V * C) if bf16 else 0)  # 4C: the embeddings
    transient = tokens * (8 * V + layer // 2)
    return 12 * n + max(kept + transient, 4 * n)


@functools.lru_cache(maxsize=64)
def _parameters(shape: tuple) -> int:
    """GPT(GPTConfig(*shape))'s parameter count, from a model on the meta device: shapes alone, nothing allocated."""
    with torch.device("meta"):
        return GPT(GPTConfig(*shape)).num_params(non_embedding=False)


def largest_batch(config: GPTConfig, budget: float, bf16: bool, checkpointing: bool) -> int:
    """The largest micro-batch (up to 4096) whose training fits in `budget` bytes; 0 if not one."""
    return bisect.bisect_right(range(1, 4097), budget, key=lambda b: training_memory(config, b, bf16, checkpointing))


def probe_config(probe: tuple[int, ...]) -> GPTConfig:
    n_layer, n_embd, block_size, _, _, vocab, _ = probe
    return GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd,
                     bias=False)


def bench_memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, (n_layer, n_head, n_embd) in GPT2_SHAPES.items():
        model = GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        for gib in GPU_GIB:
            row = {"section": "memory: what fits (bf16, block 1024)", "model": name, "gpu_gib": gib}
            for label, ck in (("plain", False), ("checkpointed", True)):
                batch = largest_batch(model, GPU_USABLE * gib * GIB, True, ck)
                accum = -(-STEP_TOKENS // (batch * 1024)) if batch else 0
                row[label] = f"batch_size={batch} grad_accum={accum}" if batch else "does not fit"
            rows.append(row)
    device = torch.device(args.device).type
    probes = MEMORY_PROBES.get(device, []) if device == "cuda" or sys.platform == "linux" else []  # CPU: /proc
    for probe in probes[: args.memory_probes]:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}  # freed memory leaves RSS
        command = [sys.executable, str(BENCH), "--device", args.device, "--memory-probe", *map(str, probe)]
        measured = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)
        n_layer, n_embd, block_size, batch_size, ck, vocab, bf16 = probe
        predicted = training_memory(probe_config(probe), batch_size, bool(bf16), bool(ck))
        rows.append({"section": f"memory: predicted against measured ({device})",
                     "shape": f"{n_layer}x{n_embd}, vocab {vocab}, block {block_size}, batch {batch_size}",
                     "dtype": "bfloat16" if bf16 else "float32", "checkpointing": bool(ck),
                     "measured_mib": measured / 2**20, "predicted_mib": predicted / 2**20,
                     "predicted_over_measured": predicted / measured})
    return rows


def memory_probe(device: str, probe: tuple[int, ...]) -> int:
    """Bytes two AdamW steps of a probe's shape add at their peak, in a process of its own: CUDA's allocator's, or
    on a CPU the peak RSS (VmHWM: ru_maxrss would keep the forking process's across exec) above the RSS before."""

    def rss(field: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))

    _, _, block_size, batch_size, checkpointing, vocab, bf16 = probe
    cuda = device.startswith("cuda")
    before = torch.cuda.memory_allocated() if cuda else rss("VmRSS")
    torch.manual_seed(0)
    model = GPT(probe_config(probe)).to(device).train()
    model.activation_checkpointing = bool(checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)
    for _ in range(2):  # the second step holds AdamW's state too
        idx = torch.randint(vocab, (batch_size, block_size), device=device)
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=bool(bf16)):
            _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (torch.cuda.max_memory_allocated() if cuda else rss("VmHWM")) - before
