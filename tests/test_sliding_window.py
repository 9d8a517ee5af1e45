"""Sliding-window attention end to end: the band mask, its fused path, the rolling KV cache and the
receptive field that sample.py's causality check proves."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import model.attention
from analysis.attention_maps import save_attention_maps
from analysis.causality import check_causality, format_report
from common.errors import CheckpointError, ConfigError
from conftest import compose_config, run_in_process, tiny_run_overrides
from model import GPT, GPTConfig, causal_mask, masked_attention
from model.attention import (
    ROLL_SLACK,
    KVCache,
    Rotary,
    _cached_band_block_mask,
    flex_windowed_attention,
    windowed_attention,
)
from model.gpt import CKPT_NAME, load_checkpoint
from model.hf_gpt2 import PretrainedError, hf_from_gpt
from training.run import train

SMALL = dict(vocab_size=40, block_size=32, n_layer=3, n_head=2, n_embd=16)


def _model(attn_impl: str = "math", **overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, "attn_impl": attn_impl, **overrides})).eval()


def _twin(model: GPT, attn_impl: str) -> GPT:
    twin = GPT(replace(model.config, attn_impl=attn_impl)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def test_the_band_mask_lets_query_i_see_keys_i_minus_w_plus_1_to_i() -> None:
    band = causal_mask(5, 5, window=2)
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(band, expected)
    # Aligned to the last keys, as a KV-cache decode step sees them: query 6 of 7 sees keys 4..6.
    assert torch.equal(causal_mask(1, 7, window=3), torch.tensor([[0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(6, 6, window=6), causal_mask(6, 6))


@pytest.mark.parametrize("window", [1, 2, 63, 64, 65, 100, 150, 400])
def test_the_fused_path_equals_the_math_path_in_values_and_gradients(window: int) -> None:
    torch.manual_seed(window)
    T = 150  # several query blocks of 64 or of the window; 150 and 400 reach past T
    q, k, v = (torch.randn(2, 3, T, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fused = windowed_attention(q, k, v, window)
    grads = torch.autograd.grad(fused.square().sum(), (q, k, v))
    reference, _ = masked_attention(q, k, v, causal_mask(T, T, window=window))
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    torch.testing.assert_close(fused, reference)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_flex_attentions_block_mask_is_the_same_band() -> None:
    # CUDA runs FlexAttention compiled; here it runs eagerly (forward only on CPU), which checks the mask.
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 200, 16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": expected off CUDA
        flex = flex_windowed_attention(q, k, v, 37)
    reference, _ = masked_attention(q, k, v, causal_mask(200, 200, window=37))
    torch.testing.assert_close(flex, reference, atol=1e-5, rtol=1e-5)


def test_flex_attention_inside_a_compiled_model_builds_the_same_band() -> None:
    # Under torch.compile the block mask is traced into the graph; the eager backend runs that trace here.
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 130, 16) for _ in range(3))
    compiled = torch.compile(flex_windowed_attention, backend="eager", fullgraph=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = compiled(q, k, v, 37)
    reference, _ = masked_attention(q, k, v, causal_mask(130, 130, window=37))
    torch.testing.assert_close(flex, reference, atol=1e-5, rtol=1e-5)


def test_a_block_mask_made_while_sampling_can_serve_training() -> None:
    _cached_band_block_mask.cache_clear()
    with torch.inference_mode():  # as generate() runs
        block_mask = _cached_band_block_mask(96, 9, torch.device("cpu"))
    assert not block_mask.kv_num_blocks.is_inference() and not block_mask.kv_indices.is_inference()
    assert _cached_band_block_mask(96, 9, torch.device("cpu")) is block_mask


def test_the_fused_path_costs_keys_in_the_window_not_the_whole_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []
    sdpa = F.scaled_dot_product_attention

    def counting(q: torch.Tensor, k: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((q.size(-2), k.size(-2)))
        return sdpa(q, k, *args, **kwargs)

    monkeypatch.setattr(model.attention.F, "scaled_dot_product_attention", counting)
    q = torch.randn(1, 1, 1024, 8)
    windowed_attention(q, q, q, 64)
    assert sum(n_q for n_q, _ in seen) == 1024
    assert max(n_k for _, n_k in seen) <= 2 * 64  # a block of queries, its keys and the previous block's


@pytest.mark.parametrize(
    ("pattern", "n_layer", "expected"),
    [
        (None, 4, "SSSL"),
        (None, 1, "S"),
        ("SL", 5, "SLSLL"),
        ("SSL", 6, "SSLSSL"),
        ("SSSS", 4, "SSSS"),
        ("LS", 2, "LS"),
    ],
)
def test_window_pattern_is_tiled_with_the_last_layer_full_unless_written_out(
    pattern: str | None, n_layer: int, expected: str
) -> None:
    config = GPTConfig(**{**SMALL, "n_layer": n_layer}, attn_window=8, window_pattern=pattern)
    assert "".join("L" if w is None else "S" for w in config.layer_windows()) == expected
    assert set(config.layer_windows()) <= {8, None}


def test_what_rolls_and_how_far_a_token_reaches() -> None:
    assert GPTConfig(**SMALL).layer_windows() == [None, None, None]
    assert GPTConfig(**SMALL, window_pattern="SSS").layer_windows() == [None, None, None]  # no window: none
    assert GPTConfig(**SMALL, window_pattern="LL").layer_windows() == [None, None, None]
    assert GPTConfig(**SMALL).receptive_field is None
    everywhere = GPTConfig(**SMALL, attn_window=5, window_pattern="SSS", pos_emb="rope")
    assert everywhere.rolls and everywhere.receptive_field == 1 + 3 * 4
    assert not replace(everywhere, pos_emb="learned").rolls  # learned positions stop at block_size
    assert not GPTConfig(**SMALL, attn_window=5, pos_emb="rope").rolls  # its last layer is full
    assert not replace(everywhere, attn_window=33).rolls  # wider than block_size: reaches further than training
    assert GPTConfig(**SMALL, attn_window=5, pos_emb="rope").receptive_field is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(attn_window=0), "attn_window=0 must be >= 1"),
        (dict(attn_window=4, window_pattern="SXL"), "only hold the letters S"),
        (dict(attn_window=4, window_pattern="SSSS"), "more letters than n_layer=3"),
        (dict(attn_window=4, window_pattern="LL"), "windows no layer"),
    ],
)
def test_bad_window_settings_are_one_line_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**SMALL, **overrides)


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
@pytest.mark.parametrize("window", [1, 4, 70])
@pytest.mark.parametrize("prompt_length", [1, 9, 80])  # 80: more than a buffer of windows 1 and 4 has slots for
def test_cached_logits_equal_one_pass_over_the_sequence_across_the_window_and_past_block_size(
    attn_impl: str, window: int, prompt_length: int
) -> None:
    block_size = 80  # room for a window over one query block of 64
    rolling = _model(attn_impl, block_size=block_size, attn_window=window, window_pattern="SSS", pos_emb="rope")
    T = 3 * block_size  # a rolling model runs past block_size: positions are relative, every layer windowed
    idx = torch.randint(SMALL["vocab_size"], (2, T))
    with torch.no_grad():
        full, _ = _twin(rolling, "math")(idx)
        cache = KVCache(rolling.config)
        logits, _ = rolling(idx[:, :prompt_length], cache=cache)
        torch.testing.assert_close(logits, full[:, :prompt_length], atol=1e-5, rtol=0)
        for t in range(prompt_length, T):
            step, _ = rolling(idx[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=0)
    # Memory stays bounded: each layer's buffer is back to 2 (W - 1) + 64 slots (at most block_size), whatever
    # the prompt was.
    slots = min(block_size, 2 * (window - 1) + ROLL_SLACK)
    assert [layer.buffer.size(3) for layer in cache.layers] == [slots] * SMALL["n_layer"]


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
def test_cached_decoding_in_chunks_equals_one_pass(attn_impl: str) -> None:
    rolling = _model(attn_impl, attn_window=5, window_pattern="SSS", pos_emb="rope")
    sizes = [7, 3, 1, 12, 2, 40, 1, 1, 33, 80, 1]  # 80: more than the 32 slots (block_size) after a roll
    idx = torch.randint(SMALL["vocab_size"], (3, sum(sizes)))
    with torch.no_grad():
        full, _ = rolling(idx)
        cache, chunks, start = KVCache(rolling.config), [], 0
        for size in sizes:  # both paths take several new tokens after a cache (GPT.prefill's chunks)
            chunks.append(rolling(idx[:, start : start + size], cache=cache)[0])
            start += size
            if size == 80:
                assert cache.layers[0].buffer.size(3) == 4 + 80  # grown for the chunk: the window's 4 and it
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=0)
    assert cache.layers[0].buffer.size(3) == SMALL["block_size"]  # and back at the next roll


def test_a_rolling_models_long_prompt_runs_in_chunks_with_the_cache_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT.prefill: a prompt of any length, PREFILL_CHUNK tokens at a time, gives the one-pass prompt's
    next-token logits and the same greedy continuation, and no layer's cache grows past its window and a chunk
    (run at once, 100k characters on window_cpu's shape with 3 samples peaked at 3.6 GB; now 0.3 GB)."""
    import model.gpt as gpt_module

    rolling = _model("flash", attn_window=5, window_pattern="SSS", pos_emb="rope")
    prompt = torch.randint(SMALL["vocab_size"], (2, 150))
    with torch.no_grad():
        whole = rolling.logits(rolling.hidden(prompt)[:, -1])
    monkeypatch.setattr(gpt_module, "PREFILL_CHUNK", 16)
    cache = KVCache(rolling.config)
    with torch.no_grad():
        chunked = rolling.logits(rolling.prefill(prompt, cache)[:, -1])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    assert cache.length == 150 and all(layer.buffer.size(3) <= 4 + 16 + ROLL_SLACK for layer in cache.layers)
    chunked_tokens = rolling.generate(prompt, 20, temperature=0)
    monkeypatch.setattr(gpt_module, "PREFILL_CHUNK", 10_000)
    assert torch.equal(chunked_tokens, rolling.generate(prompt, 20, temperature=0))


