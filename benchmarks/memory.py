"""A training step's peak memory, predicted (training_memory, behind docs/gpu.md's table of what fits) and measured
(measured_memory): bench.py memory."""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import gc

import torch
from torch.profiler import ProfilerActivity, profile

from model import GPT, GPTConfig

GIB = 2**30
GPT2_SHAPES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
               "gpt2-xl": (48, 25, 1600)}
GPU_GIB = (24, 40, 80, 141)  # a 4090 or 3090, an A100 40GB, an A100/H100 80GB, an H200
# Assumed, not yet measured on a GPU (scripts/gpu_check.py reports both): memory outside PyTorch's allocator (the
# CUDA context and its kernels), and the allocator's reserved memory over its peak of live tensors.
CUDA_CONTEXT = GIB // 2
RESERVED_OVER_ALLOCATED = 1.05
STEP_TOKENS = 491_520  # nanoGPT's GPT-2 step (12 x 1024 x 40): grad_accum reaches it from the largest batch
# (n_layer, n_embd, block_size, batch_size, checkpointing, vocab_size, bf16, compiled); about a second each on CPU
# eager, the compiled ones half a minute or more
MEMORY_PROBES = {
    "cpu": [(2, 128, 256, 8, 0, 50257, 0, 0), (6, 192, 256, 16, 1, 65, 0, 0), (2, 128, 256, 8, 1, 50257, 1, 0),
            (6, 192, 256, 16, 0, 65, 0, 0), (6, 192, 256, 16, 0, 65, 1, 0), (6, 192, 256, 16, 1, 65, 1, 0),
            (4, 128, 256, 8, 0, 65, 0, 1)],
    "cuda": [(12, 768, 1024, 16, 0, 50257, 1, 0), (12, 768, 1024, 16, 1, 50257, 1, 0),
             (12, 768, 1024, 16, 0, 50257, 1, 1)],
}


def training_memory(config: GPTConfig, batch_size: int, bf16: bool, checkpointing: bool = False) -> int:
    """Predicted peak bytes of live tensors in an AdamW step, fitted to CPU measurements (docs/gpu.md: each term)."""
    n, V = _parameters_and_rows(dataclasses.astuple(config))
    C, L = config.n_embd, config.n_layer
    layer = (36 if bf16 else 64) * C + 24 + (2 * C if config.dropout > 0 else 0)
    head = (14 if bf16 else 16) * V + (10 if bf16 else 15) * C
    recompute = layer + (12 if bf16 else 20) * C  # one block's activations and their gradients
    tokens = batch_size * config.block_size
    if checkpointing:
        activations = max(tokens * (L * 4 * C + max(head, recompute)), 4 * n + tokens * (4 * C + recompute))
    else:
        activations = max(tokens * (L * layer + head), 4 * n)
    casts = 2 * (12 * C * C * (1 if checkpointing else L) + V * C) if bf16 else 0
    return 12 * n + casts + activations


@functools.lru_cache(maxsize=64)
def _parameters_and_rows(shape: tuple) -> tuple[int, int]:
    """GPT(GPTConfig(*shape))'s parameter count and token-table rows, from a model on the meta device."""
    with torch.device("meta"):
        model = GPT(GPTConfig(*shape))
    return model.num_params(non_embedding=False), model.transformer.wte.num_embeddings


def largest_batch(config: GPTConfig, gpu_bytes: float, bf16: bool, checkpointing: bool) -> int:
    """The largest micro-batch (up to 4096) whose training fits on a GPU of `gpu_bytes`: the predicted tensors with
    the allocator's reserve, plus the CUDA context; 0 if not one."""
    budget = (gpu_bytes - CUDA_CONTEXT) / RESERVED_OVER_ALLOCATED
    return bisect.bisect_right(range(1, 4097), budget, key=lambda b: training_memory(config, b, bf16, checkpointing))


def probe_config(probe: tuple[int, ...]) -> GPTConfig:
    n_layer, n_embd, block_size, _, _, vocab, _, _ = probe
    return GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd,
                     bias=False)


def bench_memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, (n_layer, n_head, n_embd) in GPT2_SHAPES.items():
        model = GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=False)
        for gib in GPU_GIB:
            row = {"section": "memory: what fits (bf16, block 1024)", "model": name, "gpu_gib": gib}
            for label, ck in (("plain", False), ("checkpointed", True)):
                batch = largest_batch(model, gib * GIB, True, ck)
                accum = -(-STEP_TOKENS // (batch * 1024)) if batch else 0
                row[label] = f"batch_size={batch} grad_accum={accum}" if batch else "does not fit"
            rows.append(row)
    probes = MEMORY_PROBES.get(torch.device(args.device).type, [])[: args.memory_probes]
    return rows + [probe_row(probe, args.device) for probe in probes]


def probe_row(probe: tuple[int, ...], device: str, backend: str = "inductor") -> dict:
    """A probe's measured peak against its prediction; `backend`: torch.compile's, for a compiled probe."""
    n_layer, n_embd, block_size, batch_size, ck, vocab, bf16, compiled = probe
    measured = measured_memory(probe, device, backend)
    predicted = training_memory(probe_config(probe), batch_size, bool(bf16), bool(ck))
    return {"section": f"memory: predicted against measured ({torch.device(device).type})",
            "shape": f"{n_layer}x{n_embd}, vocab {vocab}, block {block_size}, batch {batch_size}",
            "dtype": "bfloat16" if bf16 else "float32", "checkpointing": bool(ck), "compiled": bool(compiled),
            "measured_mib": measured["allocated"] / 2**20, "predicted_mib": predicted / 2**20,
            "predicted_over_measured": predicted / measured["allocated"],
            "reserved_over_allocated": measured["reserved"] / measured["allocated"] if measured["reserved"] else "-"}


def measured_memory(probe: tuple[int, ...], device: str, backend: str = "inductor") -> dict[str, int]:
    """Peak bytes two AdamW steps of a probe's shape add, from building the model on: on CUDA the allocator's peaks
    of allocated and of reserved memory; on a CPU the peak of live tensor bytes, summed in order from the allocations
    and frees torch's profiler records (RSS would also count the allocator's slack and the interpreter)."""
    _, _, block_size, batch_size, checkpointing, vocab, bf16, compiled = probe
    cuda = device.startswith("cuda")

    def two_steps() -> None:
        torch.manual_seed(0)
        model = GPT(probe_config(probe)).to(device).train()
        model.activation_checkpointing = bool(checkpointing)
        forward = torch.compile(model, backend=backend) if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)
        for _ in range(2):  # the second step holds AdamW's state too
            block = torch.randint(vocab, (batch_size, block_size + 1), device=device)  # as get_batch cuts it
            with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=bool(bf16)):
                _, loss = forward(block[:, :-1], block[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        two_steps()
        return {"allocated": torch.cuda.max_memory_allocated() - allocated,
                "reserved": torch.cuda.max_memory_reserved() - reserved}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        two_steps()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return {"allocated": peak, "reserved": 0}
