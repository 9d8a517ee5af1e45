"""training/memory.py's prediction of training memory, against the model it describes and a measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from conftest import MODERN, REPO
from model import GPT, GPTConfig
from model.config import parameter_count
from training.memory import activation_bytes, largest_batch, training_memory


@pytest.mark.parametrize("options", [{}, {"bias": False}, MODERN, {**MODERN, "bias": False}, {"norm": "rmsnorm"}])
def test_the_parameter_count_is_the_models(options: dict) -> None:
    config = GPTConfig(vocab_size=65, block_size=64, n_layer=3, n_head=4, n_embd=32, **options)
    assert parameter_count(config) == GPT(config).num_params(non_embedding=False)


def test_the_predicted_activations_are_what_forward_keeps() -> None:
    config = GPTConfig(vocab_size=65, block_size=128, n_layer=3, n_head=4, n_embd=64, bias=False)
    model = GPT(config).train()
    idx = torch.randint(65, (4, 128))
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()  # q, k, v share one
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        model(idx, idx)
    predicted, _ = activation_bytes(config, 4, bf16=False, checkpointing=False)
    assert sum(kept.values()) == pytest.approx(predicted, rel=0.02)


@pytest.mark.skipif(sys.platform != "linux", reason="the measurement reads /proc/self/status")
@pytest.mark.parametrize(
    "probe",  # (n_layer, n_embd, block_size, batch_size, checkpointing, vocab_size, bf16)
    [(4, 256, 256, 32, 0, 65, 0), (8, 128, 512, 16, 1, 65, 0), (2, 128, 256, 8, 0, 50257, 1)],
)
def test_the_predicted_peak_is_within_15_percent_of_a_measured_one(probe: tuple[int, ...]) -> None:
    """bench.py's probe: two AdamW steps in a process of its own, peak RSS above the RSS before the model. GPT-2's
    vocabulary in bfloat16 too, where the head's logits and their gradients dominate."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(REPO / "bench.py"), "--memory-probe", *map(str, probe)]
    measured = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)
    n_layer, n_embd, block_size, batch_size, checkpointing, vocab, bf16 = probe
    config = GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=4, n_embd=n_embd, bias=False)
    predicted = training_memory(config, batch_size, bf16=bool(bf16), checkpointing=bool(checkpointing)).total
    assert predicted == pytest.approx(measured, rel=0.15)


def test_checkpointing_fits_larger_batches_and_the_largest_batch_fits() -> None:
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    budget = 20 * 2**30
    plain, checkpointed = (largest_batch(gpt2, budget, True, ck) for ck in (False, True))
    assert 0 < plain < checkpointed
    for batch, ck in ((plain, False), (checkpointed, True)):
        assert training_memory(gpt2, batch, True, checkpointing=ck).total <= budget
        assert training_memory(gpt2, batch + 1, True, checkpointing=ck).total > budget
    assert largest_batch(gpt2, 2**30, True, True) == 0  # the weights and AdamW's state alone take 1.9 GiB


def test_a_run_that_cannot_fit_is_refused_before_allocating(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.batch_size=10000000 once took 7.6 GB before it was killed, model.n_embd=8192 model.n_layer=4 7.1 GB;
    now the predicted peak is compared with the machine's memory before the model is built."""
    import common.runtime
    import training.memory
    from common.errors import ConfigError
    from conftest import compose_config, tiny_run_overrides
    from training.run import train

    monkeypatch.setattr(common.runtime, "memory_bytes", lambda device: 8 * 2**30)  # an 8 GiB machine
    monkeypatch.setattr(training.memory, "memory_bytes", lambda device: 8 * 2**30)
    for keys, what in [
        ({"train.batch_size": 10_000_000}, "GiB of activations at train.batch_size=10000000) needs about"),
        ({"model.n_embd": 8192, "model.n_head": 8, "model.n_layer": 4}, "GiB for 3,"),
    ]:
        with pytest.raises(ConfigError, match=r"^this run \([\d,.]+ GiB for [\d,]+ parameters, ") as refused:
            train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **keys)))
        assert what in str(refused.value) and "more than this machine's 8.0 GiB; lower train.batch_size" in str(
            refused.value
        )
        assert not (tmp_path / "run").exists()  # a refused start leaves nothing
    result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})))
    assert result.iters == 2  # what fits runs as before


def test_an_absurd_model_is_one_line_from_the_command_line(tmp_path: Path, corpus_path: Path) -> None:
    from conftest import run_script

    args = [f"data.input={corpus_path}", f"data.dir={tmp_path / 'data'}", "model.n_embd=65536", "model.n_layer=64"]
    result = run_script("train.py", [*args, "device=cpu", f"out_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: this run (") and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_sampling_refuses_more_samples_than_fit(trained_run: Path, tmp_path: Path) -> None:
    """sample.py num_samples=10000000 once took 7.5 GB before it was stopped: each sample has a KV cache."""
    from conftest import run_script

    result = run_script("sample.py", [f"out_dir={trained_run}", "num_samples=10000000", "max_new_tokens=5"], tmp_path)
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


@pytest.mark.parametrize("options", [{}, {"dropout": 0.1}, MODERN, {"n_layer": 1}, {"value_embeds": True}])
def test_the_quick_bound_is_above_every_estimate(options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_fits skips the estimate when a generous bound fits: the bound must be above it, whatever the options
    (checkpointing with one layer, dropout's masks, value embeddings' tables, bf16's weight copies)."""
    import training.memory
    from training.distributed import World
    from training.schema import OptimConfig

    seen: list[float] = []
    monkeypatch.setattr(training.memory, "_refuse_unless_it_fits", lambda *args: seen.append(1))
    for batch_size in (1, 7, 64):
        config = GPTConfig(vocab_size=50257, block_size=128, n_layer=options.get("n_layer", 3), n_head=4, n_embd=64)
        config = GPTConfig(**{**config.__dict__, **options})
        for optimizer in ("adamw", "muon"):
            for checkpointing in (False, True):
                largest = max(
                    training_memory(config, batch_size, bf16, optimizer, checkpointing).total for bf16 in (False, True)
                )
                opt = OptimConfig(batch_size=batch_size, optimizer=optimizer, activation_checkpointing=checkpointing)
                monkeypatch.setattr(training.memory, "memory_bytes", lambda device, m=largest: m - 1)
                training.memory.check_fits(config, opt, torch.device("cpu"), World())
                assert seen == [1]  # a run the estimate says can't fit is always handed to it...
                monkeypatch.setattr(training.memory, "memory_bytes", lambda device, m=largest: 100 * m)
                training.memory.check_fits(config, opt, torch.device("cpu"), World())
                assert seen == [1]  # ...and one far inside the memory never is
                seen.clear()
