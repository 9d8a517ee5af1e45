"""One record per log or eval line: to metrics.jsonl, to the console (and train.log), and to wandb."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("train")


class MetricsLog:
    def __init__(self, out_dir: Path, wandb_run: Any = None, active: bool = True) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.wandb_run = wandb_run
        self.active = active  # False on every torchrun rank but 0

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        log.info(_readable(record))
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        """A few (prompt, text) pairs as a wandb table, to see what the numbers mean."""
        import wandb

        self.wandb_run.log({"samples": wandb.Table(columns=["prompt", "sample"], data=samples)}, step=step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _readable(r: dict[str, Any]) -> str:
    if "val_loss" in r:
        line = f"step {r['iter']}: train loss {r['train_loss']:.4f}, val loss {r['val_loss']:.4f}"
        return line + f", val {r['val_bpb']:.4f} bits/byte" if "val_bpb" in r else line
    line = f"iter {r['iter']}: loss {r['train_loss']:.4f}, lr {r['lr']:.2e}"
    if "tokens_per_sec" not in r:
        return line + " (warm-up, not timed)"
    return line + f", {r['ms_per_iter']:.1f} ms/iter, {r['tokens_per_sec']:,.0f} tok/s, mfu {100 * r['mfu']:.1f}%"


def open_wandb(
    enabled: bool,
    project: str,
    entity: str | None,
    run_name: str | None,
    mode: str | None,
    tags: list[str],
    group: str | None,
    config: dict[str, Any],
    out_dir: Path,
) -> Any:
    if not enabled:
        return None
    import wandb  # imported only when asked for: it is slow to import

    return wandb.init(
        project=project,
        entity=entity,
        name=run_name,
        mode=mode,  # None: wandb follows $WANDB_MODE, online by default
        tags=list(tags),
        group=group,
        config=config,
        dir=str(out_dir),
    )
