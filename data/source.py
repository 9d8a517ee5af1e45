"""Where the training text comes from: the user's file, then a cached copy, then a download."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from data.errors import DataError


def input_file(input_path: str) -> Path:
    path = Path(input_path).expanduser()
    if not path.is_file():
        raise DataError(
            f"data.input={input_path} does not exist; pass a UTF-8 text file or a directory of .txt / .jsonl documents"
        )
    return path


def read_text(input_path: str | None, cached_copy: Path, url: str | None) -> str:
    if input_path:
        return read_utf8(input_file(input_path))
    if cached_copy.is_file():
        return read_utf8(cached_copy)
    if not url:
        raise DataError("no text to train on: pass data.input=/path/to/text.txt")
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            raw = response.read()
    except OSError as err:
        raise DataError(
            f"could not download {url} ({err}); point at a local copy with data.input=/path/to/text.txt"
        ) from None
    cached_copy.parent.mkdir(parents=True, exist_ok=True)
    cached_copy.write_bytes(raw)
    return raw.decode("utf-8")


def read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
