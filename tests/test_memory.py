"""Memory: bench.py's prediction of a training step's peak against the tensor bytes measured, and the commands that
refuse, before allocating, what can't fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import memory
from model import GPTConfig


@pytest.mark.parametrize(
    "probe",
    [  # (n_layer, n_embd, block_size, batch_size, checkpointing, vocab_size, bf16, compiled)
        (2, 64, 128, 8, 0, 2048, 0, 0),  # a vocabulary whose logits dominate
        (4, 64, 128, 8, 0, 65, 1, 0),  # the blocks dominate, under bf16 autocast
        (4, 64, 128, 8, 1, 65, 0, 0),  # checkpointed
        (2, 64, 128, 8, 1, 2048, 1, 0),
    ],
)
def test_the_predicted_peak_is_within_10_percent_of_the_measured_tensor_bytes(probe: tuple[int, ...]) -> None:
    """Two AdamW steps on CPU: the peak of live tensor bytes, from every allocation and free the profiler records."""
    row = memory.probe_row(probe, "cpu")
    assert 0.9 <= row["predicted_over_measured"] <= 1.1, row


def test_checkpointing_fits_larger_batches_and_the_largest_batch_fits() -> None:
    """A batch fits when its predicted tensors, with the allocator's reserve, and the CUDA context fit the GPU."""
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False)
    gpu = 20 * 2**30
    plain, checkpointed = (memory.largest_batch(gpt2, gpu, True, ck) for ck in (False, True))
    assert 0 < plain < checkpointed
    for batch, ck in ((plain, False), (checkpointed, True)):
        fits, one_more = (memory.training_memory(gpt2, b, True, ck) * memory.RESERVED_OVER_ALLOCATED
                          + memory.CUDA_CONTEXT for b in (batch, batch + 1))
        assert fits <= gpu < one_more
    assert memory.largest_batch(gpt2, 2**30, True, True) == 0  # the weights and AdamW's state alone take 1.5 GiB


def test_an_absurd_model_is_one_line_from_the_command_line(tmp_path: Path, corpus_path: Path) -> None:
    from conftest import run_in_process

    args = [f"data.input={corpus_path}", f"data.dir={tmp_path / 'data'}", "model.n_embd=65536", "model.n_layer=64"]
    result = run_in_process("train.py", [*args, "device=cpu", f"out_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and " GiB" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_sampling_refuses_more_samples_than_fit(trained_run: Path, tmp_path: Path) -> None:
    """sample.py num_samples=10000000 once took 7.5 GB before it was stopped: each sample has a KV cache."""
    from conftest import run_in_process

    result = run_in_process("sample.py", [f"out_dir={trained_run}", "num_samples=10000000", "max_new_tokens=5"],
                            tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: num_samples=10000000 needs about ") and "; lower num_samples" in (
        result.stderr
    )


def test_evaluation_scores_in_passes_that_fit(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """eval.py batch_size=100000 on GPT-2's vocabulary once took 5 GB: the batch is lowered to what fits in half the
    memory (the sums are the same in more passes), and a single window that can't fit is refused."""
    import common.runtime
    from common.errors import ConfigError
    from inference.eval_run import _fitting_batch

    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=2, n_head=2, n_embd=64)
    per_window = 1024 * (16 * 50257 + 64 * 64)
    monkeypatch.setattr(common.runtime, "memory_bytes", lambda device: 2 * 10 * per_window)
    monkeypatch.setattr("inference.eval_run.memory_bytes", lambda device: 2 * 10 * per_window)
    assert _fitting_batch(100_000, config, 1024, torch.device("cpu")) == 10
    assert "batch_size=100000 windows don't fit in memory; scoring 10 a pass" in capsys.readouterr().err
    assert _fitting_batch(4, config, 1024, torch.device("cpu")) == 4
    monkeypatch.setattr(common.runtime, "memory_bytes", lambda device: per_window // 2)
    with pytest.raises(ConfigError, match="^one window of context=1024 needs about .*; lower context$"):
        _fitting_batch(4, config, 1024, torch.device("cpu"))
