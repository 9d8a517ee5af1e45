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
from common.files import CKPT_NAME
from conftest import MODERN, compose_config, run_in_process, tiny_run_overrides
from model import GPT, GPTConfig, causal_mask, masked_attention
from model.attention import ROLL_SLACK, KVCache, Rotary, flex_windowed_attention, windowed_attention
from model.checkpoint import load_checkpoint
from train import train

SMALL = dict(vocab_size=40, block_size=32, n_layer=3, n_head=2, n_embd=16)


def _model(attn_impl: str = "math", **overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, "attn_impl": attn_impl, **overrides})).eval()


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


def test_flex_attentions_block_mask_is_the_same_band_run_eagerly() -> None:
    """FlexAttention run eagerly (forward only on CPU); compiled, its block mask traced into the graph as CUDA runs
    it: the next test."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 130, 16) for _ in range(3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": expected off CUDA
        flex = flex_windowed_attention(q, k, v, 37)
    reference, _ = masked_attention(q, k, v, causal_mask(130, 130, window=37))
    torch.testing.assert_close(flex, reference, atol=1e-5, rtol=1e-5)


def test_flex_attention_compiled_by_inductor_on_cpu_takes_rotary_queries_beside_a_fused_qkvs_values() -> None:
    """Inductor's CPU kernel misread v, a view of the fused QKV, beside q and k made new by rotary (5 off eager's;
    docs/gpu.md): the traced path hands it v contiguous."""
    torch.manual_seed(0)
    qkv, rotary = torch.randn(2, 130, 3, 2, 16), Rotary(16, 130)

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # as CausalSelfAttention splits c_attn's output
        return flex_windowed_attention(rotary(q, 0), rotary(k, 0), v, 37)

    with torch.no_grad():
        compiled = torch.compile(attend, fullgraph=True)(qkv)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    reference, _ = masked_attention(rotary(q, 0), rotary(k, 0), v, causal_mask(130, 130, window=37))
    torch.testing.assert_close(compiled, reference, atol=1e-5, rtol=1e-5)


def test_a_block_mask_made_while_sampling_can_serve_training() -> None:
    cached = model.attention._cached_band_block_mask
    cached.cache_clear()
    with torch.inference_mode():  # as generate() runs
        block_mask = cached(96, 9, torch.device("cpu"))
    assert not block_mask.kv_num_blocks.is_inference() and not block_mask.kv_indices.is_inference()
    assert cached(96, 9, torch.device("cpu")) is block_mask


def test_the_fused_path_costs_keys_in_the_window_not_the_whole_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    seen, sdpa = [], F.scaled_dot_product_attention  # the (queries, keys) of each call
    monkeypatch.setattr(model.attention.F, "scaled_dot_product_attention",
                        lambda q, k, *args, **kw: seen.append((q.size(-2), k.size(-2))) or sdpa(q, k, *args, **kw))
    q = torch.randn(1, 1, 1024, 8)
    windowed_attention(q, q, q, 64)
    assert sum(n_q for n_q, _ in seen) == 1024
    assert max(n_k for _, n_k in seen) <= 2 * 64  # a block of queries, its keys and the previous block's


def test_the_window_pattern_is_tiled_with_the_last_layer_full_unless_written_out_and_what_rolls() -> None:
    patterns = [(None, 4, "SSSL"), (None, 1, "S"), ("SL", 5, "SLSLL"), ("SSL", 6, "SSLSSL"), ("SSSS", 4, "SSSS"),
                ("LS", 2, "LS")]
    for pattern, n_layer, expected in patterns:
        windows = GPTConfig(**{**SMALL, "n_layer": n_layer}, attn_window=8, window_pattern=pattern).layer_windows()
        assert "".join("L" if w is None else "S" for w in windows) == expected and set(windows) <= {8, None}
    assert GPTConfig(**SMALL, window_pattern="SSS").layer_windows() == [None, None, None]  # no window: none
    assert GPTConfig(**SMALL).receptive_field is None
    everywhere = GPTConfig(**SMALL, attn_window=5, window_pattern="SSS", pos_emb="rope")
    assert everywhere.rolls and everywhere.receptive_field == 1 + 3 * 4
    assert not replace(everywhere, pos_emb="learned").rolls  # learned positions stop at block_size
    assert not replace(everywhere, attn_window=33).rolls  # wider than block_size: reaches further than training
    last_full = GPTConfig(**SMALL, attn_window=5, pos_emb="rope")
    assert not last_full.rolls and last_full.receptive_field is None


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
@pytest.mark.parametrize(
    ("window", "sizes", "options"),
    [
        # a prompt, then a token a step; a prompt of 80 is more than a buffer of windows 1 and 4 has slots for
        *((window, [prompt] + [1] * (240 - prompt), {}) for window in (1, 4, 70) for prompt in (1, 9, 80)),
        # chunks after a cache (GPT.prefill's); 100: more than the 72 slots after a roll, and than block_size
        (5, [7, 3, 1, 12, 2, 40, 1, 1, 33, 100, 1], {}),
        (5, [7, 3, 1, 12, 2, 40, 1, 1, 33, 100, 1], MODERN),  # the bigram of a chunk's first token: from the cache
    ],
)
def test_cached_logits_equal_one_pass_past_block_size_with_the_memory_bounded(
    attn_impl: str, window: int, sizes: list[int], options: dict
) -> None:
    """Every layer windowed, the cache rolls past block_size; each layer's buffer holds 2 (W - 1) + 64 slots (at most
    block_size), grown only for a longer chunk."""
    block_size = 80  # room for a window over one query block of 64
    config = {**options, "block_size": block_size, "attn_window": window, "window_pattern": "SSS", "pos_emb": "rope"}
    rolling = _model(attn_impl, **config)
    with torch.no_grad():  # no zero-initialised table or mix hides a path
        for p in rolling.parameters():
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(SMALL["vocab_size"], (2, sum(sizes)))
    slots = min(block_size, 2 * (window - 1) + ROLL_SLACK)
    with torch.no_grad():
        math_ = GPT(replace(rolling.config, attn_impl="math")).eval()
        math_.load_state_dict(rolling.state_dict())
        full, _ = math_(idx)
        cache, start, largest = KVCache(rolling.config), 0, 0
        for size in sizes:
            logits, _ = rolling(idx[:, start : start + size], cache=cache)
            torch.testing.assert_close(logits, full[:, start : start + size], atol=1e-5, rtol=0)
            start += size
            largest = max(largest, *(layer.buffer.size(3) for layer in cache.layers))
    assert largest <= max(slots, window - 1 + max(sizes))
    assert [layer.buffer.size(3) for layer in cache.layers] == [slots] * SMALL["n_layer"]


@pytest.mark.parametrize("attn_impl", ["flash", "math"])
def test_a_rolling_model_runs_a_long_prompt_in_chunks_then_generates_past_block_size_one_token_a_step(
    attn_impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT.prefill runs a prompt PREFILL_CHUNK tokens at a time, bounding its memory; then each new token costs one
    position, never a recompute, and greedy decoding draws the recomputed tokens."""
    import model.gpt as gpt_module

    rolling = _model(attn_impl, attn_window=6, window_pattern="SSS", pos_emb="rope")
    prompt = torch.randint(SMALL["vocab_size"], (2, 150))
    new = 3 * SMALL["block_size"]
    recomputed = rolling.generate(prompt, new, top_k=1, use_cache=False)
    monkeypatch.setattr(gpt_module, "PREFILL_CHUNK", 16)
    lengths: list[int] = []
    hidden = rolling.hidden
    monkeypatch.setattr(rolling, "hidden", lambda idx, cache=None: lengths.append(idx.size(1)) or hidden(idx, cache))
    assert torch.equal(rolling.generate(prompt, new, top_k=1, use_cache=True), recomputed)
    assert lengths == [16] * 9 + [6] + [1] * (new - 1)


