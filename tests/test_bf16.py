"""train.dtype=bfloat16 on CPU: autocast's bfloat16 matmuls (native on CPUs with AVX512-BF16 or AMX, emulated
elsewhere) train to float32's loss within a stated tolerance, with AdamW and with Muon, whose Newton-Schulz then
runs in bfloat16. Exact resume in bfloat16: tests/test_crash_safety.py. train.dtype=auto: bfloat16 on CUDA GPUs that
have it, float32 everywhere else (bfloat16 on a CPU is asked for); MFU only against a known peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.runtime import make_runtime
from conftest import compose_config, tiny_run_overrides
from model.gpt import CKPT_NAME, load_checkpoint
from training.run import train
from training.trainer import METRICS_NAME

TOLERANCE = 0.01  # relative, on the val loss after 40 iterations (measured: 1e-5 on this CPU)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bfloat16_trains_to_float32s_val_loss(tmp_path: Path, corpus_path: Path, optimizer: str) -> None:
    losses = {}
    for dtype in ("float32", "bfloat16"):
        extra = {"train.dtype": dtype, "train.optimizer": optimizer, "train.max_iters": 40, "train.eval_interval": 20}
        losses[dtype] = train(compose_config(tiny_run_overrides(tmp_path / dtype, corpus_path, **extra))).val_loss
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=TOLERANCE)
    assert losses["bfloat16"] != losses["float32"]  # bfloat16 really ran: not the very same numbers


def test_auto_trains_a_cpu_run_in_float32_with_mfu_only_against_a_peak_it_is_given(
    tmp_path: Path, corpus_path: Path
) -> None:
    assert make_runtime("cpu", "auto").dtype == torch.float32
    extra = {"train.dtype": "auto", "train.max_iters": 20, "train.log_interval": 10}
    result = train(compose_config(tiny_run_overrides(tmp_path / "auto", corpus_path, **extra)))
    assert result.dtype == "float32" and load_checkpoint(result.out_dir / CKPT_NAME).dtype == "float32"
    lines = [json.loads(line) for line in (result.out_dir / METRICS_NAME).read_text().splitlines()]
    assert not any("mfu" in line for line in lines)
    assert {"device": "cpu", "train.dtype": "float32"}.items() <= lines[0]["settings"].items()

    peak = {"train.peak_tflops": 0.5}
    given = train(compose_config(tiny_run_overrides(tmp_path / "peak", corpus_path, **extra, **peak)))
    flops_per_token = load_checkpoint(given.out_dir / CKPT_NAME).build_model().flops_per_token()
    timed = [json.loads(line) for line in (given.out_dir / METRICS_NAME).read_text().splitlines()]
    timed = [line for line in timed if "tokens_per_sec" in line]
    assert timed
    for line in timed:
        assert line["mfu"] == pytest.approx(flops_per_token * line["tokens_per_sec"] / 0.5e12)
