"""nanoGPT's model and training loop as its users run them, reading our prepared tokens: bench.py train's yardstick
(karpathy/nanoGPT's model.py and train.py with bias=False), not a second model to train."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.runtime import Runtime
from data.prepare import TokenFiles


class Block(nn.Module):
    """A pre-LN GPT-2 block without biases; attention through SDPA with is_causal."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=False), nn.LayerNorm(n_embd, bias=False)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd, bias=False), nn.Linear(n_embd, n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """GPT-2 with tied embeddings and the token table padded to a multiple of 64 (50304 rows for GPT-2's BPE)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        padded = -(-vocab_size // 64) * 64
        self.wte, self.wpe = nn.Embedding(padded, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, padded, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # residual projections scaled down, as GPT-2 initialises them
            if p.dim() == 2:
                residual = name.endswith(("c_proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the loss, as nanoGPT's model returns them (the compiled graph keeps the logits too)."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def nanogpt_step(model: PlainGPT, runtime: Runtime, tokens: TokenFiles, batch_size: int, grad_accum: int,
                 adamw: dict, grad_clip: float, backend: str | None) -> Callable[[], None]:
    """One iteration of nanoGPT's train.py loop: the model compiled by torch.compile's `backend` (None: eager), the
    next batch drawn while the device runs the forward, fused AdamW where the device has it, clipping at
    grad_clip. `adamw`: lr, betas, weight_decay."""
    block = model.wpe.num_embeddings
    decay = [p for p in model.parameters() if p.dim() >= 2]
    groups = [{"params": decay, "weight_decay": adamw.pop("weight_decay")},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, **adamw, fused=runtime.is_cuda or None)
    forward = torch.compile(model, backend=backend) if backend else model

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = tokens.open(0)  # memmapped anew each call, as nanoGPT does
        ix = torch.randint(len(data) - block, (batch_size,))
        x, y = (torch.stack([torch.from_numpy(data[i + s : i + s + block].astype("int64")) for i in ix])
                for s in (0, 1))
        if runtime.is_cuda:  # pinned, so that the copy overlaps the device's work
            return tuple(t.pin_memory().to(runtime.device, non_blocking=True) for t in (x, y))
        return x, y

    batch = [get_batch()]

    def step() -> None:
        for _ in range(grad_accum):
            with runtime.autocast():
                loss = forward(*batch[0])[1] / grad_accum
            batch[0] = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
