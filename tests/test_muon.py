"""train.optimizer=muon: Newton-Schulz, the Muon and AdamW halves of MuonAdamW against torch's own, which
parameters go where, and the per-step hyperparameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import training.muon
from common.runtime import Runtime
from model import GPT, GPTConfig
from train import TrainConfig
from training.muon import MuonAdamW, newton_schulz
from training.trainer import FROM_CONFIG, lr_at, make_optimizer, set_hyperparameters

CPU = Runtime(torch.device("cpu"), torch.float32)
MUON = {"muon": True, "lr": 0.02, "momentum": 0.9, "nesterov": True, "ns_steps": 5, "weight_decay": 0.1}
ADAMW = {"muon": False, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=32, block_size=16))


def test_newton_schulz_orthogonalises_each_matrix_of_a_stack_on_its_own() -> None:
    torch.manual_seed(0)
    for rows, cols in ((384, 128), (128, 512)):  # tall (transposed inside) and wide
        grad = torch.randn(rows, cols) * 1e-3  # any scale: it is normalised first
        out = newton_schulz(grad)
        singular = torch.linalg.svdvals(out)
        assert out.dtype == torch.float32 and singular.min() > 0.65 and singular.max() < 1.2  # the quintic's band
        u, _, vh = torch.linalg.svd(grad, full_matrices=False)
        assert (out - u @ vh).norm() / (u @ vh).norm() < 0.25  # and near U V^T: the same directions
    # MuonAdamW stacks same-shape updates into one call: each comes out as if alone, by its own norm.
    stack = torch.randn(3, 48, 16) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    out = newton_schulz(stack)
    for matrix, alone in zip(stack, out, strict=True):
        assert torch.equal(newton_schulz(matrix), alone)
    torch.testing.assert_close(newton_schulz(stack.mT), out.mT, atol=1e-5, rtol=0)


def test_each_kind_of_group_steps_as_torch_s_own_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Muon groups as torch.optim.Muon (its Newton-Schulz in bfloat16 swapped for ours in float32): momentum, Nesterov,
    the tall matrix's sqrt(rows/cols), decoupled weight decay, two matrices of one shape in one batch. AdamW groups as
    torch.optim.AdamW. The trainer's found_inf of 0 (every step it doesn't skip) steps as no flag at all."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", lambda grad, *args: newton_schulz(grad))
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(shape)) for shape in ((24, 8), (8, 16), (24, 8), (6, 4), (4,))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    mixed = MuonAdamW([{**MUON, "params": ours[:3]}, {**ADAMW, "params": ours[3:4]},
                       {**ADAMW, "params": ours[4:], "weight_decay": 0.0}])
    mixed.found_inf = torch.zeros(())
    muon = torch.optim.Muon(theirs[:3], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)
    adamw = torch.optim.AdamW([{"params": theirs[3:4]}, {"params": theirs[4:], "weight_decay": 0.0}], lr=1e-2,
                              betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        for optimizer in (mixed, muon, adamw):
            optimizer.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_muon_takes_the_blocks_linear_weights_and_adamw_the_rest() -> None:
    model = _tiny_gpt()
    model.transformer.h[0].extra = nn.Embedding(4, 32)  # what a block may gain later: AdamW's, by type
    model.transformer.h[0].gain = nn.Parameter(torch.ones(()))
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = make_optimizer(model, TrainConfig(optimizer="muon"), CPU)
    groups = [({names[id(p)] for p in g["params"]}, g) for g in optimizer.param_groups]
    (muon, muon_group), (decayed, decayed_group), (not_decayed, not_decayed_group) = groups[-1], *groups[:-1]
    linears = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert muon == {f"transformer.h.{i}.{linear}.weight" for i in range(2) for linear in linears}
    assert muon_group["muon"] and "betas" not in muon_group
    assert decayed == {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.extra.weight"}
    assert decayed_group["weight_decay"] == muon_group["weight_decay"] == 0.1 and not_decayed_group["weight_decay"] == 0
    assert "transformer.h.0.gain" in not_decayed and "transformer.h.1.mlp.c_fc.bias" in not_decayed
    assert not any(g["muon"] or "momentum" in g for g in (decayed_group, not_decayed_group))
    assert muon | decayed | not_decayed == set(names.values())  # the head is tied to wte
    # restore() re-applies FROM_CONFIG: a key missing there would not be
    assert all(set(group) - {"params", "muon"} <= set(FROM_CONFIG) for group in optimizer.param_groups)
    bfloat16_run = make_optimizer(model, TrainConfig(optimizer="muon"), Runtime(CPU.device, torch.bfloat16))
    assert optimizer.ns_dtype == torch.float32 and bfloat16_run.ns_dtype == torch.bfloat16  # Newton-Schulz's
    plain = make_optimizer(_tiny_gpt(), TrainConfig(), CPU)  # train.optimizer=adamw: nanoGPT's, as before
    assert type(plain) is torch.optim.AdamW and plain.defaults["fused"] and len(plain.param_groups) == 2


def test_every_group_gets_its_step_hyperparameters_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """muon_ns_steps reaches each Newton-Schulz call (one a shape), muon_lr scales the schedule, momentum warms up."""
    calls = []
    original = training.muon.newton_schulz
    monkeypatch.setattr(training.muon, "newton_schulz", lambda g, steps: calls.append((tuple(g.shape), steps))
                        or original(g, steps))
    train = TrainConfig(optimizer="muon", learning_rate=1e-3, muon_lr=0.02, warmup_iters=10, max_iters=1000,
                        muon_ns_steps=3)
    model = _tiny_gpt()
    optimizer = make_optimizer(model, train, CPU)
    model(torch.randint(65, (2, 16)), torch.randint(65, (2, 16)))[1].backward()
    optimizer.step()
    # two layers: c_attn (96x32), attn c_proj (32x32), c_fc (128x32), mlp c_proj (32x128), each a stack of 2
    assert sorted(calls) == sorted([((2, 96, 32), 3), ((2, 32, 32), 3), ((2, 128, 32), 3), ((2, 32, 128), 3)])
    *adamw, muon = optimizer.param_groups
    for step, momentum in ((0, 0.85), (150, 0.90), (300, 0.95), (900, 0.95)):  # muon_momentum_warmup=300
        lr = set_hyperparameters(optimizer, train, step)
        assert lr == lr_at(step, 1e-3, train.min_lr, 10, 1000) == adamw[0]["lr"] == adamw[1]["lr"]
        assert muon["lr"] == pytest.approx(20 * lr) and muon["momentum"] == pytest.approx(momentum)
    train.muon_momentum_warmup = 0
    set_hyperparameters(optimizer, train, 0)
    assert muon["momentum"] == 0.95
