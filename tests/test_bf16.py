"""train.dtype=bfloat16 on CPU: autocast's bfloat16 matmuls (native on CPUs with AVX512-BF16 or AMX, emulated
elsewhere) train to float32's loss within a stated tolerance, with AdamW and with Muon, whose Newton-Schulz then
runs in bfloat16. Exact resume in bfloat16: tests/test_crash_safety.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import compose_config, tiny_run_overrides
from training.loop import train

TOLERANCE = 0.01  # relative, on the val loss after 40 iterations (measured: 1e-5 on this CPU)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bfloat16_trains_to_float32s_val_loss(tmp_path: Path, corpus_path: Path, optimizer: str) -> None:
    losses = {}
    for dtype in ("float32", "bfloat16"):
        extra = {"train.dtype": dtype, "train.optimizer": optimizer, "train.max_iters": 40, "train.eval_interval": 20}
        losses[dtype] = train(compose_config(tiny_run_overrides(tmp_path / dtype, corpus_path, **extra))).val_loss
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=TOLERANCE)
    assert losses["bfloat16"] != losses["float32"]  # bfloat16 really ran: not the very same numbers
