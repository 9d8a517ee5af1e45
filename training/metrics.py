"""Evaluations, and metrics.jsonl (its sole writer): each log and eval line to the file, the console and wandb."""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.runtime import Runtime, open_for_appending, unless_disk_full, write_text_atomically
from data.prepare import EVAL_WINDOWS, PreparedData, TokenFiles, batch_generator, every_window, get_batch
from data.tokenizers import TextScore, Tokenizer, token_sums
from evals.hellaswag import Example, hellaswag_sums
from model import GPT
from model.gpt import DEFAULT_TEMPERATURE, DEFAULT_TOP_K
from training.distributed import World
from training.schema import OptimConfig, WandbConfig

log = logging.getLogger("train")
METRICS_NAME = "metrics.jsonl"
SPLIT_KEYS = {"train": 0, "val": 1}  # batch_generator's key for each split's own evaluation windows


class MetricsLog:
    def __init__(self, out_dir: Path, active: bool = True, max_iters: int | None = None) -> None:
        self.path = out_dir / METRICS_NAME
        self.active = active  # False on every torchrun rank but 0
        self.max_iters = max_iters  # for the console's "iter N/MAX"
        self.wandb_run: Any = None

    def start_wandb(self, config: WandbConfig, run_config: dict[str, Any]) -> None:
        """A wandb run beside the metrics (wandb is imported only here: it is slow)."""
        import wandb

        try:
            self.wandb_run = wandb.init(
                project=config.project,
                entity=config.entity,
                name=config.run_name,
                mode=config.mode,  # None: wandb follows $WANDB_MODE, online by default
                tags=list(config.tags),
                group=config.group,
                config=run_config,
                dir=str(self.path.parent),
                settings=wandb.Settings(init_timeout=config.init_timeout),
            )
        except Exception as err:  # no API key, no network, a refused login: the run matters more than its charts
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            log.warning(f"wandb did not start ({reason}); training goes on without it, metrics.jsonl has everything")

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with unless_disk_full(self.path), open_for_appending(self.path) as f:
            f.write(json.dumps(_strict(record), allow_nan=False) + "\n")
        log.info(_readable(record, self.max_iters))
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])

    def write_settings(self, iter: int, settings: dict[str, Any]) -> None:
        """What the run resolved that its config leaves open, for plot.py's groups: to the file only (rank 0's)."""
        with open_for_appending(self.path) as f:
            f.write(json.dumps({"iter": iter, "settings": settings}) + "\n")

    def log_samples(self, step: int, samples: list[list[str]]) -> None:
        """A few (prompt, text) pairs as a wandb table, to see what the numbers mean."""
        import wandb

        self.wandb_run.log({"samples": wandb.Table(columns=["prompt", "sample"], data=samples)}, step=step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def sample_table(
    model: GPT, tokenizer: Tokenizer, first: int, runtime: Runtime, count: int = 3, tokens: int = 200
) -> list[list[str]]:
    """log_samples' rows: sample.py-style continuations of `first`, cut at end of text; drawn after the RNG is saved."""
    idx = torch.full((count, 1), first, dtype=torch.long, device=runtime.device)
    model.eval()
    with runtime.autocast():
        rows = model.generate(idx, tokens, DEFAULT_TEMPERATURE, DEFAULT_TOP_K)
    model.train()
    prompt, end = tokenizer.decode([first]), tokenizer.end_of_text
    texts = [tokenizer.decode(row[1:].tolist()) for row in rows]
    return [[prompt, prompt + (text.split(end)[0] if end else text)] for text in texts]


def read_records(out_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """metrics.jsonl's records, and how many of its lines are damaged (cut short, not UTF-8) and left out."""
    lines = (out_dir / METRICS_NAME).read_bytes().splitlines()
    records = [record for record in map(_record, lines) if record]
    return records, len(lines) - len(records)


def drop_records_after(out_dir: Path, last_iter: int) -> None:
    """On resume, drop lines written after the last checkpoint and damaged ones; the file is replaced whole (atomic)."""
    path = out_dir / METRICS_NAME
    if path.is_file():
        kept = [line.decode() + "\n" for line in path.read_bytes().splitlines() if _record(line, last_iter)]
        write_text_atomically(path, "".join(kept))  # each line ended: the next record starts on a line of its own


def _strict(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and inf as null, as strict JSON has them (a diverged run's losses); _record reads null back as NaN."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def _record(line: bytes, last_iter: float = math.inf) -> dict[str, Any] | None:
    """The line's record if it is whole and at or before last_iter, null (a NaN when written) read as NaN."""
    try:
        record = json.loads(line)  # bytes: decoded as UTF-8 (a bad byte is a ValueError too)
    except (ValueError, RecursionError):  # RecursionError: brackets nested past Python's limit
        return None
    whole = isinstance(record, dict) and isinstance(record.get("iter"), int)
    if not whole or record["iter"] > last_iter:
        return None
    return {k: math.nan if v is None else v for k, v in record.items()}


def _readable(r: dict[str, Any], max_iters: int | None = None) -> str:
    if "val_loss" in r:
        line = f"step {r['iter']}: train loss {r['train_loss']:.4f}, val loss {r['val_loss']:.4f}"
        line += f", val {r['val_bpb']:.4f} bits/byte" if "val_bpb" in r else ""
        if "hellaswag_acc" in r:
            line += f", hellaswag acc {r['hellaswag_acc']:.4f} (acc_norm {r['hellaswag_acc_norm']:.4f})"
        return line
    of = f"/{max_iters}" if max_iters else ""
    line = f"iter {r['iter']}{of}: loss {r['train_loss']:.4f}, lr {r['lr']:.2e}"
    if "tokens_per_sec" not in r:
        return line + " (warm-up, not timed)"
    line += f", {r['ms_per_iter']:.1f} ms/iter, {r['tokens_per_sec']:,.0f} tok/s"
    line += f", mfu {100 * r['mfu']:.1f}%" if "mfu" in r else ""
    return line + f", ETA {_duration(r['eta_s'])}" if "eta_s" in r else line


def _duration(seconds: float) -> str:
    """3h05m, 4m12s, 37s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"

@dataclass(frozen=True)
class Losses:
    train: float
    val: float
    val_bpb: float  # val in bits per byte of text: comparable across tokenizers


@dataclass
class Evaluator:
    """Mean loss over the same eval_iters random windows of each split (full_val: every block of val), and val in
    bits per byte of text, as nanochat. Ranks split the batches and sum: the result doesn't depend on their number."""

    data: PreparedData
    train: OptimConfig
    seed: int
    block_size: int
    byte_lengths: torch.Tensor  # UTF-8 bytes of each token id (0: a special token), float64 on the device
    runtime: Runtime
    world: World

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> Losses:
        model.eval()
        train = TextScore.of(self._sums(model, self._batches("train", self.data.train)))
        val = TextScore.of(self._sums(model, self._batches("val", self.data.val)))
        model.train()
        return Losses(train.loss, val.loss, val.bpb)

    def _batches(self, split: str, files: TokenFiles) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if split == "val" and self.train.full_val:
            # The result doesn't depend on the batch size; bigger batches keep small models' matmuls efficient.
            windows = max(self.train.batch_size, 4096 // self.block_size)  # at least 4096 tokens a batch
            return every_window(files, windows, self.block_size)
        generator = batch_generator(self.seed, EVAL_WINDOWS, SPLIT_KEYS[split])
        batch_size = self.train.batch_size
        return (get_batch(files, batch_size, self.block_size, generator) for _ in range(self.train.eval_iters))

    def _sums(self, model: torch.nn.Module, batches: Iterator) -> list[float]:
        """Nats and count of all target tokens; nats and UTF-8 bytes of the text ones; over all ranks."""
        sums = torch.zeros(4, dtype=torch.float64, device=self.runtime.device)
        for x, y, counted in split_across_ranks(batches, self.world):
            with self.runtime.autocast():
                logits, _ = model(x.to(self.runtime.device))
            if counted:
                sums += token_sums(logits, y.to(self.runtime.device), self.byte_lengths)
        return self.world.all_reduce_sum(sums).tolist()


def split_across_ranks(items: Iterator[tuple], world: World) -> Iterator[tuple]:
    """This rank's every world.size-th item, flagged True; one repeated, flagged False, to keep FSDP2 in step."""
    while round_ := list(itertools.islice(items, world.size)):
        mine = world.rank < len(round_)
        yield (*round_[world.rank if mine else 0], mine)


@dataclass
class HellaSwagEval:
    """HellaSwag accuracy at evaluations whose iteration is a multiple of `every`; ranks split the examples and sum."""

    examples: list[Example]
    every: int
    block_size: int
    runtime: Runtime
    world: World

    def due(self, iteration: int) -> bool:
        return iteration % self.every == 0

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        model.eval()
        shares = split_across_ranks(((example,) for example in self.examples), self.world)
        sums = hellaswag_sums(model, shares, self.block_size, self.runtime.device, self.runtime.autocast)
        model.train()
        correct, correct_norm, count = self.world.all_reduce_sum(sums.to(self.runtime.device)).tolist()
        return {"hellaswag_acc": correct / count, "hellaswag_acc_norm": correct_norm / count}
