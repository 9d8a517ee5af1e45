"""serve.py's live page (GET /) in headless Chromium: type a prompt, watch the text stream in and the attention
explorer follow it, replace a token and read, through window.servePage, how much each position's prediction
moved: exactly zero before it; a text past the context said to be cropped. Also the page's refusals, without a
browser."""

from __future__ import annotations

import time

import pytest

from conftest import ServeProcess

PROMPT = "ROMEO:\nWhat"


def _wait(driver, script: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {script}")


def _generate(browser, server: ServeProcess, prompt: str, max_tokens: int) -> dict:
    """The page's prompt typed in, greedy decoding asked for, and its state once the text has come."""
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    for field, value in (("prompt", prompt), ("max-tokens", str(max_tokens)), ("temperature", "0")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "generate").click()
    _wait(browser, "return window.servePage.state.done")
    return browser.execute_script("return window.servePage.state")


def _shown(browser) -> list[str]:
    """The page's boxes on screen: none empty before its text, and no blank chart before a replacement."""
    from selenium.webdriver.common.by import By

    boxes = ("output", "tokens-wait", "tokens", "change-chart", "explorer")
    return [box for box in boxes if browser.find_element(By.ID, box).is_displayed()]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"text": "ROMEO", "position": 5, "replacement": "e"}, "position", "position=5 is not a token of the text"),
    ({"text": "ROMEO", "position": 1, "replacement": "ee"}, "replacement", "'ee' is 2 tokens; give one"),
    ({"text": "ROMEO", "position": 1, "replacement": "Ω"}, "replacement", "not in the model's vocabulary"),
    ({"text": "ROMEO", "position": 1, "replacement": "O"}, "replacement", "'O' is the token already there"),
    ({"text": "", "position": 0, "replacement": "e"}, "text", "text is empty"),
    ({"text": "ROMEO", "position": "one", "replacement": "e"}, "position", "valid integer"),
])
def test_the_page_endpoints_refuse_bad_input_naming_the_field(server: ServeProcess, body: dict, param: str,
                                                              message: str) -> None:
    response = server.post(body, "/page/causality")
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], error


def test_the_page_streams_text_follows_it_with_the_explorer_and_shows_the_mask_on_demand(browser, server) -> None:
    from selenium.webdriver.common.by import By

    state = _generate(browser, server, PROMPT, 40)
    assert state["error"] is None and _shown(browser) == ["output", "tokens", "explorer"]
    greedy = server.post({"prompt": PROMPT, "max_tokens": 40, "temperature": 0}).json()["choices"][0]["text"]
    assert state["text"] == PROMPT + greedy  # the page's stream is the API's text
    assert browser.find_element(By.ID, "generated").text.strip() == greedy.strip()
    # the explorer holds the text on screen, token for token, with the generated tokens' decode steps
    explorer = browser.execute_script("const e = window.servePage.explorer(); return [e.T, e.tokens, e.steps]")
    assert explorer[0] == len(state["text"]) == state["explorerT"] and "".join(explorer[1]) == state["text"]
    assert explorer[2]["count"] == len(greedy) and state["explorerUpdates"] >= 1

    # click a token of the prompt, replace it, and read the chart's numbers
    position = 3
    span = browser.find_element(By.CSS_SELECTOR, f"#tokens span[data-position='{position}']")
    assert "prompt" in span.get_attribute("class")
    blank = browser.execute_script("return document.getElementById('change-chart').toDataURL()")
    span.click()
    replacement = "a" if state["text"][position] != "a" else "e"
    browser.find_element(By.ID, "replacement").send_keys(replacement)
    browser.find_element(By.ID, "replace").click()
    changes = _wait(browser, "return window.servePage.state.changes")
    for impl in ("flash", "math"):
        assert changes["changes"][impl][:position] == [0] * position, impl
        assert all(change > 0 for change in changes["changes"][impl][position:]), impl
    assert changes["position"] == position and changes["replacement"] == replacement
    assert browser.find_element(By.ID, "change-verdict").text.startswith("mask held")
    assert _shown(browser) == ["output", "tokens", "change-chart", "explorer"]
    assert browser.execute_script("return document.getElementById('change-chart').toDataURL()") != blank
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


LONG = "ROMEO:\n" + "What light through yonder window breaks? " * 3  # 127 characters, past block_size 96


def test_the_page_shows_the_cropping_line_above_the_tokens_and_in_the_explorer(browser, server: ServeProcess) -> None:
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    assert not browser.find_element(By.ID, "tokens-note").is_displayed() and _shown(browser) == ["tokens-wait"]
    _generate(browser, server, LONG, 3)
    shown = browser.find_element(By.ID, "tokens-note")
    note = f"showing the last 96 of the text's {len(LONG) + 3} tokens: the model's context (block_size=96)"
    assert shown.is_displayed() and shown.text == note
    in_explorer = "const d = document.getElementById('explorer').contentDocument.getElementById('context-note');"
    assert browser.execute_script(in_explorer + "return [d.hidden, d.textContent]") == [False, shown.text]
