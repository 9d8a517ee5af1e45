"""What training a model costs in memory, predicted before allocating it: parameters, gradients, optimizer state,
the activations one micro-batch keeps for backward, and backward's largest transient. bench.py memory checks the
prediction against a measurement where this machine can measure, and prints what fits on common GPUs;
scripts/gpu_check.py compares it with a GPU's peak.

The activations are counted for the GPT-2 block as model/ writes it (LayerNorm, GELU, fused attention, which
keeps no T x T matrix), per token and layer, in elements of C = n_embd:
    ln_1's input C, c_attn's input C, q, k, v 3C, attention's output C, its c_proj's input C,
    ln_2's input C, c_fc's input C, GELU's input 4C, the MLP's c_proj input 4C: 17C;
in float32 68C bytes. Under bfloat16 autocast the linear layers' and attention's inputs are kept in bfloat16
and the norms' in float32: 4C + 2C + 6C + 2C + 2C + 4C + 2C + 8C + 8C = 38C bytes (46C measured: the estimate
uses that). Dropout adds a 1-byte mask
per residual branch (2C; on CPU, attention dropout runs SDPA's math path, which keeps T x T weights: not
counted here). With activation checkpointing a block keeps only its input (C), and backward holds
one block's activations, and their gradients, at a time. The head keeps its input and the logits, B·T·V in the
activations' dtype, plus cross-entropy's float32 log-probabilities; backward's transient is the logits' float32
gradients (two at once) and the first of the last block's; bfloat16 autocast also keeps a copy of each weight
matrix. The peak comes at backward's start, before any gradient is
allocated (the gradients grow as the activations are freed). Measured on CPU, the saved activations match the
count to 0.3 %, and the peak is within 15 % (bench.py memory).
The modern options (relu², RMSNorm, QK-norm, the shortcuts) change the block's count by a few C: the estimate is
the GPT-2 block's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.runtime import check_memory, memory_bytes
from model import GPTConfig
from model.config import parameter_count
from training.distributed import World
from training.schema import OptimConfig

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, for one process holding the whole model (DDP; FSDP divides the first three by the processes)."""

    params: int
    grads: int
    optimizer: int
    activations: int  # what forward keeps for backward, one micro-batch
    transient: int  # backward's largest extra allocation

    @property
    def total(self) -> int:
        """The peak: at backward's start (every activation kept, no gradient yet), or after it (every gradient,
        the activations freed), whichever is larger; measured on CPU, the first but for tiny batches."""
        return self.params + self.optimizer + max(self.activations + self.transient, self.grads)


def activation_bytes(config: GPTConfig, batch_size: int, bf16: bool, checkpointing: bool) -> tuple[int, int]:
    """(kept for backward, backward's largest transient) for one micro-batch of batch_size x block_size."""
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    tokens = batch_size * config.block_size
    # bytes per token: 68C counted in float32; in bfloat16 38C counted, 46C measured on CPU (the estimate takes
    # the measurement: autocast keeps a few casts the count misses)
    per_layer = (46 if bf16 else 68) * C + (2 * C if config.dropout > 0 else 0)
    boundary = 4 * C  # a block's input: the residual stream stays float32 under autocast
    # checkpointed: every block's input, and the block being recomputed in backward, with its gradients
    blocks = L * boundary + 2 * per_layer if checkpointing else L * per_layer
    logits = (2 if bf16 else 4) * V + 4 * V  # the logits, and cross-entropy's float32 log-probabilities
    head = 4 * C + (2 if bf16 else 4) * C + logits
    embeddings = 4 * C
    transient = 8 * V + per_layer // 2  # cross-entropy's backward: two float32 logits-sized gradients at once
    # autocast's bfloat16 copies of the weight matrices, kept for backward: the blocks' and the head's
    weight_copies = 2 * (12 * L * C * C + V * C) if bf16 else 0
    return tokens * (blocks + head + embeddings) + weight_copies, tokens * transient


def training_memory(
    config: GPTConfig, batch_size: int, bf16: bool, optimizer: str = "adamw", checkpointing: bool = False
) -> MemoryEstimate:
    """Parameters and gradients in float32 (autocast keeps the weights in float32), AdamW's two moments per
    parameter, or Muon's one momentum for the blocks' matrices and AdamW's two for the rest."""
    n = parameter_count(config)
    matrices = config.n_layer * 12 * config.n_embd**2  # the blocks' nn.Linear weights: Muon's
    moments = 2 * n if optimizer == "adamw" else matrices + 2 * (n - matrices)
    kept, transient = activation_bytes(config, batch_size, bf16, checkpointing)
    return MemoryEstimate(params=4 * n, grads=4 * n, optimizer=4 * moments, activations=kept, transient=transient)


def largest_batch(config: GPTConfig, budget_bytes: float, bf16: bool, checkpointing: bool, limit: int = 4096) -> int:
    """The largest micro-batch (up to limit) whose training fits in budget_bytes, with AdamW; 0 if not one."""

    def fits(batch: int) -> bool:
        return training_memory(config, batch, bf16, checkpointing=checkpointing).total <= budget_bytes

    low, high = 0, limit  # the answer lies in low .. high, and low fits or is 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def check_fits(config: GPTConfig, opt: OptimConfig, device: torch.device, world: World) -> None:
    """Before the model is built: a run whose predicted peak outgrows the device's memory is refused in one line,
    not left to swap or be killed. A generous bound first (every estimate below is under it), so the estimate
    itself runs only for a run that may not fit."""
    tokens = opt.batch_size * config.block_size
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    bound = 18 * parameter_count(config) + tokens * (70 * C * L + 187 * C + 16 * V)
    memory = memory_bytes(device)
    if memory is None or bound * (world.size if device.type == "cpu" else 1) <= memory:
        return
    _refuse_unless_it_fits(config, opt, device, world)


def _refuse_unless_it_fits(config: GPTConfig, opt: OptimConfig, device: torch.device, world: World) -> None:
    """The smaller of the float32 and bfloat16 estimates, so nothing that could fit is refused. On a CPU the
    processes of a torchrun share the machine's memory; FSDP2 shards the model's state."""
    checkpointing = opt.activation_checkpointing
    estimates = [training_memory(config, opt.batch_size, bf16, opt.optimizer, checkpointing) for bf16 in (0, 1)]
    e = min(estimates, key=lambda estimate: estimate.total)
    shards = world.size if world.distributed and opt.parallel == "fsdp" else 1
    need = (e.params + e.optimizer) / shards + max(e.activations + e.transient, e.grads / shards)
    need *= world.size if device.type == "cpu" else 1
    weights = (e.params + e.grads + e.optimizer) / GIB
    check_memory(
        need,
        device,
        f"this run ({weights:,.1f} GiB for {parameter_count(config):,} parameters, their gradients and optimizer "
        f"state; {e.activations / GIB:,.1f} GiB of activations at train.batch_size={opt.batch_size})",
        "lower train.batch_size (train.grad_accum keeps the tokens per step), set train.activation_checkpointing=true, "
        "or train a smaller model",
    )
