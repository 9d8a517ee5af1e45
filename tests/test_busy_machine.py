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
    """The median of the last three steps against the fastest: one slow step is noise; two of three at 2x are a
    slowdown, said once (the pace it settles at is the new one to compare with)."""
    notes = iter(["CPU threads: 1 of 2 from now on: other processes keep 1.0 cores busy", None])
    monkeypatch.setattr(cpu_threads, "use_free_cores", lambda mid_run: next(notes))
    watch = cpu_threads.SlowdownWatch()
    steps = (0.5, 0.01, 0.011, 0.08, 0.01, 0.01, 0.025, 0.03, 0.026, 0.027, 0.08, 0.09)
    said = [watch.notice(s) for s in steps]  # the first step warms up; 0.08 alone is noise
    assert said == [None] * 7 + [
        "CPU threads: 1 of 2 from now on: other processes keep 1.0 cores busy",  # 0.01, 0.025, 0.03: 2.5x
        None,
        None,
        None,  # 0.026, 0.027, 0.08: one slow step against the new pace (0.025)
        "steps take 3.2x as long as earlier in this run: if another process is using the CPU, OMP_NUM_THREADS=1 "
        "(or stopping it) may help",
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one to take, one to train on")
def test_a_core_taken_after_the_start_lowers_the_threads_within_seconds(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch, threads_restored: None
) -> None:
    """The newcomer's speedrun ran 2,945 ms/iter with 2 threads for 65 iterations (2 min) after another process
    took a core: its first log line was already slow. The CPU recipe's model, a core taken at step 3, before the
    first log line (10)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    core = max(os.sched_getaffinity(0))
    taken: dict[str, float] = {}
    hog = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"

    def take_a_core(it: int) -> None:
        if it == 3:
            if torch.get_num_threads() < 2:
                pytest.skip("the run's start found a core busy already")
            taken["process"] = subprocess.Popen([sys.executable, "-c", hog, str(core)])
            taken["at"] = time.perf_counter()
        elif "at" in taken and "lowered" not in taken and torch.get_num_threads() == 1:
            taken["lowered"], taken["step"] = time.perf_counter() - taken["at"], it

    model = {"model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 64}
    run = {"train.batch_size": 12, "train.max_iters": 60, "train.log_interval": 10}
    args = tiny_run_overrides(tmp_path, corpus_path, **model, **run)
    try:
        train(compose_config(args), before_step=take_a_core)
    finally:
        if "process" in taken:
            taken["process"].kill()
            taken["process"].wait()
    assert "lowered" in taken, "the threads stayed at 2 for the rest of the run"
    assert taken["lowered"] < 5.0, taken  # within seconds (was minutes)


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
