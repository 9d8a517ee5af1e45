"""GPTConfig's modern options (RMSNorm, QK-norm, a logit soft-cap, the x0 and value shortcuts, the bigram table):
what each does, and that every combination keeps the model's guarantees (flash = math, cache = recompute,
causality, bit-exact resume)."""

from __future__ import annotations

import dataclasses
import math
import signal
from pathlib import Path

import pytest
import torch

from analysis.causality import check_causality
from common.errors import ConfigError
from conftest import MODERN, assert_same_logits_and_gradients, compose_config, tiny_run_overrides
from model import GPT, GPTConfig
from model.attention import KVCache
from model.gpt import BIGRAM_ROWS, CKPT_NAME, load_checkpoint
from model.hf_gpt2 import PretrainedError, hf_from_gpt
from training.run import train

SMALL = dict(vocab_size=50, block_size=16, n_layer=3, n_head=4, n_embd=32)
EACH = [
    {"norm": "rmsnorm"},
    {"qk_norm": True},
    {"logit_softcap": 2.0},
    {"x0_mix": True},
    {"value_residual": True},
    {"bigram_embed": True},
    MODERN,
]


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


@pytest.mark.parametrize("options", EACH, ids=lambda o: "modern" if o is MODERN else next(iter(o)))
def test_flash_and_math_agree_on_logits_and_gradients(options: dict) -> None:
    flash = _model(**options, attn_impl="flash").train()
    math_ = _twin(flash, attn_impl="math").train()
    idx = torch.randint(SMALL["vocab_size"], (2, SMALL["block_size"]))
    assert_same_logits_and_gradients((flash, math_), idx, idx)


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
@pytest.mark.parametrize("options", EACH, ids=lambda o: "modern" if o is MODERN else next(iter(o)))
def test_cached_logits_equal_one_pass_and_greedy_tokens_equal_recomputation(options: dict, attn_impl: str) -> None:
    model = _model(**options, attn_impl=attn_impl)
    idx = torch.randint(SMALL["vocab_size"], (2, SMALL["block_size"]))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config)
        prefill, _ = model(idx[:, :5], cache=cache)
        torch.testing.assert_close(prefill, full[:, :5], atol=1e-5, rtol=0)
        for t in range(5, SMALL["block_size"]):
            step, _ = model(idx[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=0)
    new = 2 * SMALL["block_size"]  # past block_size: the cache gives way to recomputing the cropped window
    assert torch.equal(
        model.generate(idx[:1, :3], new, top_k=1), model.generate(idx[:1, :3], new, top_k=1, use_cache=False)
    )


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
def test_a_rolling_model_with_every_option_caches_exactly_past_block_size(attn_impl: str) -> None:
    """Every layer windowed: the cache rolls, and the bigram of its first new token comes from the cache."""
    model = _model(**MODERN, attn_impl=attn_impl, attn_window=4, window_pattern="SSS")
    assert model.config.rolls
    idx = torch.randint(SMALL["vocab_size"], (2, 3 * SMALL["block_size"]))
    with torch.no_grad():
        full, _ = _twin(model, attn_impl="math")(idx)
        cache = KVCache(model.config)
        model(idx[:, :7], cache=cache)
        for t in range(7, idx.size(1)):
            step, _ = model(idx[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=0)
    prompt = idx[:1, :3]
    assert torch.equal(model.generate(prompt, 50, top_k=1), model.generate(prompt, 50, top_k=1, use_cache=False))


def test_the_bigram_widens_the_receptive_field_by_one_token_and_the_mask_still_holds() -> None:
    model = _model(**MODERN, attn_window=3, window_pattern="SSS")
    assert model.config.receptive_field == 1 + 3 * 2 + 1
    report = check_causality(model, torch.randint(SMALL["vocab_size"], (30,)).tolist(), position=10)
    assert report.mask_held and report.information_flows  # positions 10..17 change, none other
    changed = (report.changes["flash"] > 0).nonzero().flatten().tolist()
    assert changed == list(range(10, 18))


def test_bigram_rows_are_exact_for_a_small_vocabulary_and_hashed_for_a_large_one() -> None:
    assert GPTConfig(**{**SMALL, "vocab_size": 65}).bigram_rows == 65 * 66
    assert GPTConfig(**{**SMALL, "vocab_size": 50257}).bigram_rows == BIGRAM_ROWS
    model = _model(bigram_embed=True)
    table = model.transformer.bigram.table.weight
    idx = torch.tensor([[3, 7, 7]])
    v = SMALL["vocab_size"]
    rows = [v * v + 3, 3 * v + 7, 7 * v + 7]  # the first token has no token before it: its own row
    torch.testing.assert_close(model.transformer.bigram(idx, None), table[rows].unsqueeze(0))
    previous = torch.tensor([[9]])  # from a KV cache: the token run before
    torch.testing.assert_close(model.transformer.bigram(idx, previous)[0, 0], table[9 * v + 3])


@pytest.mark.parametrize(
    ("option", "neutral"),
    [
        ("x0_mix", lambda m: [b.x0_mix.data.copy_(torch.tensor([1.0, 0.0])) for b in m.transformer.h]),
        (
            "value_residual",
            lambda m: [b.attn.value_mix.data.copy_(torch.tensor([1.0, 0.0])) for b in m.transformer.h[1:]],
        ),
        ("bigram_embed", lambda m: m.transformer.bigram.table.weight.data.zero_()),
    ],
)
def test_each_shortcut_at_its_neutral_setting_is_the_plain_model(option: str, neutral: object) -> None:
    """The shortcuts only add paths: set to pass nothing, the model computes what the plain GPT does."""
    plain = _model()
    extended = GPT(dataclasses.replace(plain.config, **{option: True})).eval()
    missing, unexpected = extended.load_state_dict(plain.state_dict(), strict=False)
    assert missing and not unexpected  # the option's own parameters
    neutral(extended)
    idx = torch.randint(SMALL["vocab_size"], (2, SMALL["block_size"]))
    with torch.no_grad():
        torch.testing.assert_close(extended(idx)[0], plain(idx)[0], atol=1e-6, rtol=0)


def test_the_mixes_start_as_documented() -> None:
    model = GPT(GPTConfig(**SMALL, x0_mix=True, value_residual=True))
    assert all(b.x0_mix.tolist() == [1.0, 0.0] for b in model.transformer.h)
    assert model.transformer.h[0].attn.value_mix is None  # the first layer's values are the ones mixed in
    assert all(b.attn.value_mix.tolist() == [0.5, 0.5] for b in model.transformer.h[1:])


def test_qk_norm_makes_the_scores_blind_to_the_scale_of_queries_and_keys() -> None:
    for qk_norm, should_change in ((True, False), (False, True)):
        model = _model(qk_norm=qk_norm)
        scaled = _twin(model)
        n = SMALL["n_embd"]
        with torch.no_grad():
            for block in scaled.transformer.h:
                block.attn.c_attn.weight[: 2 * n] *= 10  # the query and key rows
                block.attn.c_attn.bias[: 2 * n] *= 10
        idx = torch.randint(SMALL["vocab_size"], (1, SMALL["block_size"]))
        with torch.no_grad():
            changed = not torch.allclose(model(idx)[0], scaled(idx)[0], atol=1e-4)
        assert changed == should_change


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


def test_rmsnorm_replaces_every_layernorm() -> None:
    model = GPT(GPTConfig(**SMALL, norm="rmsnorm"))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm | torch.nn.LayerNorm)]
    assert len(norms) == 2 * SMALL["n_layer"] + 1 and all(isinstance(m, torch.nn.RMSNorm) for m in norms)


