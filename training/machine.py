"""What a run needs to know of the machine, measured once and remembered, never at every start: the precision that
trains a model shape faster on this CPU (train.dtype=auto) and the matmul peak that MFU is measured against where
no datasheet has one. The flags can't decide the precision: bf16 autocast was 9% faster end to end on a Zen 4
CPU and 15% slower per step on an Intel Xeon with AMX (docs/gpu.md).

The figures live in ~/.cache/gpt-lab/machine.json ($GPT_LAB_MACHINE_CACHE names another file; delete it to
measure again), keyed by what they depend on: the device type and processor, torch's version, the threads and,
for a step's time, the model's shape and the micro-batch. Processes that start together (a sweep's jobs side by
side) take turns measuring, through machine.json.lock beside it, so they choose alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import torch

from common.files import write_text_atomically
from common.runtime import Runtime, dtype_name, synchronize
from model import GPT
from training.distributed import World

CACHE_ENV = "GPT_LAB_MACHINE_CACHE"
TIMED_STEPS = 2  # per precision, after one warm-up step each; alternating, so a busy moment slows both
PRECISIONS = ("float32", "bfloat16")  # what dtype=auto chooses between on a CPU
BF16_MARGIN = 0.95  # bfloat16 only when its step takes under 95% of float32's: timing noise isn't worth its rounding
# Dense (no sparsity) tensor-core peaks in FLOP/s: (bf16/fp16, tf32), from NVIDIA's datasheets. Matched against
# torch.cuda.get_device_name(), as whole words, most specific first; others get a measured peak.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835e12, 417.5e12),
    ("H200", 989e12, 494.5e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12),
    ("H100", 989e12, 494.5e12),
    ("A100", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 60e12),
    ("RTX 4090", 165e12, 82.6e12),
)


@dataclass(frozen=True)
class Peak:
    flops: float
    source: str  # what the figure is: "datasheet H100 bf16" or "measured fp32 matmul"

    @property
    def measured(self) -> bool:
        """Measured here (a CPU, an unknown GPU), not a datasheet's figure."""
        return self.source.startswith("measured")


def remembered(
    what: str, device: torch.device, measure: Callable[[], dict[str, float]], names: tuple[str, ...]
) -> dict[str, float]:
    """measure()'s figures (`names`) for `what` on this machine: from the cache, or measured now and kept there. An
    entry that isn't those figures as positive numbers (damaged, edited) is measured again."""
    key = _key(what, device)
    figures = _read_cache().get(key)
    if not _whole(figures, names):
        with _one_at_a_time():  # a sweep's jobs side by side: the first measures, the others then read its figures
            known = _read_cache()
            figures = known.get(key)
            if not _whole(figures, names):
                figures = known[key] = measure()
                _write_cache(known)
    return figures


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    """Processes that measure take turns (a file lock beside the cache), so the waiting ones neither slow the
    measurement down nor choose otherwise. Without a lock (a read-only home, 30 s of waiting) it measures anyway."""
    lock = filelock.FileLock(f"{_cache_path()}.lock", timeout=30)
    with contextlib.suppress(OSError, filelock.Timeout):
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    try:
        yield
    finally:
        if lock.is_locked:
            lock.release()


def remember_higher_peak(device: torch.device, dtype: torch.dtype, flops: float) -> None:
    """Training reached more than the remembered matmul peak (measured while the machine was busy): keep the
    higher figure, so later runs measure MFU against it."""
    known = _read_cache()
    known[_key(_matmul(dtype), device)] = {"flops": flops}
    _write_cache(known)


def choose_cpu_dtype(
    model: GPT, batch_size: int, asked: str, runtime: Runtime, world: World, trained_in: str | None = None
) -> tuple[Runtime, str | None]:
    """The runtime to train in, and the start-up line that says why (None when there is nothing to say). asked:
    train.dtype; trained_in: a resumed run's Checkpoint.dtype ("" when its checkpoint predates the record), whose
    precision it keeps where this CPU can, so it resumes exactly. Under torchrun bfloat16 is an option only if
    every rank's CPU computes it natively, and rank 0 decides for all (two collectives, on every rank alike)."""
    if asked != "auto" or runtime.device.type != "cpu":
        return runtime, None
    native = all(world.all_gather(not runtime.emulates(torch.bfloat16)))
    decided = _decide(model, batch_size, native, trained_in) if world.is_main else None
    name, note = world.broadcast(decided)
    return dataclasses.replace(runtime, dtype=getattr(torch, name)), note