def test_the_causality_check_shows_the_receptive_field_on_both_paths_and_catches_a_window_silently_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    windowed = _model("flash", attn_window=4, window_pattern="SSS", pos_emb="rope")
    ids = list(range(3, 33))
    report = check_causality(windowed, ids, position=10)
    assert report.receptive_field == 1 + 3 * 3 and report.last_reachable == 19
    for change in report.changes.values():
        assert torch.all(change[:10] == 0) and torch.all(change[20:] == 0)  # exactly, before and past the field
        assert torch.all(change[10:20] > 0)
    assert report.mask_held and report.information_flows
    assert format_report(report, [str(i) for i in ids], "x").splitlines()[-1] == (
        "mask held: positions 0-9 and 20-29 are unchanged on flash and math, "
        "expected positions 10-19 (receptive field: 10 tokens) to change, found 10-19 changed"
    )

    band, sdpa = model.attention.causal_mask, F.scaled_dot_product_attention
    monkeypatch.setattr(model.attention, "causal_mask", lambda q, k, device=None, window=None: band(q, k, device))
    monkeypatch.setattr(
        model.attention, "windowed_attention", lambda q, k, v, window, dropout_p=0.0: sdpa(q, k, v, is_causal=True)
    )
    report = check_causality(windowed, ids, position=10)
    assert not report.mask_held
    assert format_report(report, [str(i) for i in ids], "x").splitlines()[-1] == (
        "MASK LEAKED: positions outside the expected positions 10-19 (receptive field: 10 tokens) changed "
        "(flash: 10, math: 10)"
    )


