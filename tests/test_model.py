import math
from pathlib import Path

import pytest
import torch

from common.errors import CheckpointError
from model import GPT, GPTConfig
from model.attention import Rotary
from model.checkpoint import Checkpoint, load_checkpoint
from model.gpt import Decoding
from model.hf_gpt2 import hf_from_gpt

SMALL = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _pair(**overrides: object) -> tuple[GPT, GPT]:
    """The same random weights behind the flash and the math path."""
    torch.manual_seed(0)
    flash = GPT(GPTConfig(**{**SMALL, **overrides, "attn_impl": "flash"}))
    math_ = GPT(GPTConfig(**{**SMALL, **overrides, "attn_impl": "math"}))
    math_.load_state_dict(flash.state_dict())
    return flash, math_


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
    # Exact far past the table too: a rolling cache rotates keys at their absolute position, a recompute from 0.
    for far in (1_000, 100_000):
        torch.testing.assert_close(score(far + 3, far + 1), score(3, 1), atol=1e-5, rtol=0)
    x = torch.randn(1, 1, 4, 8)
    torch.testing.assert_close(rotary(x, 30)[..., :2, :], rotary(x[..., :2, :], 30))  # off the table = on it


@pytest.mark.parametrize("options", [{}, {"activation": "gelu_tanh"}, {"activation": "relu2"}, {"pos_emb": "rope"}])
def test_tiny_model_overfits_one_batch(options: dict) -> None:
    """On one path: the other computes the same gradients (test_model_options)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, **options))
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
    out, values = flash.transformer.h[0](x, x)
    assert out.shape == x.shape and values is None  # the weights leave through `captured`, never the return


GPT2_BPE = dict(vocab_size=50257, vocab_multiple=64, block_size=8, n_layer=1, n_head=2, n_embd=8)


def test_a_gpt2_bpe_table_has_50304_rows_and_the_padding_changes_no_weight_logit_or_loss() -> None:
    torch.manual_seed(0)
    padded = GPT(GPTConfig(**GPT2_BPE))
    assert padded.transformer.wte.weight.shape == padded.lm_head.weight.shape == (50304, 8)
    torch.manual_seed(0)  # the padded rows start at zero and draw nothing: every other weight is the unpadded one's
    unpadded = GPT(GPTConfig(**{**GPT2_BPE, "vocab_multiple": 1}))
    assert not padded.lm_head.weight[50257:].any()
    tables = ("transformer.wte.weight", "lm_head.weight")
    state = unpadded.state_dict()
    assert all(torch.equal(v[:50257] if k in tables else v, state[k]) for k, v in padded.state_dict().items())
    idx = torch.randint(50257, (2, 8))
    (logits, loss), (expected, expected_loss) = padded(idx, idx), unpadded(idx, idx)
    assert logits.shape == (2, 8, 50257)
    assert torch.equal(logits, expected) and torch.equal(loss, expected_loss)
    assert GPT(GPTConfig(**{**GPT2_BPE, "vocab_size": 65})).lm_head.weight.size(0) == 128


def test_a_padded_id_is_never_sampled_even_where_its_logit_is_the_largest() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT2_BPE)).eval()
    with torch.no_grad():  # every hidden state all ones, the padded rows' logits 8, the real ones' about 0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[50257:] = 1.0
        assert int(model.lm_head(model.hidden(torch.zeros(1, 1, dtype=torch.long)))[0, -1].argmax()) >= 50257
    prompt = torch.zeros(2, 1, dtype=torch.long)
    for decoding in (Decoding(temperature=0), Decoding(temperature=1.0), Decoding(temperature=5.0, top_p=0.99)):
        steps = torch.cat(list(model.generate_tokens(prompt, 10, decoding)), dim=1)
        assert int(steps.max()) < 50257


def test_the_export_and_its_tokenizer_see_the_real_vocabulary_not_the_padding() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT2_BPE)).eval()
    hf_model = hf_from_gpt(model)
    assert hf_model.config.vocab_size == 50257 and hf_model.transformer.wte.weight.shape == (50257, 8)
    idx = torch.randint(50257, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(idx).logits, model(idx)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("option", ["value_embeds", "untied_head", "zero_init_proj"])
def test_a_checkpoint_naming_a_removed_option_loads_when_its_weights_fit_and_is_refused_when_not(
    option: str, tmp_path: Path
) -> None:
    """zero_init_proj only changed the initial weights: its runs still load with it on."""
    model = GPT(GPTConfig(**SMALL))
    off, on = tmp_path / "off.pt", tmp_path / "on.pt"
    for path, value in ((off, False), (on, True)):
        raw = Checkpoint(model.config, model.state_dict(), {}).to_dict()
        torch.save(raw | {"model_config": raw["model_config"] | {option: value}}, path)
    assert load_checkpoint(off).model_config == model.config
    if option == "zero_init_proj":
        assert load_checkpoint(on).model_config == model.config
        return
    with pytest.raises(CheckpointError, match=f"trained with model.{option}, an option this version no longer has"):
        load_checkpoint(on)

