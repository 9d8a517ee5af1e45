"""train.dtype=bfloat16 on CPU: autocast's bfloat16 matmuls (native on CPUs with AVX512-BF16 or AMX, emulated
elsewhere) train to float32's loss within a stated tolerance, with AdamW and with Muon, whose Newton-Schulz then
runs in bfloat16. Exact resume in bfloat16: tests/test_crash_safety.py. train.dtype=auto on a CPU: bfloat16 where this
CPU computes it natively and the model's step measures clearly faster in it (training/machine.py)."""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
from pathlib import Path

import pytest
import torch

from common.runtime import make_runtime
from conftest import compose_config, tiny_run_overrides
from model import GPT, GPTConfig
from model.checkpoint import CKPT_NAME, load_checkpoint
from training import machine as precision
from training import run
from training.distributed import World
from training.machine import Peak, choose_cpu_dtype
from training.run import train

TOLERANCE = 0.01  # relative, on the val loss after 40 iterations (measured: 1e-5 on this CPU)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bfloat16_trains_to_float32s_val_loss(tmp_path: Path, corpus_path: Path, optimizer: str) -> None:
    losses = {}
    for dtype in ("float32", "bfloat16"):
        extra = {"train.dtype": dtype, "train.optimizer": optimizer, "train.max_iters": 40, "train.eval_interval": 20}
        losses[dtype] = train(compose_config(tiny_run_overrides(tmp_path / dtype, corpus_path, **extra))).val_loss
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=TOLERANCE)
    assert losses["bfloat16"] != losses["float32"]  # bfloat16 really ran: not the very same numbers


@pytest.fixture(autouse=True)
def _nothing_remembered(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test measures (or stands in for a measurement) afresh."""
    monkeypatch.setenv(precision.CACHE_ENV, str(tmp_path_factory.mktemp("machine") / "machine.json"))


def _native_bf16(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """What torch says of this CPU's bfloat16 arithmetic (Runtime.emulated asks it)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


def _timings(monkeypatch: pytest.MonkeyPatch, fp32_s: float, bf16_s: float) -> list[int]:
    """measure_step_seconds answering given times (the decision is what's tested here; the measurement itself is
    test_the_measurement_times_both_precisions_and_leaves_no_trace's); the list counts its calls."""
    calls: list[int] = []

    def measured(model: GPT, batch_size: int) -> dict[str, float]:
        calls.append(batch_size)
        return {"float32": fp32_s, "bfloat16": bf16_s}

    monkeypatch.setattr(precision, "measure_step_seconds", measured)
    return calls


def _auto_run(tmp_path: Path, corpus_path: Path, **extra: object) -> list[str]:
    return tiny_run_overrides(tmp_path, corpus_path, **{"train.dtype": "auto", "train.max_iters": 10, **extra})


def _no_peak_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """MFU's peak from a stand-in: a CPU made to look native here may emulate bf16, and timing its 1024^3
    matmuls then takes seconds."""
    monkeypatch.setattr(run, "peak_flops", lambda device, dtype: Peak(1e12, "datasheet stand-in"))


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype=auto")]


def test_auto_on_a_native_bf16_cpu_trains_in_the_faster_precision_says_so_and_resumes_in_it(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="train")
    _native_bf16(monkeypatch, True)
    _no_peak_measured(monkeypatch)
    calls = _timings(monkeypatch, fp32_s=0.060, bf16_s=0.041)
    train(compose_config(_auto_run(tmp_path, corpus_path)))
    assert calls == [8]  # once, at the run's micro-batch
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).dtype == "bfloat16"
    assert _said(caplog) == [
        "dtype=auto: bfloat16, measured on this CPU: a micro-batch's forward and backward took 41 ms in bfloat16 "
        "autocast against 60 ms in float32 (train.dtype=float32 to keep full precision)"
    ]
    assert any("device cpu, bfloat16" in r.getMessage() for r in caplog.records)

    # Resumed, it keeps the precision it trained in, whatever a new measurement would say: an exact resume.
    caplog.clear()
    calls = _timings(monkeypatch, fp32_s=0.030, bf16_s=0.066)
    train(
        compose_config(
            _auto_run(tmp_path, corpus_path, resume=True, resume_with_changes=True, **{"train.max_iters": 20})
        )
    )
    assert calls == []
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).dtype == "bfloat16"
    assert _said(caplog) == ["dtype=auto: bfloat16, the precision this run trained in"]

    # On a CPU that emulates bfloat16 it can't keep it, and says so.
    caplog.clear()
    _native_bf16(monkeypatch, False)
    longer = {"train.max_iters": 30}
    train(compose_config(_auto_run(tmp_path, corpus_path, resume=True, resume_with_changes=True, **longer)))
    assert calls == []
    assert _said(caplog) == ["dtype=auto: float32 on this CPU (the run trained in bfloat16)"]
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).dtype == "float32"


