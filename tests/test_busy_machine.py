"""A machine shared with other processes: threads chosen from the free cores, a slowdown noticed mid-run, MFU
never above 100%, and log lines that say how far the run is and how long it has to go."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common import cpu_threads
from conftest import compose_config, tiny_run_overrides
from model.checkpoint import Progress
from training.metrics import LogWindow
from training.run import train


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("current", "busy", "cores", "expected"),
    [
        (2, 1.0, 2, 1),
        (2, 0.3, 2, 2),
        (2, 2.0, 2, 1),
        (8, 3.0, 8, 5),
        (4, None, 4, 4),
        (2, 0.6, 2, 1),
        (8, 4.0, 16, 8),
        (8, 9.0, 16, 7),
    ],  # threads set below the cores (physical ones of hyper-threaded logical) drop only if needed
)
def test_threads_are_the_cores_left_free(current: int, busy: float | None, cores: int, expected: int) -> None:
    assert cpu_threads.free_threads(current, busy, cores) == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_a_busy_process_on_one_of_our_cores_is_measured() -> None:
    core = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)
        measured = cpu_threads.others_busy_cores(0.3)
    finally:
        busy.kill()
        busy.wait()
    assert measured is not None and 0.7 <= measured <= len(os.sched_getaffinity(0)) + 0.1


def test_the_threads_drop_to_the_free_cores_unless_omp_num_threads_is_set(
    monkeypatch: pytest.MonkeyPatch, threads_restored: None
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "others_busy_cores", lambda: 1.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)
    note = cpu_threads.use_free_cores()
    assert torch.get_num_threads() == 1
    assert note.startswith("CPU threads: 1 of 2: other processes keep 1.0 cores busy")
    assert "OMP_NUM_THREADS=N" in note

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert cpu_threads.use_free_cores() is None and torch.get_num_threads() == 2  # the user's choice stays


def test_a_slowdown_mid_run_lowers_the_threads_or_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    notes = iter(["CPU threads: 1 of 2 from now on: other processes keep 1.0 cores busy", None])
    monkeypatch.setattr(cpu_threads, "use_free_cores", lambda mid_run: next(notes))
    watch = cpu_threads.SlowdownWatch()
    said = [watch.notice(ms) for ms in (10.0, 20.0, 40.0, 41.0, 120.0)]  # 2x: noise; 41: the same slowdown
    assert said == [
        None,
        None,
        "CPU threads: 1 of 2 from now on: other processes keep 1.0 cores busy",
        None,
        "steps take 3.0x as long as earlier in this run: if another process is using the CPU, OMP_NUM_THREADS=1 "
        "(or stopping it) may help",
    ]


def test_mfu_never_passes_100_percent(caplog: pytest.LogCaptureFixture) -> None:
    """The peak measured at start under load was lower than what training later reached (MFU read 115%)."""

    remembered: list[float] = []

    def mfu(peak_measured: bool) -> tuple[float, LogWindow]:
        keeper = remembered.append if peak_measured else None
        window = LogWindow(Progress(), tokens_per_iter=1000, flops_per_token=1e6, peak_flops=1e9, remember_peak=keeper)
        for step in range(3):  # a peak of 1 GFLOP/s
            window.add(torch.tensor(1.0))
            began = time.perf_counter() - 0.1  # 10,000 tokens/s: 10 GFLOP/s
            result = window.end_step(step, began, log_now=step == 2)
        return result[1]["mfu"], window

    with caplog.at_level(logging.WARNING, logger="train"):
        measured, window = mfu(peak_measured=True)
    assert measured == pytest.approx(1.0) and window.peak_flops == pytest.approx(1e10, rel=0.05)
    assert "above the 0.001 measured as this machine's peak" in caplog.text
    assert remembered == [pytest.approx(1e10, rel=0.05)]  # later runs measure MFU against it
    caplog.clear()
    datasheet, window = mfu(peak_measured=False)  # a datasheet's peak stands: above it, the FLOP count is wrong
    assert datasheet == pytest.approx(10.0, rel=0.05) and window.peak_flops == 1e9 and caplog.messages == []


def test_log_lines_show_the_iteration_of_max_iters_and_an_eta(
    tmp_path: Path, corpus_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="train"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path)))
    lines = [m for m in caplog.messages if m.startswith("iter ")]
    assert lines[0].startswith("iter 5/20: ") and lines[-1].startswith("iter 20/20: ")
    assert lines[-1].endswith(", ETA 0s") and ", ETA " in lines[1]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "ms_per_iter" in r]
    assert timed and all(r["eta_s"] >= 0 for r in timed) and timed[-1]["eta_s"] == 0
