"""CPU threads for torch on a machine others share. Torch starts one thread per core; when another process keeps a
core busy, its threads wait on each other at every operation's barrier, and a small model's steps ran 2-3x (on a
busier 2-core machine, 15-25x) slower than with the free cores alone. So the CPU path uses the cores that are
actually free, measured from /proc/stat (Linux); OMP_NUM_THREADS, when set, is the user's choice and stays.
"""

from __future__ import annotations

import math
import os
import time

import torch


def use_free_cores(mid_run: bool = False) -> str | None:
    """Lowers torch's threads to the cores other processes leave free (at start, and again when steps slowed down
    mid-run). Returns the one line saying so, or None when nothing changed (all free, OMP_NUM_THREADS set, or no
    way to tell)."""
    current = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS") or current <= 1:
        return None
    busy = others_busy_cores()
    threads = free_threads(current, busy, len(os.sched_getaffinity(0)) if busy is not None else current)
    if threads == current:
        return None
    torch.set_num_threads(threads)
    if mid_run:
        return f"CPU threads: {threads} of {current} from now on: other processes keep {busy:.1f} cores busy"
    return (
        f"CPU threads: {threads} of {current}: other processes keep {busy:.1f} cores busy, and threads waiting for a "
        "busy core slow every step down; set OMP_NUM_THREADS=N to choose"
    )


class SlowdownWatch:
    """Steps twice as slow as this process's fastest, in the median of the last three (one slow step is noise): on
    a CPU, most likely another process took a core that torch's threads wait for. Watched step by step, so the
    threads drop to the free cores a few steps into a slowdown, not at a later log line (a speedrun once ran at
    2,945 ms/iter for a minute: its first log line was already slow, and set the pace). Lowers the threads, or
    says what to do, once per slowdown."""

    def __init__(self) -> None:
        self.fastest_s = math.inf
        self.recent: list[float] = []

    def notice(self, step_s: float) -> str | None:
        self.recent = [*self.recent[-2:], step_s]
        slower = sorted(self.recent)[1] / self.fastest_s if len(self.recent) == 3 else 1.0
        self.fastest_s = min(self.fastest_s, step_s)
        if slower < 2:
            return None
        self.fastest_s, self.recent = sorted(self.recent)[1], []
        return use_free_cores(mid_run=True) or (
            f"steps take {slower:.1f}x as long as earlier in this run: if another process is using the CPU, "
            "OMP_NUM_THREADS=1 (or stopping it) may help"
        )


def free_threads(current: int, busy: float | None, cores: int) -> int:
    """The threads to use: no more than now, nor than this process's cores less those others keep busy (a core
    busy more than half the time counts as taken), at least one."""
    if busy is None:
        return current
    return max(1, min(current, cores - math.ceil(busy - 0.5)))


def others_busy_cores(sample_s: float = 0.1) -> float | None:
    """How many of this process's cores (its affinity) other processes kept busy over sample_s (10 clock ticks a
    core), while this one sleeps; None where /proc/stat can't say (not Linux)."""
    try:
        cores = os.sched_getaffinity(0)
        before, own_before = _busy_ticks(cores), os.times()
        time.sleep(sample_s)
        after, own_after = _busy_ticks(cores), os.times()
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    # this process's own threads (OpenMP's spin a while after each parallel region) are not others
    own_s = own_after.user + own_after.system - own_before.user - own_before.system
    return max(0.0, ((after - before) / os.sysconf("SC_CLK_TCK") - own_s) / sample_s)


def _busy_ticks(cores: set[int]) -> int:
    """Clock ticks the given cores spent busy since boot, from /proc/stat's lines `cpuN user nice system idle
    iowait irq softirq steal ...`: all but idle and iowait."""
    busy = 0
    with open("/proc/stat") as f:
        for name, *fields in map(str.split, f):
            if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cores:
                busy += sum(map(int, fields[:8])) - int(fields[3]) - int(fields[4])
    return busy