def test_auto_resumes_a_checkpoint_that_predates_the_record_in_float32(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before ckpt.pt recorded its precision, auto trained in float32 on every CPU: such a run goes on in it."""
    caplog.set_level(logging.INFO, logger="train")
    train(compose_config(_auto_run(tmp_path, corpus_path, **{"train.dtype": "float32"})))
    path = tmp_path / "run" / CKPT_NAME
    raw = torch.load(path, weights_only=True)
    del raw["dtype"]
    torch.save(raw, path)
    _native_bf16(monkeypatch, True)
    calls = _timings(monkeypatch, fp32_s=0.060, bf16_s=0.010)
    longer = {"train.max_iters": 20}
    train(compose_config(_auto_run(tmp_path, corpus_path, resume=True, resume_with_changes=True, **longer)))
    assert calls == []
    assert _said(caplog) == ["dtype=auto: float32, as auto meant on CPUs when this run's checkpoint was written"]


def test_a_real_measurement_leaves_the_run_as_float32_would_have_trained_it(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The measurement runs on the model the run then trains (dropout drawing, blocks recomputed) and must leave
    nothing behind: with float32 chosen (BF16_MARGIN 0), the run's numbers are float32's bit for bit."""
    caplog.set_level(logging.INFO, logger="train")
    _native_bf16(monkeypatch, True)
    _no_peak_measured(monkeypatch)
    monkeypatch.setattr(precision, "BF16_MARGIN", 0.0)
    extra = {"model.dropout": 0.1, "train.activation_checkpointing": True}
    auto = train(compose_config(_auto_run(tmp_path / "auto", corpus_path, **extra)))
    plain = train(compose_config(_auto_run(tmp_path / "fp32", corpus_path, **extra, **{"train.dtype": "float32"})))
    (said,) = _said(caplog)
    assert said.startswith("dtype=auto: float32, measured on this CPU")
    assert auto.val_loss == plain.val_loss
    weights = [load_checkpoint(tmp_path / run / "run" / CKPT_NAME).model for run in ("auto", "fp32")]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[1])


@pytest.mark.parametrize(
    ("bf16_s", "chosen"), [(0.066, torch.float32), (0.058, torch.float32), (0.056, torch.bfloat16)]
)
def test_auto_takes_bf16_only_when_it_is_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, bf16_s: float, chosen: torch.dtype
) -> None:
    _native_bf16(monkeypatch, True)
    _timings(monkeypatch, fp32_s=0.060, bf16_s=bf16_s)  # 0.058: within BF16_MARGIN of float32, noise
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16))
    runtime, note = choose_cpu_dtype(model, 4, "auto", make_runtime("cpu", "auto"), World())
    assert runtime.dtype == chosen
    assert note is not None and note.startswith(f"dtype=auto: {str(chosen).removeprefix('torch.')}, measured")


