"""AdamW (decay on 2-D weights only) or Muon for hidden matrices; lr: warmup, then cosine or warmup-stable-decay."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common.runtime import Runtime
from training.muon import ADAMW_KEYS, MUON_KEYS, MuonAdamW

if TYPE_CHECKING:  # training.schema imports this module's choices
    from training.schema import OptimConfig

OPTIMIZERS = ("adamw", "muon")
FROM_CONFIG = tuple(dict.fromkeys(ADAMW_KEYS + MUON_KEYS))  # a param group's keys: make_optimizer sets them
MUON_MOMENTUM_START = 0.85  # where Muon's momentum starts its warmup (train.muon_momentum_warmup)


def make_optimizer(model: nn.Module, train: OptimConfig, runtime: Runtime) -> torch.optim.Optimizer:
    """train.optimizer's, its param groups' hyperparameters from the config (restore() keeps them on resume)."""
    hidden = hidden_matrices(model) if train.optimizer == "muon" else {}
    rest = [p for name, p in model.named_parameters() if p.requires_grad and name not in hidden]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": train.weight_decay},  # matmuls, embeddings
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},  # biases, norms
    ]
    if train.optimizer == "muon":
        return _muon(groups, hidden, train, runtime)
    # The fused kernel: one pass over all parameters, and it skips a step on the device (the trainer's found_inf).
    return torch.optim.AdamW(groups, lr=train.learning_rate, betas=(train.beta1, train.beta2), fused=True)


def _muon(
    groups: list[dict[str, Any]], hidden: dict[str, nn.Parameter], train: OptimConfig, runtime: Runtime
) -> MuonAdamW:
    """Muon for hidden matrices, AdamW for the rest; Newton-Schulz in bf16 under bf16 autocast (faster), else fp32."""
    adamw = {"muon": False, "lr": train.learning_rate, "betas": (train.beta1, train.beta2), "eps": 1e-8}
    muon = {
        "muon": True,
        "params": list(hidden.values()),
        "lr": train.muon_lr,
        "momentum": train.muon_momentum,
        "nesterov": True,
        "ns_steps": train.muon_ns_steps,
        "weight_decay": train.weight_decay,  # decoupled, as AdamW's
    }
    return MuonAdamW(
        [*({**adamw, **g} for g in groups), muon],
        ns_dtype=torch.bfloat16 if runtime.dtype == torch.bfloat16 else torch.float32,
    )


def hidden_matrices(model: nn.Module) -> dict[str, nn.Parameter]:
    """Muon's, by name: the blocks' nn.Linear weights. Embeddings, the head, norms and biases stay with AdamW."""
    return {
        f"transformer.h.{name}.weight": module.weight
        for name, module in model.transformer.h.named_modules()
        if isinstance(module, nn.Linear) and module.weight.requires_grad
    }


def set_hyperparameters(optimizer: torch.optim.Optimizer, train: OptimConfig, step: int) -> float:
    """The step's learning rate (Muon's scaled to muon_lr) and Muon's momentum, from the step alone; AdamW's lr."""
    lr = scheduled_lr(train, step)
    for group in optimizer.param_groups:
        if group.get("muon"):
            group["lr"] = train.muon_lr * lr / train.learning_rate
            group["momentum"] = muon_momentum_at(step, train.muon_momentum, train.muon_momentum_warmup)
        else:
            group["lr"] = lr
    return lr


def scheduled_lr(train: OptimConfig, step: int) -> float:
    """AdamW's learning rate at `step` under the config's schedule."""
    t = train
    return lr_at(step, t.learning_rate, t.min_lr, t.warmup_iters, t.decay_iters, t.lr_schedule, t.cooldown_frac)


def muon_momentum_at(step: int, momentum: float, warmup_iters: int) -> float:
    """From MUON_MOMENTUM_START up to `momentum` in a straight line over warmup_iters, then `momentum`."""
    frac = min(step / warmup_iters, 1.0) if warmup_iters else 1.0
    return (1 - frac) * MUON_MOMENTUM_START + frac * momentum


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's config hyperparameters, for restore() to put back over a loaded state dict's (saved) ones."""
    return [{k: group[k] for k in FROM_CONFIG if k in group} for group in optimizer.param_groups]


LR_SCHEDULES = ("cosine", "wsd")


def lr_at(step: int, learning_rate: float, min_lr: float, warmup_iters: int, decay_iters: int,
          schedule: str = "cosine", cooldown_frac: float = 0.2) -> float:
    """Linear warmup, then to min_lr at decay_iters: a half cosine, or (wsd) flat until a linear cooldown."""
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if step >= decay_iters:
        return min_lr
    if schedule == "wsd":
        cooldown_start = max(warmup_iters, decay_iters - round(cooldown_frac * decay_iters))
        progress = max(0, step - cooldown_start) / max(1, decay_iters - cooldown_start)
        return learning_rate - progress * (learning_rate - min_lr)
    progress = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)
