"""MuonAdamW: Muon (modded-nanogpt's) for hidden weight matrices, AdamW for embeddings, head, norm gains and biases.
Muon: Nesterov momentum, then the update orthogonalised by a few Newton-Schulz steps so every direction of the matrix
moves about as much. One Optimizer holds both kinds (group["muon"]), so clipping, GradScaler, state dicts work as is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's: the steepest slope at zero that still stays near 1
MUON_KEYS = ("lr", "momentum", "nesterov", "ns_steps", "weight_decay")  # what each kind of group must carry
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def newton_schulz(grad: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """About U V^T of G = U S V^T, in grad's dtype: after a Frobenius normalisation (spectral norm <= 1), singular
    values go to roughly 0.7..1.2, not 1 (faster, no worse for training). grad: (..., rows, cols), each on its own."""
    a, b, c = NS_COEFFICIENTS
    x = grad.reshape(-1, *grad.shape[-2:])
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a X + (b A + c A^2) X
    return (x.mT if tall else x).reshape(grad.shape)


class MuonAdamW(torch.optim.Optimizer):
    """Param groups with group["muon"] True: Muon (MUON_KEYS), for 2-D matrices, orthogonalised in ns_dtype; the
    others AdamW (ADAMW_KEYS), as torch.optim.AdamW. Each group carries all its keys: there are no defaults."""

    def __init__(self, param_groups: list[dict[str, Any]], ns_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(param_groups, defaults={})
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon's groups take 2-D matrices only")
            missing = set(MUON_KEYS if group["muon"] else ADAMW_KEYS) - set(group)
            if missing:
                raise ValueError(f"a {'Muon' if group['muon'] else 'AdamW'} group lacks {sorted(missing)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon(group, params)
            else:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        same_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (param, its momentum update)
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            same_shape.setdefault(p.shape, []).append((p, update))
        for (rows, cols), pairs in same_shape.items():  # one Newton-Schulz per shape: the blocks' matrices batch
            stacked = torch.stack([update for _, update in pairs]).to(self.ns_dtype)
            orthogonal = newton_schulz(stacked, steps=group["ns_steps"])
            for (p, _), update in zip(pairs, orthogonal, strict=True):
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr * max(1, rows / cols) ** 0.5)  # Keller Jordan's scale (and torch's)

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in params:
            state = self.state[p]
            if not state:  # the layout of torch.optim.AdamW's state
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * decay)
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
