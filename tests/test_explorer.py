"""Attention maps, the causality demonstration and the attention explorer (analysis/) on a tiny trained checkpoint:
the explorer's data, then the page itself in headless Chromium (the browser fixture says what it needs)."""

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

import model.attention
from analysis.attention_maps import save_attention_maps
from analysis.causality import check_causality, format_report
from analysis.diagnostics import DIAGNOSTIC_NAMES, decode_step_weights, induction_scores, pattern_scores
from analysis.explorer import causality_data, page_data, quantise, render_page, save_explorer
from conftest import run_in_process
from inference.sampling import load_model
from model import GPT, GPTConfig, causal_mask

T, PREFILL = 30, 6  # the page's sequence: 6 prompt tokens, 24 decode steps


@pytest.fixture(scope="module")
def windowed_model(trained_run: Path) -> tuple[GPT, list[int], list[str]]:
    """The trained tiny run's weights with a 4-token window in layer 0 (the page shows a band and a triangle), and
    the page's token ids and texts."""
    loaded = load_model(str(trained_run), None, "ckpt.pt", None)
    model = GPT(replace(loaded.model.config, attn_window=4, window_pattern="SL")).eval()
    model.load_state_dict(loaded.model.state_dict())
    ids = loaded.tokenizer.encode("ROMEO:\nWhat, shall this speech be")[:T]
    return model, ids, [loaded.tokenizer.decode([i]) for i in ids]