def test_parameter_count_leaves_out_the_tables_that_are_only_looked_up() -> None:
    plain, modern = GPT(GPTConfig(**SMALL)), GPT(GPTConfig(**SMALL, **MODERN))
    v, n, L = SMALL["vocab_size"], SMALL["n_embd"], SMALL["n_layer"]
    lookups = v * (v + 1) * n  # the bigram table
    scalars = 2 * L + 2 * (L - 1)  # x0 and value mixes
    assert modern.num_params(non_embedding=False) - modern.num_params() == lookups
    # the same matrices as GPT-2's plain model, no biases in norms and no positions
    assert modern.num_params() == plain.num_params() - plain.transformer.h[0].ln_1.bias.numel() * (2 * L + 1) + scalars


@pytest.mark.parametrize("option", [o for o in EACH if o is not MODERN])
def test_export_refuses_what_gpt2_cant_express_naming_the_option(option: dict) -> None:
    (name, value), *_ = option.items()
    with pytest.raises(PretrainedError, match=f"{name}={value!r} can't be exported"):
        hf_from_gpt(GPT(GPTConfig(**SMALL, **option)))


@pytest.mark.parametrize(
    ("options", "message"),
    [({"norm": "batchnorm"}, "norm=batchnorm"), ({"logit_softcap": 0.0}, "logit_softcap=0.0")],
)
def test_bad_option_values_are_one_line_errors(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**SMALL, **options)


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
