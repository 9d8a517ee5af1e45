"""Windows and macOS branches, forced on this Linux machine: directories that can't be fsynced, the run lock, files
never held open, compile's default, Windows paths in overrides, and MPS. (Corpus encoding under spawn: test_corpus.)"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from test_crash_safety import _tiny_checkpoint

import common.files
import train as train_command
from common.files import CKPT_NAME
from common.runtime import Runtime, make_runtime
from conftest import compose_config, sample_py, save_checkpoint, tiny_run_overrides, train_py, user_error
from model import GPT, GPTConfig
from model.checkpoint import load_checkpoint


def test_a_checkpoint_goes_through_its_own_temporary_fsynced_with_its_directory_where_that_can_be(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The file, then the directory holding the rename. Windows refuses os.open on a directory (PermissionError), and
    some filesystems can't fsync one (EINVAL): either way the checkpoint is written; an I/O error is not swallowed."""
    synced, renamed, failure = [], [], None
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def windows_open(path: object, flags: int, *args: object) -> int:
        if Path(str(path)).is_dir():
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    def fsync(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        if synced[-1] and failure is not None:
            raise OSError(failure, os.strerror(failure))
        real_fsync(fd)

    monkeypatch.setattr(common.files.os, "fsync", fsync)
    monkeypatch.setattr(common.files.os, "replace", lambda src, dst: (renamed.append(src), real_replace(src, dst)))
    save_checkpoint(tmp_path / CKPT_NAME, _tiny_checkpoint(1.0, 1))
    assert synced == [False, True] and [Path(p).name for p in renamed] == [f"{CKPT_NAME}.tmp"]
    failure = errno.EIO
    with pytest.raises(OSError, match="Input/output error"):
        save_checkpoint(tmp_path / CKPT_NAME, _tiny_checkpoint(1.0, 1))
    failure = errno.EINVAL
    save_checkpoint(tmp_path / CKPT_NAME, _tiny_checkpoint(1.0, 1))
    monkeypatch.setattr(common.files.os, "open", windows_open)
    (tmp_path / CKPT_NAME).unlink()
    save_checkpoint(tmp_path / CKPT_NAME, _tiny_checkpoint(1.0, 1))
    assert load_checkpoint(tmp_path / CKPT_NAME).model.keys() == _tiny_checkpoint(1.0, 1).model.keys()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_replace_that_meets_a_reader_is_tried_again_on_windows_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Windows won't replace a file another process holds open: tried again, waiting longer each time, and the last
    refusal raised; elsewhere a PermissionError means something else, raised at once."""
    refusals, waits, real_replace = iter(()), [], os.replace  # the waits between tries, taken note of, not slept

    def windows_replace(src: object, dst: object) -> None:
        if next(refusals, False):  # another process has the target open
            raise PermissionError(13, "The process cannot access the file", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(common.files.os, "replace", windows_replace)
    monkeypatch.setattr(common.files.time, "sleep", waits.append)
    for platform, refused, waited in (("win32", 2, 2), ("win32", 10, 9), ("linux", 1, 0)):
        monkeypatch.setattr(common.files.sys, "platform", platform)
        refusals, waits[:] = iter([True] * refused), []
        (tmp_path / "a").write_text("new")
        with pytest.raises(PermissionError) if refused > waited else contextlib.nullcontext():
            common.files.replace_file(tmp_path / "a", tmp_path / "b")
        assert len(waits) == waited and all(0 < a < b for a, b in zip(waits, waits[1:], strict=False))
    assert (tmp_path / "b").read_text() == "new"


HOLD_THE_LOCK = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from filelock import FileLock
    with FileLock(Path(sys.argv[1]) / ".lock"):
        print("held", flush=True)
        time.sleep(120)
    """
)


def test_a_locked_run_refuses_a_second_writer_until_the_holder_dies_and_can_be_sampled_meanwhile(
    tmp_path: Path, corpus_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A resume of a run still training (a scheduler's requeue) writes nothing there; readers take no lock; once the
    holder is killed (as the OOM killer would: no cleanup runs), the kernel has released its lock."""
    args = tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})
    train_py(args)
    run, data_dir = tmp_path / "run", str((tmp_path / "data").resolve())
    # Windows can't replace or delete an open file: the token files are closed for the next run in this process.
    open_files = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    assert data_dir not in Path("/proc/self/maps").read_text() and not [f for f in open_files if data_dir in f]
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"iter": 3, "train_loss": 1.0}\n')  # the live run's, after its checkpoint

    def files() -> dict[Path, bytes]:
        return {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}

    before = files()
    resume = [*args, "resume=true", "resume_with_changes=true", "train.max_iters=4"]
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert user_error(capsys, lambda: train_py(resume)).strip().splitlines()[-1] == (
            f"error: out_dir={run} is being written by another run; "
            "wait for it to end or stop it, or use another out_dir"
        )
        assert files() == before
        sample_py([f"out_dir={run}", "max_new_tokens=5", "num_samples=1"])
        assert capsys.readouterr().out.count("---------------") == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    train_py(resume)
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 4
    before = files()
    assert "already holds a run" in user_error(capsys, lambda: train_py([*args, "train.max_iters=3"]))  # no resume
    assert files() == before  # .hydra's record, too, stays the run's


def test_under_torchrun_every_rank_stops_when_the_run_is_locked(tmp_path: Path, corpus_path: Path) -> None:
    from test_distributed import torchrun

    (tmp_path / "run").mkdir()
    with FileLock(tmp_path / "run" / ".lock"):
        result = torchrun(2, tiny_run_overrides(tmp_path, corpus_path, **{"train.grad_accum": 2}), cwd=tmp_path)
    assert result.returncode != 0
    assert f"out_dir={tmp_path / 'run'} is being written by another run" in result.stdout + result.stderr


@pytest.mark.parametrize("triton", [False, True])
def test_compile_is_on_by_default_on_windows_only_with_triton(monkeypatch: pytest.MonkeyPatch, triton: bool) -> None:
    monkeypatch.setattr(train_command.sys, "platform", "win32")
    monkeypatch.setattr(train_command.importlib.util, "find_spec", lambda name: object() if triton else None)
    assert train_command._compiles_here() is triton


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
    assert compose_config([override]).data[override.split("=")[0].removeprefix("data.")] == value


def test_auto_picks_mps_on_apple_silicon_in_float32_and_flash_equals_math_on_this_machines_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a Mac the comparison runs on MPS; elsewhere on the CPU (CUDA has scripts/gpu_check.py)."""
    device = "mps" if torch.backends.mps.is_available() else "cpu"
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32)
    flash = GPT(config).to(device)
    math_ = GPT(dataclasses.replace(config, attn_impl="math")).to(device)
    math_.load_state_dict(flash.state_dict())
    idx = torch.randint(50, (2, 32), device=device)
    torch.testing.assert_close(flash(idx)[0], math_(idx)[0], atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert make_runtime("auto", "auto") == Runtime(torch.device("mps"), torch.float32)
