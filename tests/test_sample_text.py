"""sample.py's text: whole characters only, stop strings, streaming in order, batched samples."""

from __future__ import annotations

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
from data.tokenizers import BpeTokenizer, CharTokenizer
from inference.sampling import MAX_NEW_TOKENS, SEPARATOR, SampleConfig, Sampler, SampleText, stop_strings
from model import GPT, GPTConfig
from model.gpt import Decoding

CHARS = CharTokenizer(sorted(set("\n !.:ABDEHNORST") | set("abcdefghijklmnopqrstuvwxyz")))
BYTES = BpeTokenizer(tiny_encoding())  # ids 0-255 are the single bytes; then merges; then <|endoftext|>
EOT = BYTES.encoding.eot_token


def chars(text: str) -> list[int]:
    return CHARS.encode(text)


def fed(sample: SampleText, tokens: list[int]) -> list[str]:
    """What is shown after each token."""
    shown = []
    for token in tokens:
        sample.add(token)
        shown.append(sample.unshown())
    return shown


def test_a_character_split_across_tokens_is_shown_whole_once_its_last_byte_arrives() -> None:
    sample = SampleText(BYTES, "")
    assert fed(sample, [ord("a"), 0xC3, 0xA9, ord("!")]) == ["a", "", "é", "!"]  # é is C3 A9: no garbage between
    assert sample.text == "aé!"


def test_a_sample_cut_inside_a_character_ends_before_it_and_bad_bytes_read_as_decode_reads_them() -> None:
    sample = SampleText(BYTES, "")
    fed(sample, [ord("a"), 0xE2, 0x82])  # the first two bytes of €
    sample.finish()
    assert sample.unshown() == "" and sample.text == "a"
    broken = SampleText(BYTES, "")
    fed(broken, [0xFF, ord("b")])  # a byte that is never UTF-8
    assert broken.text == BYTES.decode([0xFF, ord("b")]) == "\ufffdb"


def test_a_stop_string_across_tokens_ends_the_sample_before_it_and_none_of_it_is_shown() -> None:
    sample = SampleText(CHARS, "ROMEO:", ["END"])
    assert sample.unshown() == "ROMEO:"
    assert fed(sample, chars("xEN")) == ["x", "", ""]  # E and N might begin END: held back
    assert not sample.finished
    sample.add(chars("D")[0])
    assert sample.finished and sample.stopped and sample.text == "ROMEO:x" and sample.unshown() == ""
    sample.add(chars("a")[0])  # a finished sample takes no more tokens
    assert sample.text == "ROMEO:x"


def test_a_held_back_start_that_turns_out_not_to_be_a_stop_string_is_shown() -> None:
    sample = SampleText(CHARS, "", ["END", "\n\n"])
    assert fed(sample, chars("EN\nx")) == ["", "", "EN", "\nx"]  # each part shown once it can be no stop
    sample.finish()
    assert not sample.stopped


def test_the_earliest_stop_string_wins_and_one_in_the_prompt_does_not_count() -> None:
    sample = SampleText(CHARS, "END:", ["END", "ND."])
    fed(sample, chars("a ND. END"))
    assert sample.text == "END:a "


def test_the_stop_string_completed_first_wins_however_the_tokens_cut_the_text() -> None:
    whole_word = BYTES.encode(" and")
    assert len(whole_word) == 1  # one token brings " and": both stop strings appear at once
    sample = SampleText(BYTES, "", ["and", "n"])
    fed(sample, [ord("x"), *whole_word])
    assert sample.text == "x a"  # "n" is complete before "and" is, as it would be a character at a time


def test_a_multibyte_stop_string_stops_on_its_last_byte_and_cuts_no_character() -> None:
    sample = SampleText(BYTES, "", ["é."])
    assert fed(sample, [ord("a"), 0xC3, 0xA9]) == ["a", "", ""]
    sample.add(ord("."))
    assert sample.stopped and sample.text == "a"


def test_stop_strings_read_escapes_and_bpe_models_stop_at_end_of_text_by_default() -> None:
    assert stop_strings(["\\n\\n", "a\\tb", "\\\\n"], CHARS) == ["\n\n", "a\tb", "\\n"]
    assert stop_strings(None, BYTES) == ["<|endoftext|>"]
    assert stop_strings(["x"], BYTES) == ["x", "<|endoftext|>"]  # a document's end stops whatever else does
    assert stop_strings(None, CHARS) == []
    assert stop_strings([], BYTES) == []  # stop=[]: none at all
    with pytest.raises(ConfigError, match="stop=\\['a', ''\\] has an empty string"):
        SampleConfig(out_dir="run", stop=["a", ""])


def scripted(monkeypatch: pytest.MonkeyPatch, rows: list[list[int]]) -> list[int]:
    """Decoding.next_token draws row i's tokens in order, whatever the logits; returns the calls made."""
    steps = iter(zip(*rows, strict=True))
    calls: list[int] = []

    def next_token(self: Decoding, logits: torch.Tensor, generators: object = None) -> torch.Tensor:
        calls.append(logits.size(0))
        return torch.tensor(next(steps)).view(-1, 1)

    monkeypatch.setattr(Decoding, "next_token", next_token)
    return calls


