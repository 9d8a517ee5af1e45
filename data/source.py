"""Training text: the user's file, else a cached download; read in _READ_BYTES pieces, decoded as the whole file is."""

from __future__ import annotations

import codecs
import http.client
import io
import os
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.errors import DataError
from common.files import replace_file

_READ_BYTES = 1 << 22  # 4 MiB a read: the decoded piece and its ids take a few times that


def download(url: str, cached_copy: Path, offline: str) -> Path:
    """`url` saved whole as cached_copy, or not at all; `offline`: how to do without it, for the one-line error."""
    tmp = cached_copy.with_name(f"{cached_copy.name}.{os.getpid()}.tmp")  # its own: the shared cache has no lock
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            cached_copy.parent.mkdir(parents=True, exist_ok=True)
            tmp.unlink(missing_ok=True)  # a killed download's, under a reused PID
            with open(tmp, "xb") as out:  # exclusive: never through a link planted there
                shutil.copyfileobj(response, out)
            expected = response.headers.get("Content-Length")
        if expected is not None and tmp.stat().st_size != int(expected):
            raise OSError(f"got {tmp.stat().st_size:,} of {int(expected):,} bytes")
    except (OSError, ValueError, http.client.HTTPException) as err:  # ValueError: a Content-Length not a number
        tmp.unlink(missing_ok=True)
        raise DataError(f"could not download {url} ({err}); {offline}") from None
    replace_file(tmp, cached_copy)
    return cached_copy


def read_utf8(path: Path) -> str:
    return "".join(utf8_pieces(path))


def utf8_pieces(path: Path) -> Iterator[str]:
    """The file's text (UTF-8, universal newlines) in pieces of at most _READ_BYTES bytes."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    offset = 0  # bytes read before this read
    with path.open("rb") as f:
        while True:
            data = f.read(_READ_BYTES)
            held = len(decoder.getstate()[0])  # the start of a character cut by the last read
            try:
                piece = decoder.decode(data, final=not data)
            except UnicodeDecodeError as err:  # err.start counts from the held bytes
                at = offset - held + err.start
                raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {at})") from None
            if piece:
                yield piece
            if not data:
                return
            offset += len(data)


@dataclass(frozen=True)
class TextFile:
    """A text file surveyed before it is encoded: its length and characters, and its stamp (size, mtime) to check."""

    path: Path
    length: int
    chars: frozenset[str]
    stamp: tuple[int, int]

    @classmethod
    def survey(cls, path: Path, *, chars: bool) -> TextFile:
        """Reads the whole file, so a text that is not UTF-8 fails here, before anything is written."""
        stamp = (path.stat().st_size, path.stat().st_mtime_ns)
        length, seen = 0, set()
        for piece in utf8_pieces(path):
            length += len(piece)
            if chars:
                seen.update(piece)
        return cls(path, length, frozenset(seen), stamp)

    def check_unchanged(self) -> None:
        if (self.path.stat().st_size, self.path.stat().st_mtime_ns) != self.stamp:
            raise DataError(f"{self.path} changed while it was being prepared; prepare again once nothing is "
                            "writing to it")
