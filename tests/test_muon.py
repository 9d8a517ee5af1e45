"""train.optimizer=muon: Newton-Schulz, the Muon and AdamW halves of MuonAdamW against torch's own, which
parameters go where, and the per-step hyperparameters."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from common.runtime import Runtime
from model import GPT, GPTConfig
from training.muon import MuonAdamW, newton_schulz
from training.schema import OptimConfig
from training.trainer import FROM_CONFIG, lr_at, make_optimizer, set_hyperparameters

CPU = Runtime(torch.device("cpu"), torch.float32)
MUON = {"muon": True, "lr": 0.02, "momentum": 0.9, "nesterov": True, "ns_steps": 5, "weight_decay": 0.1}
ADAMW = {"muon": False, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _tiny_gpt(**settings: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=32, block_size=16, **settings))


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


def _one_matrix_newton_schulz(grad: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration written out for one 2-D matrix, as a reference for the batched one."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad / (grad.norm() + 1e-7)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_newton_schulz_of_a_stack_is_each_matrix_on_its_own() -> None:
    """MuonAdamW stacks same-shape updates into one call: each must come out as if alone (its own norm)."""
    torch.manual_seed(0)
    for shape in ((3, 48, 16), (3, 16, 48)):
        stack = torch.randn(shape) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
        out = newton_schulz(stack)
        assert out.shape == stack.shape
        for matrix, alone in zip(stack, out, strict=True):
            torch.testing.assert_close(alone, _one_matrix_newton_schulz(matrix), atol=1e-5, rtol=0)
            assert torch.equal(newton_schulz(matrix), alone)  # one matrix or a stack: the same numbers


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon came with torch 2.9")
def test_muon_groups_step_as_torch_optim_muon_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.optim.Muon's update (its Newton-Schulz in bfloat16 swapped for ours in float32): momentum, Nesterov,
    the tall matrix's sqrt(rows/cols), decoupled weight decay; two of the matrices share a shape (one batch)."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", lambda grad, *args: newton_schulz(grad))
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(24, 8)), nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(24, 8))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    muon = MuonAdamW([{**MUON, "params": ours}])
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)
    for _ in range(3):
        _step_with_random_grads([muon, reference], [ours, theirs])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_group_without_its_keys_is_refused_at_construction() -> None:
    muon = {k: v for k, v in MUON.items() if k != "ns_steps"}
    with pytest.raises(ValueError, match=r"a Muon group lacks \['ns_steps'\]"):
        MuonAdamW([{**muon, "params": [nn.Parameter(torch.zeros(4, 4))]}])


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


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_step_with_found_inf_leaves_the_weights_and_state_as_they_were(optimizer: str) -> None:
    """The trainer's skip of a NaN step, decided on the device: NaN gradients and found_inf 1 change nothing, not
    even the AdamW step counts; found_inf 0 steps as no flag at all."""
    models = [_tiny_gpt() for _ in range(3)]
    optimizers = [make_optimizer(model, OptimConfig(optimizer=optimizer), CPU) for model in models]
    _step_with_random_grads(optimizers, [list(model.parameters()) for model in models])
    state_before = [{k: v.clone() for k, v in s.items()} for s in optimizers[0].state.values()]
    weights_before = [p.detach().clone() for p in models[0].parameters()]
    for p in models[0].parameters():
        p.grad = torch.full_like(p, math.nan)
    optimizers[0].found_inf = torch.ones(())
    optimizers[0].step()
    assert all(torch.equal(a, b) for a, b in zip(weights_before, models[0].parameters(), strict=True))
    for before, after in zip(state_before, optimizers[0].state.values(), strict=True):
        assert all(torch.equal(before[k], after[k]) for k in before)
    optimizers[1].found_inf = torch.zeros(())
    _step_with_random_grads(optimizers[1:], [list(model.parameters()) for model in models[1:]])
    assert all(torch.equal(a, b) for a, b in zip(models[1].parameters(), models[2].parameters(), strict=True))


def test_muon_takes_the_blocks_linear_weights_and_adamw_the_rest() -> None:
    model = _tiny_gpt()
    model.transformer.h[0].extra = nn.Embedding(4, 32)  # what a block may gain later: AdamW's, by type
    model.transformer.h[0].gain = nn.Parameter(torch.ones(()))
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = make_optimizer(model, OptimConfig(optimizer="muon"), CPU)
    groups = [({names[id(p)] for p in g["params"]}, g) for g in optimizer.param_groups]
    (muon, muon_group), adamw = groups[-1], groups[:-1]
    linears = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert muon == {f"transformer.h.{i}.{linear}.weight" for i in range(2) for linear in linears}
    assert muon_group["muon"] and "betas" not in muon_group
    (decayed, decayed_group), (not_decayed, not_decayed_group) = adamw
    assert decayed == {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.extra.weight"}
    assert decayed_group["weight_decay"] == muon_group["weight_decay"] == 0.1
    assert "transformer.h.0.gain" in not_decayed and "transformer.h.1.mlp.c_fc.bias" in not_decayed
    assert not_decayed_group["weight_decay"] == 0.0
    assert not any(g["muon"] or "momentum" in g for _, g in adamw)
    assert muon | decayed | not_decayed == set(names.values())  # the head is tied to wte
    for group in optimizer.param_groups:  # restore() re-applies FROM_CONFIG: a key missing there would not be
        assert set(group) - {"params", "muon"} <= set(FROM_CONFIG)

    bfloat16_run = make_optimizer(model, OptimConfig(optimizer="muon"), Runtime(CPU.device, torch.bfloat16))
    assert optimizer.ns_dtype == torch.float32 and bfloat16_run.ns_dtype == torch.bfloat16  # Newton-Schulz's
    plain = make_optimizer(_tiny_gpt(), OptimConfig(), CPU)  # train.optimizer=adamw: nanoGPT's, as before
    assert type(plain) is torch.optim.AdamW and plain.defaults["fused"] and len(plain.param_groups) == 2


def test_muon_ns_steps_sets_the_newton_schulz_iterations(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.muon_ns_steps reaches every Newton-Schulz call; each shape of matrix is one call per step."""
    import training.muon

    calls = []
    original = training.muon.newton_schulz
    monkeypatch.setattr(
        training.muon, "newton_schulz", lambda g, steps: calls.append((tuple(g.shape), steps)) or original(g, steps)
    )
    model = _tiny_gpt()
    optimizer = make_optimizer(model, OptimConfig(optimizer="muon", muon_ns_steps=3), CPU)
    _, loss = model(torch.randint(65, (2, 16)), torch.randint(65, (2, 16)))
    loss.backward()
    optimizer.step()
    # two layers: c_attn (96x32), attn c_proj (32x32), c_fc (128x32), mlp c_proj (32x128), each a stack of 2
    assert sorted(calls) == sorted([((2, 96, 32), 3), ((2, 32, 32), 3), ((2, 128, 32), 3), ((2, 32, 128), 3)])