def sampler_for(tokenizer: CharTokenizer | BpeTokenizer, block_size: int = 64) -> Sampler:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16)
    return Sampler(GPT(config).eval(), tokenizer, make_runtime("cpu", "float32"))


def test_generation_ends_once_every_sample_has_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [chars("ab.xxxxxxxx"), chars("abcde.xxxxx")]
    calls = scripted(monkeypatch, rows)
    samples = sampler_for(CHARS).generate(chars("A"), 2, 11, Decoding(), stop=["."])
    assert [s.text for s in samples] == ["Aab", "Aabcde"]
    assert [s.ids for s in samples] == [chars("Aab."), chars("Aabcde.")]  # up to the token that stopped it
    assert calls == [2] * 6  # one batch of two, six steps of eleven


def test_bpe_samples_end_at_end_of_text_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    scripted(monkeypatch, [[ord("h"), ord("i"), EOT, ord("x")]])
    sampler = sampler_for(BYTES)
    (sample,) = sampler.generate([ord("A")], 1, 4, Decoding(), stop=stop_strings(None, BYTES))
    assert sample.text == "Ahi" and sample.ids == [ord("A"), ord("h"), ord("i"), EOT]


class Recorder(io.StringIO):
    """Each write with the number of tokens drawn so far."""

    def __init__(self, calls: list[int]) -> None:
        super().__init__()
        self.calls = calls
        self.writes: list[tuple[int, str]] = []

    def write(self, text: str) -> int:
        if text:
            self.writes.append((len(self.calls), text))
        return super().write(text)


def test_streamed_samples_arrive_as_drawn_in_order_and_read_as_the_printed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = [chars("Hi there. x"), chars("No.xxxxxxxx"), chars("Sir ahead.x")]
    calls = scripted(monkeypatch, rows)
    out = Recorder(calls)
    samples = sampler_for(CHARS).generate(chars("A:"), 3, 11, Decoding(), stop=[".", "\n"], stream=out)
    assert out.getvalue() == "".join(s.text + SEPARATOR for s in samples)
    assert [s.text for s in samples] == ["A:Hi there", "A:No", "A:Sir ahead"]
    assert out.writes[:4] == [(0, "A:"), (1, "H"), (2, "i"), (3, " ")]  # the prompt at once, then token by token
    separators = [step for step, text in out.writes if text == SEPARATOR]
    assert separators == [9, 9, 10]  # the second had stopped at step 3: it is written whole after the first


def test_a_stream_shows_the_same_text_as_the_finished_sample_whatever_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sampler = sampler_for(CHARS, block_size=16)
    decoding = Decoding(temperature=1.5, top_k=None)
    torch.manual_seed(7)
    out = io.StringIO()
    streamed = sampler.generate(chars("A"), 4, 40, decoding, stop=["e", "AB"], stream=out)  # past the block, too
    assert out.getvalue() == "".join(s.text + SEPARATOR for s in streamed)
    for sample in streamed:
        whole = CHARS.decode(sample.ids)
        assert whole == sample.text or whole[len(sample.text) :] in ("e", "AB")
    torch.manual_seed(7)
    assert [s.ids for s in sampler.generate(chars("A"), 4, 40, decoding, stop=["e", "AB"])] == [
        s.ids for s in streamed
    ]  # a fixed seed: fixed samples, streamed or not


def test_sample_py_batches_with_a_fixed_seed_and_streams_the_same_text(trained_run: Path, tmp_path: Path) -> None:
    args = [f"out_dir={trained_run}", "num_samples=3", "max_new_tokens=60", "stop=['\\n']", "seed=3"]
    printed = [run_in_process("sample.py", [*args, f"stream={s}"], cwd=tmp_path) for s in ("false", "false", "true")]
    assert all(r.returncode == 0 for r in printed), printed[0].stderr
    assert printed[0].stdout == printed[1].stdout == printed[2].stdout
    samples = printed[0].stdout.split(SEPARATOR)
    assert len(samples) == 4 and samples[-1] == ""
    assert all(s.startswith("\n") and "\n" not in s[1:] for s in samples[:3])  # the prompt, then one line each
    assert len(set(samples[:3])) == 3  # one batch, three different samples


def test_sample_py_streams_by_default_to_a_terminal(trained_run: Path, tmp_path: Path) -> None:
    """sample.py as its own process on a terminal streams there and writes nothing else (a whole command's stderr
    is pinned here); the same command piped, in this process, prints the same text."""
    args = [f"out_dir={trained_run}", "num_samples=2", "max_new_tokens=30", "seed=5"]
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "sample.py"), *args], cwd=tmp_path, stdout=terminal, stderr=subprocess.PIPE
    )
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    status, err = process.wait(timeout=120), process.stderr.read()
    assert status == 0 and err == b"", err.decode()
    piped = run_in_process("sample.py", [*args, "stream=false"], cwd=tmp_path)
    assert shown.decode().replace("\r\n", "\n") == piped.stdout


def test_sample_py_refuses_a_max_new_tokens_past_its_bound_in_one_line(trained_run: Path, tmp_path: Path) -> None:
    """max_new_tokens=1e10 once started a sample that would run for days, its text filling the memory."""
    result = run_in_process("sample.py", [f"out_dir={trained_run}", "max_new_tokens=10000000000"], cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: max_new_tokens=10000000000 must be <= {MAX_NEW_TOKENS}\n"