@pytest.fixture(scope="module")
def page_dir(windowed_model: tuple[GPT, list[int], list[str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, ids, tokens = windowed_model
    out = tmp_path_factory.mktemp("explorer")
    save_attention_maps(model, ids, tokens, out)
    save_explorer(model, ids, PREFILL, out, "test </script> & <b>", causality_data(check_causality(model, ids), tokens))
    return out


def _page_data(out: Path) -> dict:
    page = (out / "index.html").read_text(encoding="utf-8")
    return json.loads(re.search(r'<script id="explorer-data"[^>]*>(.*?)</script>', page, re.S).group(1))


# --- the data, without a browser ---


def test_quantise_rounds_each_row_to_sum_255_and_keeps_exact_zeros() -> None:
    row = np.array([0.0, 1e-9, 0.4 / 255, 0.3 / 255, 0.5, 0.5 - 0.7 / 255])
    assert quantise(row).tolist() == [0, 0, 0, 0, 128, 127]  # the largest remainders get the units the floors lost
    rows = np.random.default_rng(0).dirichlet(np.full(46, 0.05), size=200)  # peaked, with many tiny weights
    rows[:, :3] = 0
    rows /= rows.sum(-1, keepdims=True)
    q = quantise(rows)
    assert np.all(q.sum(-1) == 255) and np.all(q[:, :3] == 0) and np.abs(q / 255 - rows).max() < 1 / 255
    assert quantise(np.zeros((2, 3))).tolist() == [[0, 0, 0], [0, 0, 0]]  # a row of nothing stays nothing


def test_pattern_scores_follow_their_formulas() -> None:
    p = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    entropy, distance, first, previous = pattern_scores(p)
    assert entropy == pytest.approx((0 + np.log(2) - (0.2 * np.log(0.2) + 0.3 * np.log(0.3) + 0.5 * np.log(0.5))) / 3)
    assert distance == pytest.approx((0 + 0.5 * 1 + (0.2 * 2 + 0.3 * 1)) / 3)
    assert first == pytest.approx((0.5 + 0.2) / 2)  # row 0's weight is all on the first token, whatever the head
    assert previous == pytest.approx((0.5 + 0.3) / 2)


def test_induction_scores_and_decode_steps_on_the_windowed_model(windowed_model: tuple) -> None:
    """Induction reads the stripe after the previous occurrence; the decode steps are the math path's rows."""
    model = windowed_model[0]
    scores = induction_scores(model)
    assert scores.shape == (model.config.n_layer, model.config.n_head) and np.all((scores >= 0) & (scores <= 1))
    assert np.all(scores[0] == 0)  # layer 0's 4-token window can't reach 16 tokens back (block_size 32: R = 16)
    ids = list(range(3, 3 + T))
    steps = decode_step_weights(model, ids, PREFILL)
    full = model.attention_weights(torch.tensor([ids]))[:, 0].numpy()  # (n_layer, n_head, T, T)
    assert steps.shape == (T - PREFILL, model.config.n_layer, model.config.n_head, T)
    np.testing.assert_allclose(steps, full[:, :, PREFILL:].transpose(2, 0, 1, 3), rtol=0, atol=1e-6)
    band = causal_mask(T, T, window=4).numpy()[PREFILL:]  # layer 0's cache holds only its window's keys
    assert np.all(steps[:, 0].transpose(1, 0, 2)[:, ~band] == 0) and np.all(steps[:, 0].transpose(1, 0, 2)[:, band] > 0)


def _page_for(config: GPTConfig, sample: list[int], n_prompt: int, out: Path, use_cache: bool = True) -> dict:
    torch.manual_seed(0)
    model = GPT(config).eval()
    window = sample[-config.block_size :]
    save_attention_maps(model, window, [str(i) for i in window], out)
    save_explorer(model, sample, n_prompt, out, "t", use_cache=use_cache)
    return _page_data(out) | {"model": model}


def test_steps_are_shown_where_generation_took_them_a_rolling_models_from_one_cache(tmp_path: Path) -> None:
    """The maps show the last block_size tokens; a rolling model's steps are generation's, whose cache held the
    context before the window too (a fresh cache over the window would give other weights). A model that can't
    cache past block_size, or a sample drawn without the cache, has no steps to show."""
    config = GPTConfig(vocab_size=20, block_size=12, n_layer=2, n_head=2, n_embd=16, pos_emb="rope", attn_window=4,
                       window_pattern="SS")
    sample = torch.randint(20, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    data = _page_for(config, sample, 5, tmp_path)
    whole = decode_step_weights(data["model"], sample, 5)[-12:, :, :, -12:]  # one cache, all 35 steps
    with np.load(tmp_path / "attention.npz") as saved:
        expected = page_data("t", [], saved["weights"], saved["mask"], config.layer_windows(), saved["diagnostics"],
                             whole)
    assert data["steps"] == expected["steps"] and data["nPrompt"] == 0
    fresh = decode_step_weights(data["model"], sample[-12:], 1)
    assert not np.allclose(whole[1:], fresh, atol=1e-3)  # the window's first keys had context before it
    config = GPTConfig(vocab_size=20, block_size=12, n_layer=1, n_head=2, n_embd=16)
    sample = list(range(20)) * 2
    outgrown = _page_for(config, sample, 5, tmp_path / "a")
    assert outgrown["steps"] is None and "sample grew longer than block_size=12" in outgrown["stepsNote"]
    no_cache = _page_for(config, sample[:10], 5, tmp_path / "b", use_cache=False)
    assert no_cache["steps"] is None and "use_cache=false" in no_cache["stepsNote"]
    cached = _page_for(config, sample[:10], 5, tmp_path / "c")
    assert cached["stepsNote"] is None and cached["steps"]["first"] == 5


def test_attention_dir_holds_causal_softmax_rows_a_png_per_layer_and_one_self_contained_page(page_dir: Path) -> None:
    saved = np.load(page_dir / "attention.npz")
    weights, mask = saved["weights"], saved["mask"][:, None]
    assert weights.dtype == np.float32 and weights.shape == (2, 2, T, T) and len(saved["tokens"]) == T
    assert np.all(weights[..., np.triu(np.ones((T, T), dtype=bool), k=1)] == 0)
    mask = np.broadcast_to(mask, weights.shape)
    assert np.all(weights[~mask] == 0) and np.all(weights[mask] > 0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    for layer in range(2):
        assert matplotlib.image.imread(page_dir / f"attention_layer{layer}.png").shape[0] > 200
    page = (page_dir / "index.html").read_text(encoding="utf-8")
    assert "__EXPLORER_DATA__" not in page and not re.search(r"<(script|link|img)[^>]+(src|href)=", page)
    assert "http" not in page.lower().replace("http-equiv", "")  # nothing loaded from anywhere
    data = _page_data(page_dir)
    assert data["title"] == "test </script> & <b>" and data["steps"]["first"] == PREFILL
    assert data["windows"] == [4, None] and data["causality"]["verdict"].startswith("mask held")


def test_causality_check_finds_no_leak_in_a_trained_model_refuses_no_change_and_reports_a_removed_mask(
    trained_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained = load_model(str(trained_run), None, "ckpt.pt", None).model.eval()
    ids = list(range(5, 35))
    report = check_causality(trained, ids)
    assert report.position == 15 and set(report.changes) == {"flash", "math"}
    assert report.mask_held and report.information_flows
    text = format_report(report, [str(i) for i in ids], "x", positions=True).splitlines()
    assert text[-1].startswith("mask held: positions 0-14 are unchanged on flash and math") and len(text) == 33
    summary = format_report(report, [str(i) for i in ids], "x").splitlines()
    assert summary[1] == "  positions 0-14 (before it): flash 0, math 0" and summary[-1] == text[-1]
    assert summary[2].startswith("  positions 15-29 (from it on): flash ") and len(summary) == 4
    with pytest.raises(ValueError, match="token 1 would be replaced by itself"):  # "the mask held" would prove nothing
        check_causality(trained, ids, position=1, replacement=ids[1])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(model.attention, "causal_mask", lambda n_queries, n_keys, device=None, window=None:
                        torch.ones(n_queries, n_keys, dtype=torch.bool, device=device))
    monkeypatch.setattr(model.attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa(*a, **{**kw, "is_causal": False}))
    report = check_causality(trained, ids)
    assert not report.mask_held and all(bool((c[: report.position] > 0).any()) for c in report.changes.values())
    assert "MASK LEAKED" in format_report(report, [str(i) for i in ids], "x")


def test_sample_py_draws_attention_maps_and_proves_causality(trained_run: Path, tmp_path: Path) -> None:
    args = [f"out_dir={trained_run}", "start=The", "num_samples=1", "max_new_tokens=20", "seed=3",
            f"attention_dir={tmp_path / 'maps'}", "check_causal=true"]
    result = run_in_process("sample.py", args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    sample, report = result.stdout.split("\n---------------\n")
    assert sample.startswith("The") and len(sample) == 23
    assert "causality check: token 11" in report and report.rstrip().splitlines()[-1].startswith("mask held")
    weights = np.load(tmp_path / "maps" / "attention.npz")["weights"]
    assert weights.shape[-2:] == (23, 23)
    assert len(list((tmp_path / "maps").glob("attention_layer*.png"))) == weights.shape[0]
    page = (tmp_path / "maps" / "index.html").read_text(encoding="utf-8")
    assert '"steps":{"first":3,' in page and '"verdict":"mask held' in page  # "The": 3 tokens run as the prompt


# --- the page in headless Chromium ---


@pytest.fixture(scope="module")
def page(browser, page_dir: Path):
    browser.get((page_dir / "index.html").as_uri())
    return browser


RANGE = "const e = window.attentionExplorer, r = n => [...Array(n).keys()]; "  # r(n): 0 .. n - 1, for the page's API


def _matrix_pixels(driver) -> str:
    return driver.execute_script("return document.getElementById('matrix').toDataURL()")


def test_the_pages_weights_and_steps_are_the_saved_ones(page, page_dir: Path, windowed_model) -> None:
    """The page shows the saved weights and each decode step's own, quantised (so rows sum to 1, masked cells 0)."""
    api = page.execute_script("const e = window.attentionExplorer; return [e.T, e.nLayer, e.nHead, e.tokens]")
    assert api[:3] == [T, 2, 2] and len(api[3]) == T and page.title == "Attention explorer: test </script> & <b>"
    shown = np.array(page.execute_script(RANGE + "return r(e.nLayer).map(l => r(e.nHead).map(h => r(e.T).map(i => "
                                         "r(e.T).map(j => e.weight(l, h, i, j)))))"))
    saved = np.load(page_dir / "attention.npz")
    assert saved["mask"][0, 10, 7] and not saved["mask"][0, 10, 6]  # the band of layer 0's window
    np.testing.assert_array_equal(shown, quantise(saved["weights"]) / 255)
    values = page.execute_script("return window.attentionExplorer.diagnostics")
    assert values["names"] == list(DIAGNOSTIC_NAMES)
    np.testing.assert_allclose(np.array(values["values"], dtype=float), saved["diagnostics"], rtol=1e-6)
    steps = np.array(page.execute_script(RANGE + "return r(e.steps.count).map(s => r(e.nLayer).map(l => r(e.nHead).map("
                                         "h => r(e.T).map(j => e.stepWeight(s, l, h, j)))))"))
    model, ids, _ = windowed_model
    np.testing.assert_array_equal(steps, quantise(decode_step_weights(model, ids, PREFILL)) / 255)


def test_clicks_hovers_keys_the_step_slider_and_the_table_respond(page) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    before = _matrix_pixels(page)
    page.find_element(By.ID, "thumb-1-1").click()
    assert page.execute_script("return window.attentionExplorer.selected()") == [1, 1]
    opened = _matrix_pixels(page)
    assert opened != before
    spans = page.find_elements(By.CSS_SELECTOR, "#text span")
    ActionChains(page).move_to_element(spans[12]).perform()
    assert _matrix_pixels(page) != opened  # the row is outlined
    assert spans[12].value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
    assert "masked" in spans[20].get_attribute("class")  # key 20 after query 12: grey, not coloured as a weight
    assert "154, 154, 154" in spans[20].value_of_css_property("background-color")
    page.execute_script("window.attentionExplorer.open(1, 0)")
    page.find_element(By.CSS_SELECTOR, "input[name=hover-as][value=key]").click()
    ActionChains(page).move_to_element(spans[3]).perform()
    as_row = _matrix_pixels(page)
    ActionChains(page).move_to_element(spans[10]).perform()  # key 10: its column, the queries that see it
    assert _matrix_pixels(page) != as_row
    assert "masked" in spans[5].get_attribute("class")  # query 5 comes before key 10
    assert "masked" not in spans[15].get_attribute("class")
    assert spans[15].value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"  # coloured by its weight
    label = page.find_element(By.ID, "step-label")
    page.execute_script("window.attentionExplorer.setStep(0)")
    first = label.text
    page.find_element(By.ID, "step").send_keys(Keys.END)  # the last step, as a user would drag there
    assert label.text != first and label.text.startswith(f"step {T - PREFILL} of {T - PREFILL}: token {T - 1}")
    header = page.find_elements(By.CSS_SELECTOR, "#diagnostics th")[2]  # entropy
    for descending in (True, False):  # a number column sorts high first
        header.click()
        values = [float(td.text) for td in page.find_elements(By.CSS_SELECTOR, "#diagnostics tbody td:nth-child(3)")]
        assert values == sorted(values, reverse=descending)


def test_a_screenshot_is_not_blank_the_causality_chart_draws_both_paths_and_the_console_is_clean(page) -> None:
    """flash and math agree, so their marks coincide: a ring and a dot inside it, each in its own colour."""
    page.execute_script("window.attentionExplorer.open(0, 1); window.attentionExplorer.setStep(5)")
    pixels = matplotlib.image.imread(io.BytesIO(page.get_screenshot_as_png()), format="png")
    assert len(np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 100
    assert page.find_element("id", "verdict").text.startswith("mask held")
    chart = page.execute_script("const c = document.getElementById('causality'); return Array.from(c.getContext('2d')"
                                ".getImageData(0, 0, c.width, c.height - 20).data)")
    rgb = {tuple(chart[i : i + 3]) for i in range(0, len(chart), 4)}
    assert (0x1F, 0x77, 0xB4) in rgb and (0xFF, 0x7F, 0x0E) in rgb  # flash's ring, math's dot, both visible
    assert [entry for entry in page.get_log("browser") if entry["level"] == "SEVERE"] == []


@pytest.fixture
def show(browser, page_dir: Path, tmp_path: Path):
    """Opens a page of the data it is given; the module's page is back afterwards, for any test after this one."""

    def open_page(data: dict):
        (tmp_path / "index.html").write_text(render_page(data), encoding="utf-8")
        browser.get((tmp_path / "index.html").as_uri())
        return browser

    yield open_page
    browser.get((page_dir / "index.html").as_uri())


def test_a_step_row_unlike_the_matrix_row_is_stored_and_shown_and_weights_near_zero_read_as_unattended(show) -> None:
    """Quantised, a decode step's row is nearly always the matrix's own bytes (stored once); one that isn't is
    stored apart, and the page shows each step's own weights either way. A weight of ~0 leaves its text uncoloured."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    n, windows = 6, [None, 2]
    mask = np.stack([causal_mask(n, n, window=w).numpy() for w in windows])
    scores = torch.randn(2, 2, n, n, generator=torch.Generator().manual_seed(0))
    weights = scores.masked_fill(~torch.from_numpy(mask)[:, None], float("-inf")).softmax(-1).numpy()
    weights[0, 0, 5] = [0.001, 0.5, 0.009, 0.0, 0.3, 0.19]  # query 5: keys 0, 2 and 3 get under 1 %
    steps = weights[:, :, 2:].transpose(2, 0, 1, 3).copy()  # the decode steps of tokens 2 .. 5
    steps[1, 0, 1, :4] = [0.1, 0.2, 0.3, 0.4]  # token 3's step in layer 0, head 1: unlike its matrix row
    data = page_data("steps", list("abcdef"), weights, mask, windows, np.zeros((2, 2, 5)), steps)
    assert data["steps"]["differ"] == [(0 * 2 + 1) * 4 + 1] and len(base64.b64decode(data["steps"]["weights"])) == 4
    browser = show(data)
    shown = browser.execute_script(RANGE + "return r(4).map(s => r(2).map(l => r(2).map(h => r(6).map(j => "
                                   "e.stepWeight(s, l, h, j)))))")
    np.testing.assert_array_equal(np.array(shown), quantise(steps) / 255)
    spans = browser.find_elements(By.CSS_SELECTOR, "#text span")
    ActionChains(browser).move_to_element(spans[5]).perform()  # query 5's row of layer 0, head 0 colours the text
    assert ["unattended" in span.get_attribute("class") for span in spans] == [True, False, True, True, False, False]
    coloured = [span.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)" for span in spans]
    assert coloured == [False, True, False, False, True, True]
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#strips .head-label")] == ["head 0", "head 1"]
