"""MuonAdamW: Muon (modded-nanogpt's Nesterov update, orthogonalised so every direction of a matrix moves about as
much) for hidden weight matrices, AdamW for the rest, in one Optimizer: clipping, GradScaler, state dicts work as is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim._functional import adamw

if TYPE_CHECKING:  # the train.* keys, for annotations
    from train import TrainConfig

MUON_MOMENTUM_START = 0.85  # where Muon's momentum starts its warmup (train.muon_momentum_warmup)


def newton_schulz(grad: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """About U V^T of G = U S V^T, in grad's dtype: after a Frobenius normalisation (spectral norm <= 1), singular
    values go to roughly 0.7..1.2, not 1 (faster, no worse for training). grad: (..., rows, cols), each on its own."""
    a, b, c = 3.4445, -4.7750, 2.0315  # the quintic's: the steepest slope at zero that still stays near 1
    x = grad.reshape(-1, *grad.shape[-2:])
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a X + (b A + c A^2) X
    return (x.mT if tall else x).reshape(grad.shape)


class MuonAdamW(torch.optim.Optimizer):
    """Param groups with group["muon"] True: Muon (lr, momentum, nesterov, ns_steps, weight_decay), for 2-D matrices,
    orthogonalised in ns_dtype; the others AdamW (lr, betas, eps, weight_decay). There are no defaults."""

    def __init__(self, param_groups: list[dict[str, Any]], ns_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(param_groups, defaults={})
        self.ns_dtype = ns_dtype

    def __setstate__(self, state: dict[str, Any]) -> None:
        """AdamW's step counts on their parameters' device, where the fused kernel counts (older checkpoints: CPU)."""
        super().__setstate__(state)
        for p, p_state in self.state.items():
            if "step" in p_state:
                p_state["step"] = p_state["step"].to(p.device, torch.float32)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One step of every group (no closure); none at all, decided on the device, when self.found_inf (set by the
        trainer, as GradScaler sets it for torch's fused optimizers) holds 1: weights and state stay as they were."""
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(group, params, found_inf)

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
        """Each shape's matrices stacked: one Newton-Schulz and a few whole-stack operations per shape."""
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        same_shape: dict[torch.Size, list[torch.Tensor]] = {}
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            same_shape.setdefault(p.shape, []).append(p)
        for (rows, cols), matrices in same_shape.items():
            buffers = [self.state[p]["momentum_buffer"] for p in matrices]
            grads, old_buffers, old_weights = map(torch.stack, ([p.grad for p in matrices], buffers, matrices))
            buffer = old_buffers.lerp(grads, 1 - momentum)
            update = grads.lerp(buffer, momentum) if group["nesterov"] else buffer
            orthogonal = newton_schulz(update.to(self.ns_dtype), steps=group["ns_steps"])
            weights = old_weights.mul(1 - lr * decay)
            weights.add_(orthogonal, alpha=-lr * max(1, rows / cols) ** 0.5)  # Keller Jordan's scale (and torch's)
            if found_inf is not None:  # a skipped step's NaN never leaves this function
                keep = found_inf == 0
                buffer, weights = torch.where(keep, buffer, old_buffers), torch.where(keep, weights, old_weights)
            torch._foreach_copy_(buffers, list(buffer))
            torch._foreach_copy_(matrices, list(weights))

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
        """torch's fused AdamW kernel, on the state layout of torch.optim.AdamW(fused=True)."""
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
              [s["step"] for s in states], fused=True, found_inf=found_inf, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def muon_adamw(model: nn.Module, train: TrainConfig, dtype: torch.dtype) -> MuonAdamW:
    """Muon for the blocks' nn.Linear weights (the hidden matrices); AdamW for embeddings, the head, norms and biases,
    with weight decay on the 2-D ones. Newton-Schulz runs in bfloat16 when training does: it is faster there."""
    hidden = [m.weight for m in model.transformer.h.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
    hidden_ids = {id(h) for h in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden_ids]
    adam = {"muon": False, "lr": train.learning_rate, "betas": (train.beta1, train.beta2), "eps": 1e-8}
    groups = [{**adam, "params": [p for p in rest if p.dim() >= 2], "weight_decay": train.weight_decay},
              {**adam, "params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
              {"muon": True, "params": hidden, "lr": train.muon_lr, "momentum": train.muon_momentum, "nesterov": True,
               "ns_steps": train.muon_ns_steps, "weight_decay": train.weight_decay}]  # decoupled, as AdamW's
    return MuonAdamW(groups, ns_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