def _decide(model: GPT, batch_size: int, native: bool, trained_in: str | None) -> tuple[str, str | None]:
    if not native:  # float32, as on every CPU before auto measured; said only when the run trained otherwise
        changed = trained_in not in (None, "", "float32")
        return "float32", (f"dtype=auto: float32 on this CPU (the run trained in {trained_in})" if changed else None)
    if trained_in == "":  # written before the precision was recorded, when auto meant float32 on every CPU
        return "float32", "dtype=auto: float32, as auto meant on CPUs when this run's checkpoint was written"
    if trained_in in ("float32", "bfloat16"):
        return trained_in, f"dtype=auto: {trained_in}, the precision this run trained in"
    shape = {
        **dataclasses.asdict(model.config),
        "batch_size": batch_size,
        "checkpointing": model.activation_checkpointing,
    }
    what = f"a step of {json.dumps(shape, sort_keys=True)}"
    seconds = remembered(what, torch.device("cpu"), lambda: measure_step_seconds(model, batch_size), PRECISIONS)
    fp32_ms, bf16_ms = (round(seconds[name] * 1000) for name in PRECISIONS)
    measured = "measured on this CPU: a micro-batch's forward and backward took"
    if seconds["bfloat16"] < BF16_MARGIN * seconds["float32"]:
        return "bfloat16", (
            f"dtype=auto: bfloat16, {measured} {bf16_ms} ms in bfloat16 autocast against {fp32_ms} ms in float32 "
            "(train.dtype=float32 to keep full precision)"
        )
    return "float32", f"dtype=auto: float32, {measured} {fp32_ms} ms against {bf16_ms} ms in bfloat16 autocast"


def measure_step_seconds(model: GPT, batch_size: int) -> dict[str, float]:
    """The fastest of TIMED_STEPS forward and backward passes of one micro-batch in each precision, on random
    tokens. Leaves no trace: the gradients are cleared and the random state (dropout's) restored."""
    config = model.config
    tokens = torch.randint(
        config.vocab_size, (batch_size, config.block_size), generator=torch.Generator().manual_seed(0)
    )
    was_training = model.training
    model.train()
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    try:
        with torch.random.fork_rng(devices=[]):
            for step in range(1 + TIMED_STEPS):
                for dtype, timed in times.items():
                    started = time.perf_counter()
                    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                        _, loss = model(tokens, tokens)
                    loss.backward()
                    if step:  # the first of each: warm-up
                        timed.append(time.perf_counter() - started)
    finally:
        for p in model.parameters():
            p.grad = None
        model.train(was_training)
    return {dtype_name(dtype): min(timed) for dtype, timed in times.items()}


def peak_flops(device: torch.device, dtype: torch.dtype) -> Peak:
    """A datasheet's peak for known GPUs, else this machine's measured (and remembered) matmul peak."""
    name = dtype_name(dtype)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        for key, half, tf32 in GPU_PEAKS:
            if re.search(rf"\b{key}\b", gpu):
                return (
                    Peak(half, f"datasheet {key} {name}")
                    if dtype != torch.float32
                    else Peak(tf32, f"datasheet {key} tf32")
                )
    measured = remembered(_matmul(dtype), device, lambda: {"flops": measure_matmul_flops(device, dtype)}, ("flops",))
    return Peak(measured["flops"], f"measured {name} matmul")


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    """The best of a few n×n matmuls: a practical peak for CPUs and GPUs without a datasheet entry.

    On a GPU a single matmul is over before a launch and a sync are, so each timing covers ten."""
    per_timing = 10 if device.type != "cpu" else 1
    n = n or (4096 if device.type != "cpu" else 1024)
    a = torch.ones(n, n, device=device, dtype=dtype)  # values don't matter; the global RNG stays untouched
    b = torch.ones(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        synchronize(device)
        start = time.perf_counter()
        for _ in range(per_timing):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / per_timing)
    return 2 * n**3 / best


def _key(what: str, device: torch.device) -> str:
    return f"{device.type}: {_processor(device)}; torch {torch.__version__}; {torch.get_num_threads()} threads; {what}"


def _cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gpt-lab" / "machine.json")


def _read_cache() -> dict[str, Any]:
    try:
        known = json.loads(_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or damaged: measured again
        return {}
    return known if isinstance(known, dict) else {}


def _write_cache(known: dict[str, Any]) -> None:
    """Whole or not at all; a read-only home measures again next time, nothing worse. Two runs writing at once
    lose one's entry at worst, measured again."""
    path = _cache_path()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(known, indent=1, sort_keys=True))


def _whole(figures: Any, names: tuple[str, ...]) -> bool:
    """A cache entry holding every figure as a positive number (not damaged, not edited by hand)."""
    return isinstance(figures, dict) and all(_positive(figures.get(name)) for name in names)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _matmul(dtype: torch.dtype) -> str:
    """What the matmul peak is remembered as (peak_flops reads it, remember_higher_peak raises it)."""
    return f"{dtype_name(dtype)} matmul"


@functools.cache
def _processor(device: torch.device) -> str:
    """The processor's model name (a GPU's, or the CPU's from /proc/cpuinfo where Linux has one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()