@pytest.mark.parametrize(("asked", "device_native"), [("auto", False), ("float32", True), ("bfloat16", True)])
def test_nothing_is_measured_where_there_is_no_choice(
    monkeypatch: pytest.MonkeyPatch, asked: str, device_native: bool
) -> None:
    _native_bf16(monkeypatch, device_native)
    calls = _timings(monkeypatch, fp32_s=0.060, bf16_s=0.010)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16))
    runtime, note = choose_cpu_dtype(model, 4, asked, make_runtime("cpu", asked), World())
    assert (calls, note) == ([], None)
    assert runtime.dtype == (torch.float32 if asked == "auto" else getattr(torch, asked))


def test_the_measurement_times_both_precisions_and_leaves_no_trace() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)).eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    seconds = precision.measure_step_seconds(model, 4)
    assert set(seconds) == {"float32", "bfloat16"} and all(s > 0 for s in seconds.values())
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew in a forked stream: the run's masks are its own
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_a_measurement_is_remembered_for_this_machine_and_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing times the machine at every start: a shape measured once is read back, another is measured, and a
    damaged cache is measured again."""
    _native_bf16(monkeypatch, True)
    calls = _timings(monkeypatch, fp32_s=0.060, bf16_s=0.030)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16))
    for _ in range(2):
        runtime, note = choose_cpu_dtype(model, 4, "auto", make_runtime("cpu", "auto"), World())
        assert runtime.dtype == torch.bfloat16 and "30 ms in bfloat16 autocast against 60 ms" in note
    assert calls == [4]
    choose_cpu_dtype(model, 8, "auto", make_runtime("cpu", "auto"), World())  # another micro-batch
    assert calls == [4, 8]
    cache = Path(os.environ[precision.CACHE_ENV])
    assert len(json.loads(cache.read_text())) == 2
    cache.write_text("{not json")
    choose_cpu_dtype(model, 4, "auto", make_runtime("cpu", "auto"), World())
    assert calls == [4, 8, 4] and len(json.loads(cache.read_text())) == 1


def test_the_matmul_peak_is_measured_once_per_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    monkeypatch.setattr(precision, "measure_matmul_flops", lambda device, dtype: calls.append(dtype) or 2e12)
    for _ in range(2):
        peak = precision.peak_flops(torch.device("cpu"), torch.float32)
        assert (peak.flops, peak.source, peak.measured) == (2e12, "measured float32 matmul", True)
    assert calls == [torch.float32]
    precision.remember_higher_peak(torch.device("cpu"), torch.float32, 3e12)  # training passed it (a busy start)
    assert precision.peak_flops(torch.device("cpu"), torch.float32).flops == 3e12 and calls == [torch.float32]
    cache = Path(os.environ[precision.CACHE_ENV])
    entries = json.loads(cache.read_text())
    assert all(key.startswith("cpu: ") for key in entries)  # the device type: an MPS peak is no CPU's
    cache.write_text(json.dumps({key: {"flops": "fast"} for key in entries}))  # edited by hand: not a figure
    assert precision.peak_flops(torch.device("cpu"), torch.float32).flops == 2e12 and len(calls) == 2


def test_processes_starting_together_measure_once_and_choose_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's jobs side by side once measured at the same moment and chose different precisions for one shape.
    Measuring takes turns: a process that waited for another's measurement reads its figures instead of timing a
    machine the other just loaded."""
    import filelock

    cache = Path(os.environ[precision.CACHE_ENV])
    key = precision._key("a step of x", torch.device("cpu"))
    calls: list[str] = []
    result: dict[str, float] = {}
    other = filelock.FileLock(f"{cache}.lock")
    other.acquire()  # another process is measuring

    def measure() -> dict[str, float]:
        calls.append("measured")
        return {"a": 1.0}

    def start() -> None:
        result.update(precision.remembered("a step of x", torch.device("cpu"), measure, ("a",)))

    waiting = threading.Thread(target=start)
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive() and not calls  # it waits for the lock rather than measuring too
    cache.write_text(json.dumps({key: {"a": 2.0}}))  # the other's figures
    other.release()
    waiting.join(timeout=30)
    assert result == {"a": 2.0} and calls == []
