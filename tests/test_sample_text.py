"""sample.py's text: whole characters only, stop strings, streaming in order, batched samples."""

from __future__ import annotations

import contextlib
import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from common.runtime import make_runtime
from conftest import REPO, run_in_process, tiny_encoding
from data.tokenizers import BpeTokenizer, CharTokenizer, Tokenizer
from inference.sampling import SEPARATOR, Sampler, SampleText, stop_strings
from model import GPT, GPTConfig
from model.gpt import Decoding
from sample import SampleConfig

CHARS = CharTokenizer(sorted(set("\n !.:ABDEHNORST") | set("abcdefghijklmnopqrstuvwxyz")))
BYTES = BpeTokenizer(tiny_encoding())  # ids 0-255 are the single bytes; then merges; then <|endoftext|>
EOT = BYTES.encoding.eot_token


def chars(text: str) -> list[int]:
    return CHARS.encode(text)


@pytest.mark.parametrize(
    ("tokenizer", "prompt", "stop", "tokens", "shown", "text", "stopped"),
    [
        # a character split across tokens is shown whole once its last byte arrives, nothing garbled before
        (BYTES, "", [], [ord("a"), 0xC3, 0xA9, ord("!")], ["", "a", "", "é", "!", ""], "aé!", False),
        # a sample cut inside a character ends before it; a byte that is never UTF-8 reads as decode reads it
        (BYTES, "", [], [ord("a"), 0xE2, 0x82], ["", "a", "", "", ""], "a", False),
        (BYTES, "", [], [0xFF, ord("b")], ["", "\ufffd", "b", ""], "\ufffdb", False),
        # a stop string across tokens ends the sample before it, none of it shown; then no token is taken
        (CHARS, "ROMEO:", ["END"], chars("xENDa"), ["ROMEO:", "x", "", "", "", "", ""], "ROMEO:x", True),
        # a held-back start that turns out to be no stop string is shown
        (CHARS, "", ["END", "\n\n"], chars("EN\nx"), ["", "", "", "EN", "\nx", ""], "EN\nx", False),
        # the earliest stop string wins, and one in the prompt does not count
        (CHARS, "END:", ["END", "ND."], chars("a ND. END"), None, "END:a ", True),
        # one token brings " and": the stop string complete first wins, as if the text came a character at a time
        (BYTES, "", ["and", "n"], [ord("x"), *BYTES.encode(" and")], None, "x a", True),
        # a multibyte stop string stops on its last byte and cuts no character
        (BYTES, "", ["é."], [ord("a"), 0xC3, 0xA9, ord(".")], ["", "a", "", "", "", ""], "a", True),
    ],
)
def test_a_sample_shows_whole_characters_and_ends_before_its_first_stop_string(
    tokenizer: Tokenizer, prompt: str, stop: list[str], tokens: list[int], shown: list | None, text: str, stopped: bool
) -> None:
    """What is shown: the prompt at once, then after each token, then once the sample is finished."""
    sample = SampleText(tokenizer, prompt, stop)
    pieces = [sample.unshown()]
    for token in tokens:
        sample.add(token)
        pieces.append(sample.unshown())
    sample.finish()
    pieces.append(sample.unshown())
    assert sample.text == text and "".join(pieces) == text
    assert shown is None or pieces == shown
    assert sample.stopped == stopped


def test_stop_strings_read_escapes_and_bpe_models_stop_at_end_of_text_by_default() -> None:
    assert stop_strings(["\\n\\n", "a\\tb", "\\\\n"], CHARS) == ["\n\n", "a\tb", "\\n"]
    assert stop_strings(None, BYTES) == ["<|endoftext|>"]
    assert stop_strings(["x"], BYTES) == ["x", "<|endoftext|>"]  # a document's end stops whatever else does
    assert stop_strings(None, CHARS) == []
    assert stop_strings([], BYTES) == []  # stop=[]: none at all
    with pytest.raises(ConfigError, match="stop=\\['a', ''\\] has an empty string"):
        SampleConfig(out_dir="run", stop=["a", ""])


def test_streamed_samples_arrive_as_drawn_in_order_and_read_as_the_printed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decoding draws row i's tokens in order, whatever the logits; each write is noted with the steps drawn so far."""
    rows = [chars("Hi there. x"), chars("No.xxxxxxxx"), chars("Sir ahead.x")]
    steps, calls, writes = iter(zip(*rows, strict=True)), [], []

    def next_token(self: Decoding, logits: torch.Tensor, generators: object = None) -> torch.Tensor:
        calls.append(logits.size(0))
        return torch.tensor(next(steps)).view(-1, 1)

    out = io.StringIO()

    def noted(text: str, write=out.write) -> int:
        writes.extend([(len(calls), text)] if text else [])
        return write(text)

    monkeypatch.setattr(Decoding, "next_token", next_token)
    out.write = noted
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=CHARS.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    sampler = Sampler(model, CHARS, make_runtime("cpu", "float32"))
    samples = sampler.generate(chars("A:"), 3, 11, Decoding(), stop=[".", "\n"], stream=out)
    assert out.getvalue() == "".join(s.text + SEPARATOR for s in samples)
    assert [s.text for s in samples] == ["A:Hi there", "A:No", "A:Sir ahead"]
    assert samples[1].ids == chars("A:No.")  # up to the token that stopped it
    assert calls == [3] * 10  # one batch of three, ended once every sample has stopped
    assert writes[:4] == [(0, "A:"), (1, "H"), (2, "i"), (3, " ")]  # the prompt at once, then token by token
    separators = [step for step, text in writes if text == SEPARATOR]
    assert separators == [9, 9, 10]  # the second had stopped at step 3: it is written whole after the first


def test_sample_py_streams_by_default_to_a_terminal_the_text_it_prints_piped(trained_run: Path, tmp_path: Path) -> None:
    """sample.py as its own process on a terminal streams there and writes nothing else (a whole command's stderr
    is pinned here); the same command piped, in this process, prints the same text."""
    args = [f"out_dir={trained_run}", "num_samples=3", "max_new_tokens=60", "stop=['\\n']", "seed=3"]
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "sample.py"), *args], cwd=tmp_path, stdout=terminal, stderr=subprocess.PIPE
    )
    os.close(terminal)
    shown = b""
    with contextlib.suppress(OSError):  # EIO: the terminal's other end is closed
        while chunk := os.read(controller, 4096):
            shown += chunk
    os.close(controller)
    status, err = process.wait(timeout=120), process.stderr.read()
    assert status == 0 and err == b"", err.decode()
    piped = run_in_process("sample.py", [*args, "stream=false"], cwd=tmp_path).stdout
    assert shown.decode().replace("\r\n", "\n") == piped
    samples = piped.split(SEPARATOR)
    assert len(samples) == 4 and samples[-1] == ""
    assert all(s.startswith("\n") and "\n" not in s[1:] for s in samples[:3])  # the prompt, then one line each
    assert len(set(samples[:3])) == 3  # one batch, three different samples
