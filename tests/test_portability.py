"""Windows and macOS branches, forced on this Linux machine: a directory that can't be opened or fsynced, the run
lock, files never held open across a rename, compile's default, Windows paths in overrides, and MPS where it
exists. (Corpus encoding under spawn equals fork's: tests/test_corpus.py.)"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from filelock import FileLock

import common.runtime
import model.gpt
import training.run
from common.runtime import Runtime, make_runtime
from conftest import REPO, compose_config, run_script, tiny_run_overrides
from model import GPT, GPTConfig
from model.gpt import CKPT_NAME, load_checkpoint, save_checkpoint
from training.run import train


def _windows_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows refuses os.open on a directory (PermissionError), so a rename can't be fsynced there."""
    real_open = os.open

    def refusing(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if Path(str(path)).is_dir():
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(common.runtime.os, "open", refusing)


def _val_losses(run: Path) -> list[float]:
    lines = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return [r["val_loss"] for r in lines if "val_loss" in r]


def test_a_run_checkpoints_and_resumes_exactly_where_directories_cant_be_fsynced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, corpus_path: Path
) -> None:
    _windows_directories(monkeypatch)
    schedule = {"train.lr_decay_iters": 20}  # the same schedule whether the run stops at 10 or goes on to 20
    whole = tiny_run_overrides(tmp_path / "whole", corpus_path, **schedule, **{"train.max_iters": 20})
    train(compose_config(whole))
    half = tiny_run_overrides(tmp_path / "half", corpus_path, **schedule, **{"train.max_iters": 10})
    train(compose_config(half))
    train(compose_config([*half, "resume=true", "resume_with_changes=true", "train.max_iters=20"]))
    assert _val_losses(tmp_path / "half" / "run") == _val_losses(tmp_path / "whole" / "run")  # bit for bit
    assert not list((tmp_path / "half" / "run").glob("*.tmp"))


def test_a_filesystem_that_refuses_to_fsync_a_directory_still_gets_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_fsync = os.fsync

    def refusing(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(common.runtime.os, "fsync", refusing)
    checkpoint = _checkpoint()
    save_checkpoint(tmp_path / CKPT_NAME, checkpoint)
    assert load_checkpoint(tmp_path / CKPT_NAME).model.keys() == checkpoint.model.keys()


def test_a_directory_is_fsynced_where_it_can_be_and_an_io_error_is_not_swallowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    synced: list[bool] = []
    real_fsync = os.fsync

    def spying(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(common.runtime.os, "fsync", spying)
    save_checkpoint(tmp_path / CKPT_NAME, _checkpoint())
    assert synced == [False, True]  # the file, then the directory holding the rename

    def failing(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(common.runtime.os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        save_checkpoint(tmp_path / CKPT_NAME, _checkpoint())


def test_a_replace_that_meets_a_reader_on_windows_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    refusals = iter([True, True, False])
    real_replace = os.replace

    def windows_replace(src: object, dst: object) -> None:
        if next(refusals):  # another process has the target open
            raise PermissionError(13, "The process cannot access the file", str(dst))
        real_replace(src, dst)

    waits: list[float] = []  # the waits between tries, taken note of rather than slept
    monkeypatch.setattr(common.runtime.os, "replace", windows_replace)
    monkeypatch.setattr(common.runtime.sys, "platform", "win32")
    monkeypatch.setattr(common.runtime.time, "sleep", waits.append)
    save_checkpoint(tmp_path / CKPT_NAME, _checkpoint())
    assert load_checkpoint(tmp_path / CKPT_NAME).model_config.n_embd == 4
    assert len(waits) == 2 and 0 < waits[0] < waits[1]  # tried again, waiting longer each time
    refusals = iter([True] * 10)  # a reader that never lets go: the last refusal is raised
    (tmp_path / "a").write_text("new")
    waits.clear()
    with pytest.raises(PermissionError):
        common.runtime.replace_file(tmp_path / "a", tmp_path / "b")
    assert len(waits) == 9 and waits == sorted(waits)
    monkeypatch.setattr(common.runtime.sys, "platform", "linux")  # there it means something else: at once
    refusals = iter([True, False])
    waits.clear()
    with pytest.raises(PermissionError):
        common.runtime.replace_file(tmp_path / "a", tmp_path / "b")
    assert waits == []


def test_each_writer_writes_its_own_temporary_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    renamed: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(
        common.runtime.os, "replace", lambda src, dst: (renamed.append(Path(src).name), real_replace(src, dst))
    )
    save_checkpoint(tmp_path / CKPT_NAME, _checkpoint())
    assert renamed == [f"{CKPT_NAME}.{os.getpid()}.tmp"]


def _checkpoint() -> model.gpt.Checkpoint:
    from model.gpt import Checkpoint, Progress

    config = GPTConfig(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4)
    return Checkpoint(
        model_config=config,
        model=GPT(config).state_dict(),
        tokenizer={"kind": "char", "chars": list("abcdefghij")},
        config={},
        progress=Progress(),
        optimizer={},
        scaler={},
        rng=[],
    )


HOLD_THE_LOCK = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from filelock import FileLock
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    with FileLock(Path(sys.argv[1]) / ".lock"):
        print("held", flush=True)
        time.sleep(120)
    """
)


def test_a_second_writer_is_refused_until_the_first_dies(
    tmp_path: Path, corpus_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from conftest import train_py, user_error

    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text("the running command's\n")
        args = tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})
        refused = run_script("train.py", args, cwd=tmp_path)
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines()[-1] == (
            f"error: out_dir={run} is being written by another run; "
            "wait for it to end or stop it, or use another out_dir"
        )
        assert not (run / CKPT_NAME).exists()
        assert (run / ".hydra" / "overrides.yaml").read_text() == "the running command's\n"  # left as it was
    finally:
        holder.send_signal(signal.SIGKILL)  # as the OOM killer would: no cleanup runs
        holder.wait()
    train_py(args)  # train.py's main, here: the kernel released the dead holder's lock
    assert (run / CKPT_NAME).exists()
    assert "train.max_iters=2" in (run / ".hydra" / "overrides.yaml").read_text()  # now the run's own
    again = user_error(capsys, lambda: train_py([*args, "train.max_iters=3"]))  # forgot resume=true
    assert "already holds a run" in again
    assert "train.max_iters=3" not in (run / ".hydra" / "overrides.yaml").read_text()  # the record is the run's


def test_sample_py_reads_a_run_whose_lock_another_process_holds(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Readers take no lock: a run being trained can be sampled (its ckpt.pt is only ever replaced whole)."""
    from conftest import sample_py

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        sample_py([f"out_dir={run}", "max_new_tokens=5", "num_samples=1"])  # sample.py's main, here
        assert capsys.readouterr().out.count("---------------") == 1
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait()


def test_under_torchrun_every_rank_stops_when_the_run_is_locked(tmp_path: Path, corpus_path: Path) -> None:
    from test_distributed import torchrun

    (tmp_path / "run").mkdir()
    with FileLock(tmp_path / "run" / ".lock"):
        result = torchrun(2, tiny_run_overrides(tmp_path, corpus_path, **{"train.grad_accum": 2}), cwd=tmp_path)
    assert result.returncode != 0
    assert f"out_dir={tmp_path / 'run'} is being written by another run" in result.stdout + result.stderr


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc to see open files")
def test_no_token_file_stays_open_or_mapped_after_a_run(tmp_path: Path, corpus_path: Path) -> None:
    """Windows can't replace or delete an open file: re-preparing data after a run in the same process (a sweep)
    must find the token files closed."""
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 3})))
    data_dir = str((tmp_path / "data").resolve())
    maps = Path("/proc/self/maps").read_text()
    open_files = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    assert data_dir not in maps and not [f for f in open_files if f.startswith(data_dir)]