def test_attention_maps_draw_the_cells_outside_the_band_as_masked(tmp_path: Path) -> None:
    T = 24
    ids, tokens = list(range(T)), [f"t{i}" for i in range(T)]
    full_dir, band_dir = tmp_path / "full", tmp_path / "band"
    save_attention_maps(_model(n_layer=1), ids, tokens, full_dir)
    save_attention_maps(_model(n_layer=1, attn_window=3), ids, tokens, band_dir)
    assert np.array_equal(np.load(band_dir / "attention.npz")["mask"][0], causal_mask(T, T, window=3).numpy())

    def grey_pixels(png_dir: Path) -> int:
        rgb = (matplotlib.image.imread(png_dir / "attention_layer0.png")[..., :3] * 255).round()
        return int(np.all(rgb == [0x9A, 0x9A, 0x9A], axis=-1).sum())

    # Same figure, same size: the band greys out the cells below it too (T(T+1)/2 - the band's, per head).
    assert grey_pixels(band_dir) > 1.5 * grey_pixels(full_dir) > 0


def test_a_windowed_run_resumes_and_samples_past_block_size(tmp_path: Path, corpus_path: Path) -> None:
    window = {"model.pos_emb": "rope", "model.attn_window": 6, "model.window_pattern": "SS", "train.max_iters": 10}
    overrides = tiny_run_overrides(tmp_path, corpus_path, **window)  # block_size 32, 2 layers: rolls
    train(compose_config(overrides))
    run = tmp_path / "run"
    saved = load_checkpoint(run / CKPT_NAME).model_config
    assert (saved.attn_window, saved.window_pattern, saved.rolls) == (6, "SS", True)
    train(compose_config([*overrides, "resume=true", "resume_with_changes=true", "train.max_iters=20"]))
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 20

    args = [f"out_dir={run}", "start=ROMEO:", "max_new_tokens=80", "num_samples=1", "check_causal=true"]
    result = run_in_process("sample.py", args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    sample, report = result.stdout.split("\n---------------\n")
    assert len(sample) == len("ROMEO:") + 80  # 86 characters from a model of block_size 32
    # The sample rolled on without a word; the check looks at the last block (more than twice the receptive field).
    assert result.stderr == "warning: causality check: the sequence has 86 tokens; using its last 32 (block_size)\n"
    # 1 + 2 x 5 = 11 positions may change: the check changes token 10, which centres them.
    verdict = report.rstrip().splitlines()[-1]
    assert verdict.startswith(
        "mask held: positions 0-9 and 21-31 are unchanged on flash and math, "
        "expected positions 10-20 (receptive field: 11 tokens) to change"
    )