def test_rotary_positions_stay_exact_far_past_the_table() -> None:
    rotary = Rotary(head_dim=16, max_positions=32)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i: int, j: int) -> torch.Tensor:
        return (rotary(q, i) * rotary(k, j)).sum()

    # A rolling cache rotates keys at their absolute position; a recompute starts again from 0.
    for far in (1_000, 100_000):
        torch.testing.assert_close(score(far + 3, far + 1), score(3, 1), atol=1e-5, rtol=0)
    x = torch.randn(1, 1, 4, 16)
    torch.testing.assert_close(rotary(x, 30)[..., :2, :], rotary(x[..., :2, :], 30))  # off the table = on it


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
def test_a_rolling_model_generates_past_block_size_one_token_a_step(
    attn_impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rolling = _model(attn_impl, attn_window=6, window_pattern="SSS", pos_emb="rope")
    prompt = torch.randint(SMALL["vocab_size"], (1, 5))
    new = 3 * SMALL["block_size"]
    recomputed = rolling.generate(prompt, new, top_k=1, use_cache=False)
    lengths: list[int] = []
    hidden = rolling.hidden

    def counting(idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        lengths.append(idx.size(1))
        return hidden(idx, cache)

    monkeypatch.setattr(rolling, "hidden", counting)
    cached = rolling.generate(prompt, new, top_k=1, use_cache=True)
    assert torch.equal(cached, recomputed) and cached.size(1) == 5 + new > SMALL["block_size"]
    assert lengths == [5] + [1] * (new - 1)  # the prompt once, then never a recompute


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_model_with_a_full_layer_still_recomputes_past_block_size(pos_emb: str) -> None:
    windowed = _model("flash", attn_window=5, pos_emb=pos_emb)  # SSL: the last layer sees the whole block
    prompt = torch.randint(SMALL["vocab_size"], (1, 3))
    new = 2 * SMALL["block_size"]
    cached = windowed.generate(prompt, new, top_k=1)
    assert torch.equal(cached, windowed.generate(prompt, new, top_k=1, use_cache=False))
    with pytest.raises(ValueError, match="exceeds block_size"):
        windowed(torch.zeros(1, SMALL["block_size"] + 1, dtype=torch.long))


def test_the_causality_check_shows_the_receptive_field_on_both_paths() -> None:
    windowed = _model("flash", attn_window=4, window_pattern="SSS", pos_emb="rope")
    ids = list(range(3, 33))
    report = check_causality(windowed, ids, position=10)
    assert report.receptive_field == 1 + 3 * 3 and report.last_reachable == 19
    for change in report.changes.values():
        assert torch.all(change[:10] == 0) and torch.all(change[20:] == 0)  # exactly, before and past the field
        assert torch.all(change[10:20] > 0)
    assert report.mask_held and report.information_flows
    verdict = format_report(report, [str(i) for i in ids], "x").splitlines()[-1]
    assert verdict == (
        "mask held: positions 0-9 and 20-29 are unchanged on flash and math, "
        "expected positions 10-19 (receptive field: 10 tokens) to change, found 10-19 changed"
    )


def test_the_causality_check_catches_a_window_that_is_silently_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    windowed = _model("flash", attn_window=4, window_pattern="SSS", pos_emb="rope")
    band = model.attention.causal_mask

    def ignoring_the_window(n_queries: int, n_keys: int, device: object = None, window: int | None = None):
        return band(n_queries, n_keys, device)

    monkeypatch.setattr(model.attention, "causal_mask", ignoring_the_window)
    monkeypatch.setattr(
        model.attention,
        "windowed_attention",
        lambda q, k, v, window, dropout_p=0.0: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )
    report = check_causality(windowed, list(range(3, 33)), position=10)
    assert not report.mask_held
    verdict = format_report(report, [str(i) for i in range(30)], "x").splitlines()[-1]
    assert verdict == (
        "MASK LEAKED: positions outside the expected positions 10-19 (receptive field: 10 tokens) changed "
        "(flash: 10, math: 10)"
    )


def test_attention_maps_draw_the_cells_outside_the_band_as_masked(tmp_path: Path) -> None:
    T = 24
    ids, tokens = list(range(T)), [f"t{i}" for i in range(T)]
    full_dir, band_dir = tmp_path / "full", tmp_path / "band"
    save_attention_maps(_model(n_layer=1), ids, tokens, full_dir)
    save_attention_maps(_model(n_layer=1, attn_window=3), ids, tokens, band_dir)
    saved = np.load(band_dir / "attention.npz")
    assert np.array_equal(saved["mask"][0], causal_mask(T, T, window=3).numpy())
    weights = saved["weights"][0]
    assert np.all(weights[:, ~saved["mask"][0]] == 0) and np.all(weights[:, saved["mask"][0]] > 0)

    def grey_pixels(png_dir: Path) -> int:
        rgb = (matplotlib.image.imread(png_dir / "attention_layer0.png")[..., :3] * 255).round()
        return int(np.all(rgb == [0x9A, 0x9A, 0x9A], axis=-1).sum())

    # Same figure, same size: the band greys out the cells below it too (T(T+1)/2 - the band's, per head).
    assert grey_pixels(band_dir) > 1.5 * grey_pixels(full_dir) > 0


def test_export_refuses_a_window_naming_it() -> None:
    with pytest.raises(PretrainedError, match="attn_window=4 can't be exported"):
        hf_from_gpt(_model(attn_window=4))


def test_a_windowed_run_resumes_and_samples_past_block_size(tmp_path: Path, corpus_path: Path) -> None:
    window = {"model.pos_emb": "rope", "model.attn_window": 6, "model.window_pattern": "SS", "train.max_iters": 10}
    overrides = tiny_run_overrides(tmp_path, corpus_path, **window)  # block_size 32, 2 layers: rolls
    train(compose_config(overrides))
    run = tmp_path / "run"
    saved = load_checkpoint(run / CKPT_NAME).model_config
    assert (saved.attn_window, saved.window_pattern, saved.rolls) == (6, "SS", True)
    with pytest.raises(CheckpointError, match="attn_window: 6 -> 7"):
        train(compose_config([*overrides, "resume=true", "model.attn_window=7"]))
    train(compose_config([*overrides, "resume=true", "resume_with_changes=true", "train.max_iters=20"]))
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 20

    args = [f"out_dir={run}", "start=ROMEO:", "max_new_tokens=80", "num_samples=1", "check_causal=true"]
    result = run_in_process("sample.py", args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    sample, report = result.stdout.split("\n---------------\n")
    assert len(sample) == len("ROMEO:") + 80  # 86 characters from a model of block_size 32
    # The sample rolled on without a word; the check looks at the last block (more than twice the receptive field).
    assert result.stderr.splitlines() == [
        "warning: causality check: the sequence has 86 tokens; using its last 32 (block_size)"
    ]
    # 1 + 2 x 5 = 11 positions may change: the check changes token 10, which centres them.
    verdict = report.rstrip().splitlines()[-1]
    assert verdict.startswith(
        "mask held: positions 0-9 and 21-31 are unchanged on flash and math, "
        "expected positions 10-20 (receptive field: 11 tokens) to change"
    )
