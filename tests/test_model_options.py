"""GPTConfig's modern options: what each does, and that every combination keeps the model's guarantees (flash = math,
cache = recompute, causality, bit-exact resume)."""

from __future__ import annotations

import dataclasses
import math
import signal
from pathlib import Path

import pytest
import torch

from analysis.causality import check_causality
from common.files import CKPT_NAME
from conftest import MODERN, assert_same_logits_and_gradients, compose_config, tiny_run_overrides
from model import GPT, GPTConfig
from model.attention import KVCache
from model.checkpoint import load_checkpoint
from model.gpt import BIGRAM_ROWS, BigramEmbedding
from model.hf_gpt2 import PretrainedError, hf_from_gpt
from train import train

SMALL = dict(vocab_size=50, block_size=16, n_layer=3, n_head=4, n_embd=32)
# Each option alone, then all at once; attn_window=4 alone is SSL: its last layer full, so a cache can't roll.
EACH = [{"norm": "rmsnorm"}, {"qk_norm": True}, {"logit_softcap": 2.0}, {"x0_mix": True}, {"value_residual": True},
        {"bigram_embed": True}, {"attn_window": 4}, MODERN]


def _model(seed: int = 0, **options: object) -> GPT:
    """Random weights everywhere, zero-initialised ones and the mixes included, so no path hides behind a zero."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SMALL, **options}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _twin(model: GPT, **changes: object) -> GPT:
    twin = GPT(dataclasses.replace(model.config, **changes)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
@pytest.mark.parametrize("options", [{}, {"pos_emb": "rope"}, *EACH],
                         ids=lambda o: "modern" if o is MODERN else next(iter(o), "plain"))
def test_flash_equals_math_and_cached_logits_equal_one_pass_and_greedy_tokens_equal_recomputation(
    options: dict, attn_impl: str
) -> None:
    model = _model(**options, attn_impl=attn_impl)
    idx = torch.randint(SMALL["vocab_size"], (2, SMALL["block_size"] + 5))
    if attn_impl == "flash":  # training: the same logits and gradients on both paths
        twins = (_twin(model).train(), _twin(model, attn_impl="math").train())
        assert_same_logits_and_gradients(twins, idx[:, : SMALL["block_size"]], idx[:, 1 : SMALL["block_size"] + 1])
    with torch.no_grad():
        full, _ = model(idx[:, : SMALL["block_size"]])
        cache = KVCache(model.config)
        prefill, _ = model(idx[:, :5], cache=cache)
        torch.testing.assert_close(prefill, full[:, :5], atol=1e-5, rtol=0)
        for t in range(5, SMALL["block_size"]):
            step, _ = model(idx[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="block_size"):  # a full cache refuses to grow
            model(idx[:, :1], cache=cache)
    # Past block_size the cache gives way to recomputing the cropped window; a longer prompt is cropped either way.
    for prompt in (idx[:1, :3], idx[:1]):
        new = 2 * SMALL["block_size"]
        assert torch.equal(model.generate(prompt, new, top_k=1), model.generate(prompt, new, top_k=1, use_cache=False))


def test_the_bigram_widens_the_receptive_field_by_one_token_and_the_mask_still_holds() -> None:
    model = _model(**MODERN, attn_window=3, window_pattern="SSS")
    assert model.config.receptive_field == 1 + 3 * 2 + 1
    report = check_causality(model, torch.randint(SMALL["vocab_size"], (30,)).tolist(), position=10)
    assert report.mask_held and report.information_flows
    assert (report.changes["flash"] > 0).nonzero().flatten().tolist() == list(range(10, 18))  # and none other


def test_bigram_rows_are_exact_for_a_small_vocabulary_and_hashed_for_a_large_one() -> None:
    rows = [BigramEmbedding(GPTConfig(**{**SMALL, "vocab_size": v})).table.num_embeddings for v in (65, 50257)]
    assert rows == [65 * 66, BIGRAM_ROWS]
    model = _model(bigram_embed=True)
    table = model.transformer.bigram.table.weight
    idx = torch.tensor([[3, 7, 7]])
    v = SMALL["vocab_size"]
    rows = [v * v + 3, 3 * v + 7, 7 * v + 7]  # the first token has no token before it: its own row
    torch.testing.assert_close(model.transformer.bigram(idx, None), table[rows].unsqueeze(0))
    previous = torch.tensor([[9]])  # from a KV cache: the token run before
    torch.testing.assert_close(model.transformer.bigram(idx, previous)[0, 0], table[9 * v + 3])


NEUTRAL = {  # each shortcut set to pass nothing on
    "x0_mix": lambda m: [b.x0_mix.data.copy_(torch.tensor([1.0, 0.0])) for b in m.transformer.h],
    "value_residual": lambda m: [b.attn.value_mix.data.copy_(torch.tensor([1.0, 0.0])) for b in m.transformer.h[1:]],
    "bigram_embed": lambda m: m.transformer.bigram.table.weight.data.zero_(),
}


@pytest.mark.parametrize("option", NEUTRAL)
def test_each_shortcut_at_its_neutral_setting_is_the_plain_model(option: str) -> None:
    """The shortcuts only add paths: set to pass nothing, the model computes what the plain GPT does."""
    plain = _model()
    extended = GPT(dataclasses.replace(plain.config, **{option: True})).eval()
    missing, unexpected = extended.load_state_dict(plain.state_dict(), strict=False)
    assert missing and not unexpected  # the option's own parameters
    NEUTRAL[option](extended)
    idx = torch.randint(SMALL["vocab_size"], (2, SMALL["block_size"]))
    with torch.no_grad():
        torch.testing.assert_close(extended(idx)[0], plain(idx)[0], atol=1e-6, rtol=0)


def test_qk_norm_makes_the_scores_blind_to_the_scale_of_queries_and_keys() -> None:
    idx = torch.randint(SMALL["vocab_size"], (1, SMALL["block_size"]))
    for qk_norm in (True, False):
        model = _model(qk_norm=qk_norm)
        scaled = _twin(model)
        with torch.no_grad():
            for block in scaled.transformer.h:
                block.attn.c_attn.weight[: 2 * SMALL["n_embd"]] *= 10  # the query and key rows
                block.attn.c_attn.bias[: 2 * SMALL["n_embd"]] *= 10
            assert torch.allclose(model(idx)[0], scaled(idx)[0], atol=1e-4) == qk_norm


def test_the_soft_cap_bounds_every_logit_and_leaves_small_ones_nearly_as_they_were() -> None:
    model = _model(logit_softcap=2.0)
    uncapped = _twin(model, logit_softcap=None)
    idx = torch.randint(SMALL["vocab_size"], (1, 8))
    with torch.no_grad():
        capped, plain = model(idx)[0], uncapped(idx)[0]
        torch.testing.assert_close(capped, 2.0 * torch.tanh(plain / 2.0))
        small = plain.abs() < 0.3  # 2 tanh(x / 2) = x - x³/12 + ...: within 0.0023 of x there
        assert small.any() and torch.allclose(capped[small], plain[small], atol=0.003)
        model.lm_head.weight.mul_(1000)
        huge = model(idx)[0]
    assert 1.9 < float(huge.abs().max()) <= 2.0  # saturated at the cap


def test_the_modern_model_starts_as_documented_and_counts_only_the_parameters_it_multiplies() -> None:
    """RMSNorm everywhere; the mixes pass the stream and the first layer's values through half and half; the bigram
    table, only looked up, is left out of the count."""
    plain, modern = GPT(GPTConfig(**SMALL)), GPT(GPTConfig(**SMALL, **MODERN))
    norms = [m for m in modern.modules() if isinstance(m, torch.nn.RMSNorm | torch.nn.LayerNorm)]
    assert len(norms) == 2 * SMALL["n_layer"] + 1 and all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    assert all(b.x0_mix.tolist() == [1.0, 0.0] for b in modern.transformer.h)
    assert modern.transformer.h[0].attn.value_mix is None  # the first layer's values are the ones mixed in
    assert all(b.attn.value_mix.tolist() == [0.5, 0.5] for b in modern.transformer.h[1:])
    v, n, L = SMALL["vocab_size"], SMALL["n_embd"], SMALL["n_layer"]
    assert modern.num_params(non_embedding=False) - modern.num_params() == v * (v + 1) * n  # the bigram table
    scalars = 2 * L + 2 * (L - 1)  # x0 and value mixes
    # the same matrices as GPT-2's plain model, no biases in norms and no positions
    assert modern.num_params() == plain.num_params() - plain.transformer.h[0].ln_1.bias.numel() * (2 * L + 1) + scalars


@pytest.mark.parametrize("option", [o for o in EACH if o is not MODERN])
def test_export_refuses_what_gpt2_cant_express_naming_the_option(option: dict) -> None:
    (name, value), *_ = option.items()
    with pytest.raises(PretrainedError, match=f"{name}={value!r} can't be exported"):
        hf_from_gpt(GPT(GPTConfig(**SMALL, **option)))


def test_a_run_with_every_option_stops_and_resumes_bit_for_bit(tmp_path: Path, corpus_path: Path) -> None:
    """The options' parameters, through the optimizer and the checkpoint: interrupted and resumed, the run ends
    with the uninterrupted run's weights."""
    run = {f"model.{k}": v for k, v in MODERN.items()} | {
        "model.vocab_multiple": 64,  # a padded token table too
        "train.max_iters": 12,
        "train.eval_interval": 6,
        "train.learning_rate": 1e-2,
    }

    def stop_at_5(it: int) -> None:
        if it == 5:
            signal.raise_signal(signal.SIGTERM)

    whole = train(compose_config(tiny_run_overrides(tmp_path / "a", corpus_path, **run)))
    saved = load_checkpoint(tmp_path / "a" / "run" / CKPT_NAME)
    vocab = saved.model_config.vocab_size
    assert saved.model["lm_head.weight"].size(0) == 64 * math.ceil(vocab / 64) > vocab
    assert whole.val_loss < math.log(vocab) - 0.3  # it learns (it starts near ln(vocab), the uniform guess)
    stopped = train(compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, **run)), before_step=stop_at_5)
    assert stopped.stopped_by == "SIGTERM" and stopped.iters == 6
    train(compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, resume=True, **run)))
    a = load_checkpoint(tmp_path / "a" / "run" / CKPT_NAME).model
    b = load_checkpoint(tmp_path / "b" / "run" / CKPT_NAME).model
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
