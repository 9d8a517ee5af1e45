"""Text <-> token ids: characters of the corpus, or a tiktoken BPE encoding (GPT-2's is r50k_base)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import regex
import tiktoken

from common.errors import DataError


class Tokenizer(Protocol):
    vocab_size: int
    end_of_text: str | None  # the special token that ends a document, as text ("<|endoftext|>"), if there is one
    end_of_text_id: int | None  # its id (ordinary encoding, as prompts are tokenized, would spell it in several)

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...
    def metadata(self) -> dict[str, Any]: ...
    def token_byte_lengths(self) -> np.ndarray: ...


class CharTokenizer:
    end_of_text: str | None = None  # a character vocabulary has no token that ends a document
    end_of_text_id: int | None = None

    def __init__(self, chars: list[str]) -> None:
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[c] for c in text]
        except KeyError as err:
            raise DataError(f"character {err.args[0]!r} is not in the model's vocabulary of {self.vocab_size} "
                            "characters; remove it from the text") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def token_bytes(self, token: int) -> bytes:
        return self.chars[token].encode("utf-8")

    def metadata(self) -> dict[str, Any]:
        return {"kind": "char", "chars": self.chars}

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of each token, for bits per byte: a loss that doesn't depend on the vocabulary."""
        return np.array([len(c.encode("utf-8")) for c in self.chars], dtype=np.int32)


class BpeTokenizer:
    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab
        self.end_of_text = "<|endoftext|>" if "<|endoftext|>" in encoding.special_tokens_set else None
        self.end_of_text_id = encoding.eot_token if self.end_of_text else None

    @classmethod
    def from_name(cls, name: str) -> BpeTokenizer:
        try:
            return cls(tiktoken.get_encoding(name))
        except ValueError:  # unknown encoding name
            raise DataError(f"data.tokenizer={name} is not a tiktoken encoding; use char or one of "
                            f"{', '.join(tiktoken.list_encoding_names())}") from None
        except Exception as err:  # tiktoken downloads its ranks on first use
            raise DataError(f"could not load the tiktoken encoding {name!r} ({type(err).__name__}); offline, set "
                            "TIKTOKEN_CACHE_DIR to a folder holding its ranks file named by the sha1 hex of its "
                            "URL") from None

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def pretokenizer(self) -> regex.Pattern:
        """The regex that splits text into words before BPE merges them (tiktoken's own, from its `regex`)."""
        return regex.compile(self.encoding._pat_str)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes, which may be part of a character (inference/sampling.py decodes incrementally)."""
        return self.encoding.decode_single_token_bytes(token)

    def metadata(self) -> dict[str, Any]:
        return {"kind": "bpe", "encoding": self.encoding.name}

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of each token, for bits per byte; special tokens (<|endoftext|>) and unused ids count 0."""
        lengths = np.zeros(self.vocab_size, dtype=np.int32)
        for token_bytes, token in self.encoding._mergeable_ranks.items():  # every token but the special ones
            lengths[token] = len(token_bytes)
        return lengths


def tokenizer_from_metadata(meta: Any, source: object = "meta.json") -> Tokenizer:
    """Rebuild the tokenizer a dataset or checkpoint (`source`, the file it came from) was made with."""
    if problem := metadata_problem(meta):
        raise DataError(f"{source} holds damaged tokenizer metadata ({problem}); use a file train.py wrote")
    return CharTokenizer(meta["chars"]) if meta["kind"] == "char" else BpeTokenizer.from_name(meta["encoding"])


def metadata_problem(meta: Any) -> str:
    """What makes tokenizer metadata unusable, in words ("" if nothing): read once, where it is loaded."""
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind == "bpe":
        return "" if isinstance(meta.get("encoding"), str) else "its encoding is not a name"
    if kind != "char":
        return "neither char nor bpe"
    chars = meta.get("chars")
    # a lone surrogate (\ud800-\udfff) is no character: UTF-8 can't encode it
    if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 and not "\ud800" <= c <= "\udfff"
                                              for c in chars):
        return "its chars are not a list of characters"
    return "" if chars and len(set(chars)) == len(chars) else "its chars are empty or repeated"


