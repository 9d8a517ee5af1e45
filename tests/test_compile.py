"""torch.compile with inductor on CPU: one graph (fullgraph) that computes what eager computes and doesn't recompile,
and a compiled decode step that draws eager's tokens. DDP + compile: tests/test_distributed.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import MODERN
from model import GPT, GPTConfig

SHAPE = dict(vocab_size=65, vocab_multiple=64, block_size=64, n_layer=2, n_head=2, n_embd=32)  # train.py's padding
# GPT-2's block, with rotary positions, a sliding window in its first layer (the blocked SDPA path off CUDA) and a full
# second one, which the compiled DDP run (tests/test_distributed.py) trains too. Every modern option then takes three
# more steps with train.activation_checkpointing (one more graph, against plain eager): value_residual's first-layer
# values cross the recomputed blocks as an argument and a return, and fullgraph proves nothing breaks.
MODELS = {"gpt2_windowed": dict(attn_window=16, window_pattern="SL", pos_emb="rope"), "every_modern_option": MODERN}


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views of one (4, 65) block, as training's batches are: their strides are part of the graph."""
    block = torch.randint(65, (4, 65), generator=torch.Generator().manual_seed(seed))
    return block[:, :-1], block[:, 1:]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inductor_compiles_one_graph_that_trains_and_evaluates_like_eager(name: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = GPT(GPTConfig(**SHAPE, **MODELS[name])).train()
    with torch.no_grad():  # zero-initialised parts would leave gradients exactly 0 on both sides
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    plain = copy.deepcopy(eager)
    compiled = torch.compile(plain, fullgraph=True)  # inductor: fullgraph fails on any graph break
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, plain)]
    phases = (False, True) if name == "every_modern_option" else (False,)
    for graphs, recompute in enumerate(phases, start=1):
        plain.activation_checkpointing = recompute
        for step in range(3):
            idx, targets = _batch(step)
            losses = []
            for model in (eager, compiled):
                _, loss = model(idx, targets)
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
            for (n, a), b in zip(eager.named_parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=n)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        assert _graphs() == graphs  # three training steps, new weights each time: no recompilation

    eager.eval()
    plain.eval()
    idx, _ = _batch(3)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(idx)[0], eager(idx)[0], rtol=1e-4, atol=1e-5)
    assert _graphs() == len(phases) + 1  # evaluation: one more graph, then reused


def test_generation_with_a_compiled_decode_step_gives_the_eager_tokens() -> None:
    """The KV-cache step (GPT.prefill) under inductor with dynamic shapes, as docs/gpu.md measured it: the cache's
    length grows every token, so the graphs take it as a size, not a constant (one for the empty cache, one after)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=1, n_head=2, n_embd=16, attn_window=8)).eval()
    prompt = torch.randint(65, (2, 3), generator=torch.Generator().manual_seed(1))
    eager = model.generate(prompt, max_new_tokens=20, temperature=0)
    model.prefill = torch.compile(model.prefill, dynamic=True)  # the instance's: generate_tokens calls self.prefill
    assert torch.equal(model.generate(prompt, max_new_tokens=20, temperature=0), eager)
    assert 1 <= _graphs() <= 3  # compiled, and not a graph per token
