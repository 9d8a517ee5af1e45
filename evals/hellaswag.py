"""HellaSwag (Zellers et al., 2019), scored as llm.c does: each ending, tokenized as " " + ending after the context,
by its tokens' summed log-likelihood (acc) or their mean (acc_norm, fair to long endings)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common.errors import DataError
from common.files import why_not_a_file
from data.prepare import DEFAULT_CACHE
from data.source import download, read_utf8
from data.tokenizers import Tokenizer
from evals.perplexity import Autocast

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHED_COPY = DEFAULT_CACHE / "hellaswag" / "hellaswag_val.jsonl"
ENDINGS = 4


@dataclass(frozen=True)
class Example:
    context: list[int]  # tokens of ctx
    endings: list[list[int]]  # tokens of " " + each ending
    label: int  # the index of the true ending


def hellaswag_path(file: str | None, key: str, cached_copy: Path = CACHED_COPY, url: str = HELLASWAG_URL) -> Path:
    """The validation set: the file named by `key` (its config key), else the cached copy, else its download."""
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise DataError(f"{key}={file} {why_not_a_file(path)}; name a HellaSwag .jsonl file (hellaswag_val.jsonl)")
        return path
    if cached_copy.is_file():
        return cached_copy
    return download(url, cached_copy, f"offline, point at a copy with {key}=PATH")


def load_examples(path: Path, tokenizer: Tokenizer) -> list[Example]:
    """Every example of the .jsonl file, tokenized."""
    examples = []
    for number, line in enumerate(read_utf8(path).split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            ctx, endings, label = fields["ctx"], fields["endings"], fields["label"]
            valid = (isinstance(ctx, str) and isinstance(label, int) and 0 <= label < ENDINGS
                     and isinstance(endings, list) and len(endings) == ENDINGS
                     and all(isinstance(end, str) for end in endings))
        except (ValueError, TypeError, KeyError):
            valid = False
        if not valid:
            raise DataError(f"{path}:{number} is not a HellaSwag example (ctx, {ENDINGS} endings, label 0 to "
                            f"{ENDINGS - 1})")
        examples.append(Example(tokenizer.encode(ctx), [tokenizer.encode(" " + end) for end in endings], label))
    if not examples:
        raise DataError(f"{path} holds no HellaSwag examples")
    return examples


@torch.no_grad()
def ending_scores(model: torch.nn.Module, example: Example, block_size: int, device: torch.device,
                  autocast: Autocast = contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean log-likelihood (float64, CPU) per ending, one forward pass; long contexts lose their start."""
    rows = [(example.context + end)[-(block_size + 1) :] for end in example.endings]
    scored = [min(len(end), len(row) - 1) for end, row in zip(example.endings, rows, strict=True)]
    width = max(map(len, rows)) - 1
    tokens = torch.zeros(len(rows), width + 1, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, count) in enumerate(zip(rows, scored, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row)  # padded on the right: causal attention never sees the padding
        mask[i, len(row) - 1 - count : len(row) - 1] = True
    tokens, mask = tokens.to(device), mask.to(device)
    with autocast():
        logits, _ = model(tokens[:, :-1])
    log_likelihood = -F.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none").double()
    sums = (log_likelihood * mask).sum(dim=1).cpu()
    return sums, sums / torch.tensor(scored, dtype=torch.float64)


def hellaswag_sums(model: torch.nn.Module, examples: Iterable[tuple[Example, bool]], block_size: int,
                   device: torch.device, autocast: Autocast = contextlib.nullcontext) -> torch.Tensor:
    """Correct by summed log-likelihood, correct by mean, and examples counted (a sum, so that processes' shares
    add up; an uncounted example still runs its forward pass, as FSDP2's ranks must run as many)."""
    sums = torch.zeros(3, dtype=torch.float64)
    for example, counted in examples:
        total, mean = ending_scores(model, example, block_size, device, autocast)
        if counted:
            sums += torch.tensor([total.argmax() == example.label, mean.argmax() == example.label, 1]).double()
    return sums
