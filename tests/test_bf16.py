"""train.dtype=bfloat16 on CPU trains to float32's loss within a stated tolerance, with AdamW and with Muon; auto is
bfloat16 only on CUDA GPUs that have it. Exact resume in bfloat16: tests/test_crash_safety.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.files import CKPT_NAME, METRICS_NAME
from common.runtime import make_runtime
from conftest import compose_config, tiny_run_overrides
from model.checkpoint import load_checkpoint
from train import train

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
    for name, peak in (("auto", {}), ("peak", {"train.peak_tflops": 0.5})):
        result = train(compose_config(tiny_run_overrides(tmp_path / name, corpus_path, **extra, **peak)))
        checkpoint = load_checkpoint(result.out_dir / CKPT_NAME)
        assert result.dtype == "float32" and checkpoint.dtype == "float32"
        lines = [json.loads(line) for line in (result.out_dir / METRICS_NAME).read_text().splitlines()]
        assert {"device": "cpu", "train.dtype": "float32"}.items() <= lines[0]["settings"].items()
        timed = [line for line in lines if "tokens_per_sec" in line]
        flops_per_token = checkpoint.build_model().flops_per_token()
        for line in timed:
            mfu = flops_per_token * line["tokens_per_sec"] / 0.5e12
            assert line.get("mfu") == (pytest.approx(mfu) if peak else None)
        assert timed
