"""Muon: Newton-Schulz, and the Muon and AdamW halves of MuonAdamW against torch's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.muon import MuonAdamW, newton_schulz

MUON = {"muon": True, "lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}
ADAMW = {"muon": False, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _step_with_random_grads(optimizers: list[torch.optim.Optimizer], params: list[list[nn.Parameter]]) -> None:
    """The same gradients for each optimizer's copy of the parameters."""
    grads = [torch.randn_like(p) for p in params[0]]
    for optimizer, copy in zip(optimizers, params, strict=True):
        for p, g in zip(copy, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("shape", [(384, 128), (128, 512)])  # tall (transposed inside) and wide
def test_newton_schulz_brings_the_singular_values_near_one(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    grad = torch.randn(shape) * 1e-3  # any scale: it is normalised first
    out = newton_schulz(grad)
    assert out.shape == grad.shape and out.dtype == torch.float32
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.65 and singular.max() < 1.2  # the quintic's band, not exactly 1
    u, _, vh = torch.linalg.svd(grad, full_matrices=False)
    assert (out - u @ vh).norm() / (u @ vh).norm() < 0.25  # and near U V^T: the same directions
    torch.testing.assert_close(newton_schulz(grad.T), out.T, atol=1e-5, rtol=0)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon came with torch 2.9")
def test_muon_groups_step_as_torch_optim_muon_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.optim.Muon's update (its Newton-Schulz in bfloat16 swapped for ours in float32): momentum, Nesterov,
    the tall matrix's sqrt(rows/cols), decoupled weight decay."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", lambda grad, *args: newton_schulz(grad))
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(24, 8)), nn.Parameter(torch.randn(8, 16))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    muon = MuonAdamW([{**MUON, "params": ours}])
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)
    for _ in range(3):
        _step_with_random_grads([muon, reference], [ours, theirs])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_adamw_groups_step_as_torch_optim_adamw() -> None:
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    adamw = MuonAdamW([{**ADAMW, "params": ours[:1]}, {**ADAMW, "params": ours[1:], "weight_decay": 0.0}])
    groups = [{"params": theirs[:1]}, {"params": theirs[1:], "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    for _ in range(3):
        _step_with_random_grads([adamw, reference], [ours, theirs])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
