import math

import pytest
import torch

from conftest import assert_same_logits_and_gradients
from model import GPT, GPTConfig
from model.shortcuts import Shortcuts

SMALL = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _pair(**overrides: object) -> tuple[GPT, GPT]:
    """The same random weights behind the flash and the math path."""
    torch.manual_seed(0)
    flash = GPT(GPTConfig(**{**SMALL, **overrides, "attn_impl": "flash"}))
    math_ = GPT(GPTConfig(**{**SMALL, **overrides, "attn_impl": "math"}))
    math_.load_state_dict(flash.state_dict())
    return flash, math_


@pytest.mark.parametrize("options", [{}, {"activation": "gelu_tanh"}, {"activation": "relu2"}, {"pos_emb": "rope"}])
def test_flash_and_math_paths_agree_on_logits_and_gradients(options: dict) -> None:
    flash, math_ = _pair(**options)
    idx = torch.randint(SMALL["vocab_size"], (3, SMALL["block_size"]))
    targets = torch.randint(SMALL["vocab_size"], (3, SMALL["block_size"]))
    assert_same_logits_and_gradients((flash, math_), idx, targets)


@pytest.mark.parametrize("options", [{}, {"activation": "gelu_tanh"}, {"activation": "relu2"}, {"pos_emb": "rope"}])
@pytest.mark.parametrize("attn_impl", ["flash", "math"])
def test_changing_a_token_never_changes_earlier_logits(attn_impl: str, options: dict) -> None:
    torch.manual_seed(1)
    model = GPT(GPTConfig(**SMALL, attn_impl=attn_impl, **options)).eval()
    idx = torch.randint(SMALL["vocab_size"], (1, SMALL["block_size"]))
    t = 7
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % SMALL["vocab_size"]
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    assert torch.equal(before[0, :t], after[0, :t])
    per_position_change = (before[0, t:] - after[0, t:]).abs().amax(dim=-1)
    assert bool((per_position_change > 0).all())


def test_loss_is_mean_cross_entropy_and_none_without_targets() -> None:
    model, _ = _pair()
    idx = torch.randint(SMALL["vocab_size"], (2, 8))
    logits, loss = model(idx)
    assert logits.shape == (2, 8, SMALL["vocab_size"]) and loss is None
    logits, loss = model(idx, idx)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, SMALL["vocab_size"]), idx.reshape(-1))
    torch.testing.assert_close(loss, expected)
    # At initialisation the prediction is close to uniform.
    assert abs(loss.item() - math.log(SMALL["vocab_size"])) < 0.5


def test_gpt2_initialisation_tying_and_parameter_count() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=500, block_size=64, n_layer=8, n_head=4, n_embd=64)
    model = GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    residual = model.transformer.h[0].attn.c_proj.weight
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.1)
    assert model.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    per_block = 12 * 64 * 64 + 13 * 64  # qkv, proj, mlp weights + biases and two LayerNorms
    assert model.num_params() == 500 * 64 + 8 * per_block + 2 * 64
    assert model.num_params(non_embedding=False) == model.num_params() + 64 * 64


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"attn_impl": "fast"}, "attn_impl"),
        ({"n_layer": 0}, "n_layer"),
        ({"activation": "swish"}, "activation"),
        ({"pos_emb": "alibi"}, "pos_emb"),
        ({"pos_emb": "rope", "n_embd": 36, "n_head": 4}, "even head size"),
    ],
)
def test_impossible_configs_raise_value_error_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**SMALL, **overrides})


def test_sequence_longer_than_block_size_is_refused() -> None:
    model, _ = _pair()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, SMALL["block_size"] + 1, dtype=torch.long))


def test_generate_crops_the_context_and_is_seeded() -> None:
    model, _ = _pair()
    idx = torch.zeros(2, 3, dtype=torch.long)
    torch.manual_seed(5)
    out = model.generate(idx, max_new_tokens=2 * SMALL["block_size"], temperature=0.9, top_k=5)
    assert out.shape == (2, 3 + 2 * SMALL["block_size"])
    assert torch.equal(out[:, :3], idx)
    torch.manual_seed(5)
    assert torch.equal(out, model.generate(idx, max_new_tokens=2 * SMALL["block_size"], temperature=0.9, top_k=5))


def test_relu2_is_relu_squared() -> None:
    from model.gpt import MLP

    torch.manual_seed(0)
    mlp = MLP(GPTConfig(**SMALL, activation="relu2"))
    x = torch.randn(2, 3, SMALL["n_embd"])
    torch.testing.assert_close(mlp(x), mlp.c_proj(torch.relu(mlp.c_fc(x)) ** 2))


def test_rope_replaces_the_position_table_and_scores_depend_on_relative_positions() -> None:
    from model.rotary import Rotary

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, pos_emb="rope"))
    assert model.transformer.wpe is None and not any("wpe" in k or "rotary" in k for k in model.state_dict())
    assert model.num_params() == model.num_params(non_embedding=False)
    rotary = Rotary(head_dim=8, max_positions=32)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> torch.Tensor:
        return (rotary(q, i) * rotary(k, j)).sum()

    torch.testing.assert_close(score(3, 1), score(13, 11))  # same distance, same score
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_top_k_one_is_greedy() -> None:
    model, _ = _pair()
    idx = torch.tensor([[1, 2, 3]])
    out = model.generate(idx, max_new_tokens=1, top_k=1)
    logits, _ = model(idx)
    assert out[0, -1].item() == logits[0, -1].argmax().item()


@pytest.mark.parametrize("options", [{}, {"activation": "gelu_tanh"}, {"activation": "relu2"}, {"pos_emb": "rope"}])
@pytest.mark.parametrize("attn_impl", ["flash", "math"])
def test_tiny_model_overfits_one_batch(attn_impl: str, options: dict) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, attn_impl=attn_impl, **options))
    idx = torch.randint(SMALL["vocab_size"], (4, SMALL["block_size"] + 1))
    x, y = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1


def test_attention_weights_come_out_beside_the_main_path_and_leave_it_as_it_was() -> None:
    flash, math_ = _pair()
    idx = torch.randint(SMALL["vocab_size"], (2, 10))
    before, _ = flash(idx)
    weights = flash.attention_weights(idx)  # through the math path of the same weights
    assert weights.shape == (SMALL["n_layer"], 2, SMALL["n_head"], 10, 10)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5, rtol=0)
    assert torch.equal(weights, math_.attention_weights(idx))
    assert all(block.attn.captured is None for block in flash.transformer.h)
    assert torch.equal(flash(idx)[0], before)
    x = torch.zeros(1, 3, SMALL["n_embd"])
    shortcuts = Shortcuts(x0=x, idx=torch.zeros(1, 3, dtype=torch.long))
    out, values = flash.transformer.h[0](x, shortcuts)
    assert out.shape == x.shape and values is None  # the weights leave through `captured`, never the return
