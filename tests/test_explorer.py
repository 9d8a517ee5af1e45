"""The attention explorer (analysis/explorer.py): its data format without a browser, then the page itself in
headless Chromium, checked through the page (window.attentionExplorer, its canvases, its console).

The browser tests need Debian's chromium and chromium-driver and the selenium client (.ci/run installs them). On a
machine without them they skip with the reason; under CI (the CI variable set) they fail instead."""

from __future__ import annotations

import base64
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from analysis.attention_maps import save_attention_maps
from analysis.causality import check_causality
from analysis.diagnostics import (
    DIAGNOSTIC_NAMES,
    decode_step_weights,
    induction_scores,
    pattern_scores,
    run_to_end,
)
from analysis.explorer import (
    DATA_SLOT,
    causality_data,
    pack,
    page_data,
    quantise,
    save_explorer,
    write_page,
)
from inference.sampling import load_model
from model import GPT, GPTConfig, causal_mask

T, PREFILL = 30, 6  # the page's sequence: 6 prompt tokens, 24 decode steps
STEP = 1 / 255  # rounding each row to add up to 255 moves a weight by less than one step



def unpack(data: bytes, mask: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of pack, dequantised: (n_layer, n_head, rows, T) float32, 0 where the mask forbids."""
    n_layer, rows, T = mask.shape
    out = np.zeros((n_layer, n_head, rows, T), dtype=np.float32)
    flat = np.frombuffer(data, dtype=np.uint8)
    start = 0
    for layer in range(n_layer):
        n = int(mask[layer].sum())
        for head in range(n_head):
            out[layer, head][mask[layer]] = flat[start : start + n] / 255
            start += n
    return out


def unpack_steps(data: dict) -> np.ndarray | None:
    """The page's decode-step rows as its script reads them, dequantised: (n_steps, n_layer, n_head, T)."""
    steps = data["steps"]
    if steps is None:
        return None
    n_head, T, first = data["nHead"], data["T"], steps["first"]
    n_steps = T - first
    mask = np.stack([causal_mask(T, T, window=w).numpy() for w in data["windows"]])
    rows = unpack(base64.b64decode(data["weights"]), mask, n_head)[:, :, first:]  # the matrix's rows first ..
    stored, at = np.frombuffer(base64.b64decode(steps["weights"]), dtype=np.uint8), 0
    for index in steps["differ"]:
        layer, head, step = index // n_steps // n_head, index // n_steps % n_head, index % n_steps
        allowed = mask[layer, first + step]
        rows[layer, head, step] = 0
        rows[layer, head, step][allowed] = stored[at : at + allowed.sum()] / 255
        at += allowed.sum()
    return rows.transpose(2, 0, 1, 3)


def _within_rounding(shown: np.ndarray, exact: np.ndarray) -> bool:
    return bool(np.all(np.abs(shown - exact) < STEP + 1e-6))


@pytest.fixture(scope="module")
def windowed_model(trained_run: Path) -> tuple[GPT, object]:
    """The trained tiny run's weights with a 4-token window in layer 0: the page shows a band and a triangle."""
    loaded = load_model(str(trained_run), None, "ckpt.pt", None)
    config = replace(loaded.model.config, attn_window=4, window_pattern="SL")
    model = GPT(config).eval()
    model.load_state_dict(loaded.model.state_dict())
    return model, loaded.tokenizer


@pytest.fixture(scope="module")
def page_dir(windowed_model: tuple[GPT, object], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tokenizer = windowed_model
    ids = tokenizer.encode("ROMEO:\nWhat, shall this speech be")[:T]
    tokens = [tokenizer.decode([i]) for i in ids]
    out = tmp_path_factory.mktemp("explorer")
    save_attention_maps(model, ids, tokens, out)
    report = check_causality(model, ids)
    save_explorer(model, ids, PREFILL, out, "test </script> & <b>", causality_data(report, tokens))
    return out


# --- the data, without a browser ---


def test_quantise_rounds_each_row_to_sum_255_and_keeps_exact_zeros() -> None:
    row = np.array([0.0, 1e-9, 0.4 / 255, 0.3 / 255, 0.5, 0.5 - 0.7 / 255])
    assert quantise(row).tolist() == [0, 0, 0, 0, 128, 127]  # the largest remainders get the units the floors lost
    rows = np.random.default_rng(0).dirichlet(np.full(46, 0.05), size=200)  # peaked, with many tiny weights
    rows[:, :3] = 0
    rows /= rows.sum(-1, keepdims=True)
    q = quantise(rows)
    assert np.all(q.sum(-1) == 255) and np.all(q[:, :3] == 0)
    assert np.abs(q / 255 - rows).max() < 1 / 255
    assert quantise(np.zeros((2, 3))).tolist() == [[0, 0, 0], [0, 0, 0]]  # a row of nothing stays nothing


def test_pack_holds_only_the_allowed_cells_and_unpacks_to_them() -> None:
    mask = np.stack([causal_mask(7, 7, window=3).numpy(), causal_mask(7, 7).numpy()])
    weights = torch.softmax(torch.randn(2, 3, 7, 7).masked_fill(~torch.from_numpy(mask)[:, None], -torch.inf), -1)
    data = pack(quantise(weights.numpy()), mask)
    assert len(data) == 3 * (mask[0].sum() + mask[1].sum())
    back = unpack(data, mask, 3)
    assert np.all(back[:, :, ~mask[0]][0] == 0) and np.all(back[1][:, ~mask[1]] == 0)
    assert _within_rounding(back, weights.numpy())


def test_pattern_scores_follow_their_formulas() -> None:
    p = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    entropy, distance, first, previous = pattern_scores(p)
    assert entropy == pytest.approx((0 + np.log(2) - (0.2 * np.log(0.2) + 0.3 * np.log(0.3) + 0.5 * np.log(0.5))) / 3)
    assert distance == pytest.approx((0 + 0.5 * 1 + (0.2 * 2 + 0.3 * 1)) / 3)
    assert first == pytest.approx((0.5 + 0.2) / 2)  # row 0's weight is all on the first token, whatever the head
    assert previous == pytest.approx((0.5 + 0.3) / 2)


def test_induction_score_reads_the_stripe_after_the_previous_occurrence(windowed_model: tuple[GPT, object]) -> None:
    model = windowed_model[0]
    scores = induction_scores(model)
    assert scores.shape == (model.config.n_layer, model.config.n_head)
    assert np.all((scores >= 0) & (scores <= 1))
    assert np.all(scores[0] == 0)  # layer 0's 4-token window can't reach 16 tokens back (block_size 32: R = 16)


def test_decode_steps_are_the_math_paths_rows(windowed_model: tuple[GPT, object]) -> None:
    model = windowed_model[0]
    ids = list(range(3, 3 + T))
    steps = run_to_end(decode_step_weights(model, ids, PREFILL))
    full = model.attention_weights(torch.tensor([ids]))[:, 0].numpy()  # (n_layer, n_head, T, T)
    assert steps.shape == (T - PREFILL, model.config.n_layer, model.config.n_head, T)
    np.testing.assert_allclose(steps, full[:, :, PREFILL:].transpose(2, 0, 1, 3), rtol=0, atol=1e-6)
    band = causal_mask(T, T, window=4).numpy()[PREFILL:]  # layer 0's cache holds only its window's keys
    assert np.all(steps[:, 0].transpose(1, 0, 2)[:, ~band] == 0) and np.all(steps[:, 0].transpose(1, 0, 2)[:, band] > 0)


def _page_data(out: Path) -> dict:
    page = (out / "index.html").read_text(encoding="utf-8")
    return json.loads(re.search(r'<script id="explorer-data"[^>]*>(.*?)</script>', page, re.S).group(1))


def _page_for(config: GPTConfig, sample: list[int], n_prompt: int, out: Path, use_cache: bool = True) -> dict:
    torch.manual_seed(0)
    model = GPT(config).eval()
    window = sample[-config.block_size :]
    save_attention_maps(model, window, [str(i) for i in window], out)
    save_explorer(model, sample, n_prompt, out, "t", use_cache=use_cache)
    return _page_data(out) | {"model": model}


def test_a_rolling_models_steps_are_those_of_one_cache_from_the_prompt_on(tmp_path: Path) -> None:
    """The maps show the last block_size tokens; their steps are generation's, whose rolling cache held the
    context before the window too (a fresh cache over the window would give other weights)."""
    config = GPTConfig(vocab_size=20, block_size=12, n_layer=2, n_head=2, n_embd=16, pos_emb="rope", attn_window=4)
    sample = torch.randint(20, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    data = _page_for(replace(config, window_pattern="SS"), sample, 5, tmp_path)
    whole = run_to_end(decode_step_weights(data["model"], sample, 5))[-12:, :, :, -12:]  # one cache, all 35 steps
    np.testing.assert_array_equal(np.rint(unpack_steps(data) * 255), quantise(whole))
    fresh = run_to_end(decode_step_weights(data["model"], sample[-12:], 1))
    assert not np.allclose(whole[1:], fresh, atol=1e-3)  # the window's first keys had context before it


def test_no_steps_are_shown_where_generation_took_none(tmp_path: Path) -> None:
    config = GPTConfig(vocab_size=20, block_size=12, n_layer=1, n_head=2, n_embd=16)
    sample = list(range(20)) * 2
    outgrown = _page_for(config, sample, 5, tmp_path / "a")
    assert outgrown["steps"] is None and "sample grew longer than block_size=12" in outgrown["stepsNote"]
    no_cache = _page_for(config, sample[:10], 5, tmp_path / "b", use_cache=False)
    assert no_cache["steps"] is None and "use_cache=false" in no_cache["stepsNote"]
    cached = _page_for(config, sample[:10], 5, tmp_path / "c")
    assert cached["stepsNote"] is None and cached["steps"]["first"] == 5


def test_the_page_is_one_self_contained_file(page_dir: Path) -> None:
    page = (page_dir / "index.html").read_text(encoding="utf-8")
    assert DATA_SLOT not in page
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)  # nothing loaded from anywhere
    assert "http" not in page.lower().replace("http-equiv", "")
    data = json.loads(re.search(r'<script id="explorer-data"[^>]*>(.*?)</script>', page, re.S).group(1))
    assert data["title"] == "test </script> & <b>" and data["steps"]["first"] == PREFILL
    assert data["windows"] == [4, None] and data["causality"]["verdict"].startswith("mask held")


# --- the page in headless Chromium ---


@pytest.fixture(scope="module")
def page(browser, page_dir: Path):
    browser.get((page_dir / "index.html").as_uri())
    return browser


def _matrix_pixels(driver) -> str:
    return driver.execute_script("return document.getElementById('matrix').toDataURL()")


def test_the_page_loads_without_console_errors(page) -> None:
    errors = [entry for entry in page.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []
    api = page.execute_script("const e = window.attentionExplorer; return [e.T, e.nLayer, e.nHead, e.tokens]")
    assert api[:3] == [T, 2, 2] and len(api[3]) == T
    assert page.title == "Attention explorer: test </script> & <b>"


def test_the_pages_weights_are_the_saved_ones_rows_sum_to_1_and_masked_cells_are_0(page, page_dir: Path) -> None:
    shown = np.array(
        page.execute_script(
            """const e = window.attentionExplorer, out = [];
            for (let l = 0; l < e.nLayer; l++) { const heads = []; out.push(heads);
              for (let h = 0; h < e.nHead; h++) { const rows = []; heads.push(rows);
                for (let i = 0; i < e.T; i++) { const row = []; rows.push(row);
                  for (let j = 0; j < e.T; j++) row.push(e.weight(l, h, i, j)); } } }
            return out;"""
        )
    )
    saved = np.load(page_dir / "attention.npz")
    weights, mask = saved["weights"], saved["mask"][:, None]
    assert mask[0, 0, 10, 7] and not mask[0, 0, 10, 6]  # the band of layer 0's window
    mask = np.broadcast_to(mask, weights.shape)
    assert np.all(shown[~mask] == 0)
    assert np.all(shown[mask & (weights >= STEP)] > 0)
    np.testing.assert_array_equal(shown, quantise(weights) / 255)
    assert _within_rounding(shown, weights)
    np.testing.assert_allclose(shown.sum(-1), 1.0, rtol=0, atol=1e-9)  # 255 steps in every row
    values = page.execute_script("return window.attentionExplorer.diagnostics")
    assert values["names"] == list(DIAGNOSTIC_NAMES)
    np.testing.assert_allclose(np.array(values["values"], dtype=float), saved["diagnostics"], rtol=1e-6)


def test_the_step_view_holds_the_decode_steps_own_weights(page, windowed_model: tuple[GPT, object]) -> None:
    shown = np.array(
        page.execute_script(
            """const e = window.attentionExplorer, out = [];
            for (let s = 0; s < e.steps.count; s++) { const layers = []; out.push(layers);
              for (let l = 0; l < e.nLayer; l++) { const heads = []; layers.push(heads);
                for (let h = 0; h < e.nHead; h++) { const row = []; heads.push(row);
                  for (let j = 0; j < e.T; j++) row.push(e.stepWeight(s, l, h, j)); } } }
            return out;"""
        )
    )
    model, tokenizer = windowed_model
    ids = tokenizer.encode("ROMEO:\nWhat, shall this speech be")[:T]
    math_rows = model.attention_weights(torch.tensor([ids]))[:, 0, :, PREFILL:].numpy().transpose(2, 0, 1, 3)
    assert shown.shape == math_rows.shape
    assert _within_rounding(shown, math_rows)
    assert np.all(shown[math_rows == 0] == 0)
    np.testing.assert_array_equal(shown, quantise(run_to_end(decode_step_weights(model, ids, PREFILL))) / 255)


def test_clicking_a_thumbnail_and_hovering_a_token_redraw_the_head(page) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    before = _matrix_pixels(page)
    page.find_element(By.ID, "thumb-1-1").click()
    assert page.execute_script("return window.attentionExplorer.selected()") == [1, 1]
    opened = _matrix_pixels(page)
    assert opened != before
    token = page.find_elements(By.CSS_SELECTOR, "#text span")[12]
    ActionChains(page).move_to_element(token).perform()
    assert _matrix_pixels(page) != opened  # the row is outlined
    assert token.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
    later = page.find_elements(By.CSS_SELECTOR, "#text span")[20]
    assert "masked" in later.get_attribute("class")  # key 20 after query 12: grey, not coloured as a weight
    assert "154, 154, 154" in later.value_of_css_property("background-color")


def test_keys_the_step_slider_and_the_table_respond(page) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    page.execute_script("window.attentionExplorer.open(1, 0)")
    page.find_element(By.CSS_SELECTOR, "input[name=hover-as][value=key]").click()
    spans = page.find_elements(By.CSS_SELECTOR, "#text span")
    ActionChains(page).move_to_element(spans[3]).perform()
    as_row = _matrix_pixels(page)
    ActionChains(page).move_to_element(spans[10]).perform()  # key 10: its column, the queries that see it
    assert _matrix_pixels(page) != as_row
    assert "masked" in spans[5].get_attribute("class")  # query 5 comes before key 10
    assert "masked" not in spans[15].get_attribute("class")
    assert spans[15].value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"  # coloured by its weight
    label = page.find_element(By.ID, "step-label")
    slider = page.find_element(By.ID, "step")
    page.execute_script("window.attentionExplorer.setStep(0)")
    first = label.text
    slider.send_keys(Keys.END)  # the last step, as a user would drag there
    assert label.text != first and label.text.startswith(f"step {T - PREFILL} of {T - PREFILL}: token {T - 1}")
    header = page.find_elements(By.CSS_SELECTOR, "#diagnostics th")[2]  # entropy
    header.click()
    values = [float(td.text) for td in page.find_elements(By.CSS_SELECTOR, "#diagnostics tbody td:nth-child(3)")]
    assert values == sorted(values, reverse=True)  # a number column sorts high first
    header.click()
    values = [float(td.text) for td in page.find_elements(By.CSS_SELECTOR, "#diagnostics tbody td:nth-child(3)")]
    assert values == sorted(values)


def test_a_screenshot_of_the_page_is_not_blank(page) -> None:
    page.execute_script("window.attentionExplorer.open(0, 1); window.attentionExplorer.setStep(5)")
    pixels = matplotlib.image.imread(io.BytesIO(page.get_screenshot_as_png()), format="png")
    colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 100
    assert page.find_element("id", "verdict").text.startswith("mask held")


def test_a_step_row_unlike_the_matrix_row_is_stored_and_shown(browser, page_dir: Path, tmp_path: Path) -> None:
    """Quantised, a decode step's row is nearly always the matrix's own bytes (stored once); one that isn't is
    stored apart, and the page shows each step's own weights either way."""
    n, windows = 5, [2, None]
    mask = np.stack([causal_mask(n, n, window=w).numpy() for w in windows])
    scores = torch.randn(2, 2, n, n, generator=torch.Generator().manual_seed(0))
    weights = scores.masked_fill(~torch.from_numpy(mask)[:, None], float("-inf")).softmax(-1).numpy()
    steps = weights[:, :, 2:].transpose(2, 0, 1, 3).copy()  # the decode steps of tokens 2, 3, 4
    steps[1, 1, 0, :4] = [0.1, 0.2, 0.3, 0.4]  # token 3's step in layer 1, head 0: unlike its matrix row
    data = page_data("steps", list("abcde"), weights, mask, windows, np.zeros((2, 2, 5)), steps)
    assert data["steps"]["differ"] == [(1 * 2 + 0) * 3 + 1] and len(base64.b64decode(data["steps"]["weights"])) == 4
    write_page(data, tmp_path / "index.html")
    try:
        browser.get((tmp_path / "index.html").as_uri())
        shown = browser.execute_script(
            """const e = window.attentionExplorer, out = [];
            for (let s = 0; s < 3; s++) for (let l = 0; l < 2; l++) for (let h = 0; h < 2; h++)
              for (let j = 0; j < 5; j++) out.push(e.stepWeight(s, l, h, j));
            return out;"""
        )
        np.testing.assert_array_equal(np.array(shown).reshape(steps.shape), quantise(steps) / 255)
    finally:
        browser.get((page_dir / "index.html").as_uri())  # the module's page, for any test after this one


def test_weights_near_zero_read_as_unattended_and_the_strips_name_their_heads(
    browser, page_dir: Path, tmp_path: Path
) -> None:
    """A weight of ~0 coloured the text black on inferno's dark end, which read as a highlight."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    n = 6
    mask = causal_mask(n, n).numpy()[None]
    weights = np.tril(np.ones((1, 2, n, n))) / np.arange(1, n + 1)[:, None]
    weights[0, 0, 5] = [0.001, 0.5, 0.009, 0.0, 0.3, 0.19]  # query 5: keys 0, 2 and 3 get under 1 %
    steps = weights[:, :, 2:].transpose(2, 0, 1, 3).copy()
    write_page(
        page_data("faint", list("abcdef"), weights, mask, [None], np.zeros((1, 2, 5)), steps), tmp_path / "p.html"
    )
    try:
        browser.get((tmp_path / "p.html").as_uri())
        spans = browser.find_elements(By.CSS_SELECTOR, "#text span")
        ActionChains(browser).move_to_element(spans[5]).perform()  # query 5's row colours the text
        unattended = ["unattended" in span.get_attribute("class") for span in spans]
        coloured = [span.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)" for span in spans]
        assert unattended == [True, False, True, True, False, False]
        assert coloured == [False, True, False, False, True, True]
        labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#strips .head-label")]
        assert labels == ["head 0", "head 1"]
    finally:
        browser.get((page_dir / "index.html").as_uri())  # the module's page, for any test after this one


def test_the_causality_chart_draws_both_paths_apart(page) -> None:
    """flash and math agree, so their marks coincide: a ring and a dot inside it, each in its own colour."""
    pixels = page.execute_script(
        "const c = document.getElementById('causality'); return Array.from(c.getContext('2d')"
        ".getImageData(0, 0, c.width, c.height - 20).data)"
    )
    rgb = {tuple(pixels[i : i + 3]) for i in range(0, len(pixels), 4)}
    assert (0x1F, 0x77, 0xB4) in rgb and (0xFF, 0x7F, 0x0E) in rgb  # flash's ring, math's dot, both visible
