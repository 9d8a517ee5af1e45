"""A sample's text as its tokens arrive: whole characters only, ended by the first stop string, shown as it grows.

A BPE token's bytes may end inside a character (GPT-2 splits many emoji and CJK characters across tokens), so a
token is not always text. The bytes go through an incremental UTF-8 decoder, which keeps an unfinished character
until its last byte arrives; bytes that can never be a character become U+FFFD, as in tokenizer.decode. A sample
cut short by max_new_tokens in the middle of a character ends before it.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from typing import TextIO

from data.tokenizers import Tokenizer

ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
SEPARATOR = "\n---------------\n"  # after each sample, as nanoGPT's sample.py prints them


def stop_strings(stop: Sequence[str] | None, tokenizer: Tokenizer) -> list[str]:
    r"""The config's stop strings with \n, \t and \\ read as a newline, a tab and a backslash (Hydra's command
    line passes them as typed), and the tokenizer's end of text (<|endoftext|> for GPT-2's BPE) if it has one:
    a document ends there whatever else stops it. stop=[]: none at all."""
    if stop is not None and not stop:
        return []
    unescaped = [re.sub(r"\\([nt\\])", lambda m: ESCAPES[m.group(1)], s) for s in stop or ()]
    end = tokenizer.end_of_text
    return unescaped + ([end] if end and end not in unescaped else [])


class SampleText:
    """The prompt's text, then the generated text up to (not including) the first stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt: str, stop: Sequence[str] = ()) -> None:
        self._token_bytes = tokenizer.token_bytes
        self._stop = list(stop)
        self._longest = max(map(len, self._stop), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._start = len(prompt)  # stop strings are looked for in the generated text only
        self._shown = 0
        self.text = prompt
        self.stopped = False  # a stop string appeared
        self.finished = False  # stopped, or no more tokens will come

    def add(self, token: int) -> None:
        """One more generated token; none are taken once the sample is finished."""
        if self.finished:
            return
        searched = max(self._start, len(self.text) - self._longest + 1)  # a stop string may end in the new text
        self.text += self._decoder.decode(self._token_bytes(token))
        found = [(i + len(s), i) for s, i in ((s, self.text.find(s, searched)) for s in self._stop) if i >= 0]
        if found:  # the stop string completed first, as if the text had come a character at a time
            self.text = self.text[: min(found)[1]]
            self.stopped = self.finished = True

    def finish(self) -> None:
        """No more tokens: the text held back as a possible stop string's start is final."""
        self.finished = True

    def unshown(self) -> str:
        """The text not handed out before that no later token can change: all of it once finished, otherwise all
        but a tail that could still grow into a stop string."""
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        piece = self.text[self._shown : end]
        self._shown = end
        return piece

    def _held_back(self) -> int:
        """The length of the longest tail of the generated text that is the start of a stop string."""
        for n in range(min(self._longest - 1, len(self.text) - self._start), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0


class InOrder:
    """Writes samples that grow side by side (one batch) one after another: the first as it is generated; each
    next one, once the one before is finished, all it has so far at once, then as it grows."""

    def __init__(self, out: TextIO, samples: Sequence[SampleText]) -> None:
        self.out = out
        self.samples = samples
        self.current = 0

    def write(self) -> None:
        while self.current < len(self.samples):
            sample = self.samples[self.current]
            self.out.write(sample.unshown())
            if not sample.finished:
                break
            self.out.write(SEPARATOR)
            self.current += 1
        self.out.flush()
