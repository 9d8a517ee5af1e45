"""metrics.jsonl, its one owner: one record per log or eval line, to the file, to the console (and train.log),
and to wandb; and the log line's numbers (mean loss and throughput since the last one)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.files import unless_disk_full
from common.runtime import Runtime
from data.tokenizers import Tokenizer
from model import GPT
from model.checkpoint import Progress
from model.decoding import DEFAULT_TEMPERATURE, DEFAULT_TOP_K
from training.run_lock import still_held
from training.schema import WandbConfig

log = logging.getLogger("train")
METRICS_NAME = "metrics.jsonl"


class MetricsLog:
    def __init__(self, out_dir: Path, active: bool = True, max_iters: int | None = None) -> None:
        self.path = out_dir / METRICS_NAME
        self.active = active  # False on every torchrun rank but 0
        self.max_iters = max_iters  # for the console's "iter N/MAX"
        self.wandb_run: Any = None

    def start_wandb(self, config: WandbConfig, run_config: dict[str, Any]) -> None:
        """A wandb run beside the metrics, on rank 0 when wandb.enabled (wandb isn't even imported otherwise: it is
        slow)."""
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
        still_held(self.path.parent)
        with unless_disk_full(self.path), open(self.path, "a") as f:
            f.write(json.dumps(_strict(record), allow_nan=False) + "\n")
        log.info(_readable(record, self.max_iters))
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])

    def write_settings(self, iter: int, settings: dict[str, Any]) -> None:
        """What the run resolved at start that its config leaves open (Trainer.settings), for plot.py's groups: to
        the file only."""
        if self.active:
            with open(self.path, "a") as f:
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
    """log_samples' rows: continuations of the token `first`, with sample.py's default temperature and top_k, each
    cut at the tokenizer's end of text; drawn after the last checkpoint, whose random state is already saved."""
    idx = torch.full((count, 1), first, dtype=torch.long, device=runtime.device)
    model.eval()
    with runtime.autocast():
        rows = model.generate(idx, tokens, DEFAULT_TEMPERATURE, DEFAULT_TOP_K)
    model.train()
    prompt, end = tokenizer.decode([first]), tokenizer.end_of_text
    texts = [tokenizer.decode(row[1:].tolist()) for row in rows]
    return [[prompt, prompt + (text.split(end)[0] if end else text)] for text in texts]


def forget_metrics(out_dir: Path) -> None:
    """A new run starts its own metrics: drop those of a run that died before its first checkpoint."""
    (out_dir / METRICS_NAME).unlink(missing_ok=True)


def read_records(out_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """metrics.jsonl's records, and how many of its lines are damaged (cut short by a kill, not UTF-8, not a
    record), which are left out."""
    lines = (out_dir / METRICS_NAME).read_bytes().splitlines()
    records = [record for record in map(_record, lines) if record]
    return records, len(lines) - len(records)


def drop_records_after(out_dir: Path, last_iter: int) -> None:
    """On resume: lines a killed run wrote after its last checkpoint, and damaged lines."""
    path = out_dir / METRICS_NAME
    if path.is_file():
        kept = [line + b"\n" for line in path.read_bytes().splitlines() if _record(line, last_iter)]
        path.write_bytes(b"".join(kept))  # each line ended: the next record starts on a line of its own


def _strict(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and inf as null, as strict JSON has them (a diverged run's losses); _record reads null back as NaN."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def _record(line: bytes, last_iter: float = math.inf) -> dict[str, Any] | None:
    """The line's record if it is whole and at or before last_iter; a null number (NaN when written) as NaN, and
    the bare NaN older runs wrote is read too."""
    try:
        record = json.loads(line)  # bytes: decoded as UTF-8 (a bad byte is a ValueError too)
    except ValueError:
        return None
    whole = isinstance(record, dict) and isinstance(record.get("iter"), int)
    if not whole or record["iter"] > last_iter:
        return None
    return {k: math.nan if v is None else v for k, v in record.items()}


class LogWindow:
    """The steps since the last log line: their mean loss and, excluding the first step of the process (compiling
    and warming up), training time alone, so tokens/s and MFU leave evaluation and checkpoints out."""

    def __init__(
        self,
        progress: Progress,
        tokens_per_iter: int,
        flops_per_token: float,
        peak_flops: float | None,
        remember_peak: Callable[[float], None] | None = None,
    ) -> None:
        self.first_step, self.tokens_per_iter = progress.iter, tokens_per_iter
        # peak: all processes together; None where there is none to compare with (MFU left out). remember_peak: a
        # measured one's (not a datasheet's), called with what training reaches if it ever passes the peak
        self.flops_per_token, self.peak_flops, self.remember_peak = flops_per_token, peak_flops, remember_peak
        # the losses since the last log line (a resumed run's, saved with its progress)
        self.loss_sum: torch.Tensor | float = progress.log_loss_sum
        self.steps = progress.log_steps  # applied steps (a skipped non-finite one doesn't count)
        self.seconds, self.timed = 0.0, 0

    def saved(self) -> dict[str, float | int]:
        """The Progress fields a checkpoint keeps of the line under way: a resumed run logs the same mean."""
        return {"log_loss_sum": float(self.loss_sum), "log_steps": self.steps}

    def add(self, loss: torch.Tensor | None) -> None:
        """One step's loss (0-dim, on the device: no sync here), or None for a skipped step."""
        if loss is not None:
            self.loss_sum = self.loss_sum + loss
            self.steps += 1

    def end_step(self, step: int, began: float, log_now: bool) -> tuple[float, dict[str, float]] | None:
        """Call after step `step` (0-based), begun at perf_counter() `began`. If log_now (and a step counted): the
        mean train loss and the throughput numbers (none while only the first step was run), then a new window."""
        log_now = log_now and self.steps > 0
        if log_now:
            train_loss = float(self.loss_sum) / self.steps  # waits for the GPU: timed as training
        if step != self.first_step:
            self.seconds += time.perf_counter() - began
            self.timed += 1
        if not log_now:
            return None
        throughput = {}
        if self.timed:
            tokens_per_sec = self.tokens_per_iter * self.timed / self.seconds
            throughput = {"ms_per_iter": 1000 * self.seconds / self.timed, "tokens_per_sec": tokens_per_sec}
            if self.peak_flops is not None:
                achieved = self.flops_per_token * tokens_per_sec
                if achieved > self.peak_flops and self.remember_peak is not None:  # measured on a busy CPU
                    log.warning(
                        f"MFU: training reaches {achieved / 1e12:.3g} TFLOP/s, above the {self.peak_flops / 1e12:.3g} "
                        "measured as this machine's peak (it was busier then); MFU is against it from now on"
                    )
                    self.peak_flops = achieved
                    self.remember_peak(achieved)
                throughput["mfu"] = achieved / self.peak_flops
        self.loss_sum, self.steps, self.seconds, self.timed = 0.0, 0, 0.0, 0
        return train_loss, throughput


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
