"""train.dtype=auto on a CPU: bfloat16 autocast where this CPU computes bfloat16 natively and the model's own
training step measures faster in it, float32 otherwise. The flags can't decide it: on a native-bf16 Xeon the CPU
presets' steps took 1.6-2.4x as long in bfloat16, an AMD machine ran the speedrun faster (docs/gpu.md)."""

from __future__ import annotations

import dataclasses
import time

import torch

from model import GPT
from training.distributed import World, all_gather_objects, broadcast_from_main
from training.runtime import Runtime

TIMED_STEPS = 2  # per precision, after one warm-up step each; alternating, so a busy moment slows both
BF16_MARGIN = 0.95  # bfloat16 only when its step takes under 95% of float32's: timing noise isn't worth its rounding


def choose_cpu_dtype(
    model: GPT, batch_size: int, asked: str, runtime: Runtime, world: World, trained_in: str | None = None
) -> tuple[Runtime, str | None]:
    """The runtime to train in, and the start-up line that says why (None when there is nothing to say). asked:
    train.dtype; trained_in: a resumed run's Checkpoint.dtype ("" when its checkpoint predates the record), whose
    precision it keeps where this CPU can, so it resumes exactly. Under torchrun bfloat16 is an option only if
    every rank's CPU computes it natively, and rank 0 decides for all (two collectives, on every rank alike)."""
    if asked != "auto" or runtime.device.type != "cpu":
        return runtime, None
    native = all(all_gather_objects(not runtime.emulates(torch.bfloat16), world))
    decided = _decide(model, batch_size, native, trained_in) if world.is_main else None
    name, note = broadcast_from_main(decided, world)
    return dataclasses.replace(runtime, dtype=getattr(torch, name)), note


def _decide(model: GPT, batch_size: int, native: bool, trained_in: str | None) -> tuple[str, str | None]:
    if not native:  # float32, as on every CPU before auto measured; said only when the run trained otherwise
        changed = trained_in not in (None, "", "float32")
        return "float32", (f"dtype=auto: float32 on this CPU (the run trained in {trained_in})" if changed else None)
    if trained_in == "":  # written before the precision was recorded, when auto meant float32 on every CPU
        return "float32", "dtype=auto: float32, as auto meant on CPUs when this run's checkpoint was written"
    if trained_in in ("float32", "bfloat16"):
        return trained_in, f"dtype=auto: {trained_in}, the precision this run trained in"
    seconds = measure_step_seconds(model, batch_size)
    fp32_ms, bf16_ms = (round(seconds[dtype] * 1000) for dtype in (torch.float32, torch.bfloat16))
    measured = "measured on this CPU: a micro-batch's forward and backward took"
    if seconds[torch.bfloat16] < BF16_MARGIN * seconds[torch.float32]:
        return "bfloat16", (
            f"dtype=auto: bfloat16, {measured} {bf16_ms} ms in bfloat16 autocast against {fp32_ms} ms in float32 "
            "(train.dtype=float32 to keep full precision)"
        )
    return "float32", f"dtype=auto: float32, {measured} {fp32_ms} ms against {bf16_ms} ms in bfloat16 autocast"


def measure_step_seconds(model: GPT, batch_size: int) -> dict[torch.dtype, float]:
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
    return {dtype: min(timed) for dtype, timed in times.items()}
