"""train.activation_checkpointing: each block keeps only its input for backward and recomputes the rest there.
The numbers are the same as without it (and resume exactly: test_crash_safety); what changes is the memory."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import model.gpt as gpt_module
from conftest import MODERN
from model import GPT, GPTConfig


def _saved_bytes(model: GPT, idx: torch.Tensor) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """The bytes forward keeps for backward (a checkpointed block drops its own), the loss, and the gradients."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    model.zero_grad(set_to_none=True)
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        _, loss = model(idx, idx.roll(-1, dims=1))
    loss.backward()
    return saved, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointed_blocks_give_the_same_loss_and_gradients_keep_far_less_and_only_in_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every modern option (value_residual's first-layer values cross blocks) and dropout (its draws are
    replayed): the same loss and gradients bit for bit, a fraction of the activations kept. In eval mode or without
    gradients (evaluation, generation) blocks run plainly: nothing to recompute."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=256, n_layer=6, n_head=4, n_embd=64, dropout=0.1, **MODERN)
    model = GPT(config).train()
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised parts would leave some gradients exactly 0
            p.add_(torch.randn_like(p) * 0.02)
    idx = torch.randint(50, (4, 256))
    torch.manual_seed(1)
    plain = _saved_bytes(model, idx)
    model.activation_checkpointing = True
    torch.manual_seed(1)
    recomputed = _saved_bytes(model, idx)
    assert torch.equal(plain[1], recomputed[1])
    assert all(torch.equal(plain[2][n], recomputed[2][n]) for n in plain[2])
    assert recomputed[0] < 0.2 * plain[0], (recomputed[0], plain[0])

    calls = []
    original = gpt_module.checkpoint
    monkeypatch.setattr(gpt_module, "checkpoint", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    with torch.no_grad():
        model(idx[:, :16])
    model.eval()(idx[:, :16])
    assert calls == []
    model.train()(idx[:, :16], idx[:, :16])
    assert len(calls) == config.n_layer