def test_every_group_gets_its_step_hyperparameters_from_the_iteration() -> None:
    train = OptimConfig(optimizer="muon", learning_rate=1e-3, muon_lr=0.02, warmup_iters=10, max_iters=1000)
    optimizer = make_optimizer(_tiny_gpt(), train, CPU)
    *adamw, muon = optimizer.param_groups
    for step, momentum in ((0, 0.85), (150, 0.90), (300, 0.95), (900, 0.95)):  # muon_momentum_warmup=300
        lr = set_hyperparameters(optimizer, train, step)
        assert lr == lr_at(step, 1e-3, train.min_lr, 10, 1000) == adamw[0]["lr"] == adamw[1]["lr"]
        assert muon["lr"] == pytest.approx(20 * lr) and muon["momentum"] == pytest.approx(momentum)
    train.muon_momentum_warmup = 0
    set_hyperparameters(optimizer, train, 0)
    assert muon["momentum"] == 0.95


def test_named_state_round_trips_and_loading_it_leaves_the_weights_alone() -> None:
    """set_optimizer_state_dict initialises an optimizer without state by a step with zero gradients at lr 0."""
    train = OptimConfig(optimizer="muon")
    trained = _tiny_gpt()
    optimizer = make_optimizer(trained, train, CPU)
    for _ in range(2):
        trained(torch.randint(65, (2, 16)), torch.randint(65, (2, 16)))[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = get_optimizer_state_dict(trained, optimizer)

    fresh = _tiny_gpt()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    loaded = make_optimizer(fresh, train, CPU)
    set_optimizer_state_dict(fresh, loaded, state)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    again = get_optimizer_state_dict(fresh, loaded)
    assert again["state"].keys() == state["state"].keys()
    for name, values in state["state"].items():
        assert all(torch.equal(values[k], again["state"][name][k]) for k in values)