@pytest.mark.parametrize("triton", [False, True])
def test_compile_is_on_by_default_on_windows_only_with_triton(monkeypatch: pytest.MonkeyPatch, triton: bool) -> None:
    monkeypatch.setattr(training.run.importlib.util, "find_spec", lambda name: object() if triton else None)
    assert training.run._compiles_on_windows() is triton


@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("data.input=C:\\Users\\me\\input.txt", "C:\\Users\\me\\input.txt"),
        ("data.input=C:\\temp\\new\\x.txt", "C:\\temp\\new\\x.txt"),  # no \t or \n escapes
        ("data.input='C:\\Users\\me\\my file (1).txt'", "C:\\Users\\me\\my file (1).txt"),
        ("data.dir='C:\\data\\\\'", "C:\\data\\"),
    ],
)
def test_windows_paths_reach_the_config_intact(override: str, value: str) -> None:
    data = compose_config([override]).data
    assert (data.input if override.startswith("data.input") else data.dir) == value


def test_auto_picks_mps_on_apple_silicon_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert make_runtime("auto", "auto") == Runtime(torch.device("mps"), torch.float32)


def test_flash_equals_math_in_float32_on_this_machines_device() -> None:
    """On a Mac this runs on MPS; elsewhere on the CPU (CUDA has scripts/gpu_check.py)."""
    device = "mps" if torch.backends.mps.is_available() else "cpu"
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32)
    flash = GPT(config).to(device)
    math_ = GPT(dataclasses.replace(config, attn_impl="math")).to(device)
    math_.load_state_dict(flash.state_dict())
    idx = torch.randint(50, (2, 32), device=device)
    torch.testing.assert_close(flash(idx)[0], math_(idx)[0], atol=1e-4, rtol=1e-4)


def test_a_resume_refused_by_the_lock_changes_nothing_in_the_run(tmp_path: Path, corpus_path: Path) -> None:
    """A second process resuming a run that is still training (a scheduler's requeue) writes nothing there: the
    live run's metrics since its last checkpoint stay."""
    from common.errors import RunLocked

    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})))
    run = tmp_path / "run"
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"iter": 3, "train_loss": 1.0}\n')  # the live run's, after its checkpoint
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with FileLock(run / ".lock"), pytest.raises(RunLocked):
        more = {"train.max_iters": 4, "resume_with_changes": True}  # a finished run's resume writes nothing anyway
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, **more)))
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
