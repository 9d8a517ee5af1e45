"""Nothing a user does should cost them a run: exact resume, preemption, atomic checkpoints, a full disk."""

import errno
import functools
import itertools
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from common.errors import DiskFull
from common.files import CKPT_NAME, METRICS_NAME, RunDir
from conftest import compose_config, save_checkpoint, tiny_run_overrides
from model import GPT, GPTConfig
from model.checkpoint import Checkpoint, Progress, load_checkpoint
from train import train
from training.trainer import MetricsLog

# Dropout on, so the restored random state matters; 40 iterations, evaluated every 10, logged every 3: a stop
# falls inside a log line's window, whose losses so far the checkpoint keeps.
EXACT = {"model.dropout": 0.1, "train.max_iters": 40, "train.eval_interval": 10, "train.log_interval": 3}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Callable[..., Path]:
    """The uninterrupted run with some keys, trained once for the module."""

    @functools.cache
    def run(*keys: tuple[str, object]) -> Path:
        torch._dynamo.reset()
        root = tmp_path_factory.mktemp("uninterrupted")
        train(compose_config(tiny_run_overrides(root, corpus_path, **dict(keys))))
        return root / "run"

    return run


def _losses(run: Path, key: str) -> tuple[list[int], list[float]]:
    """The iterations and values of `key` in metrics.jsonl (a log line's train loss: the mean over its window)."""
    records = [json.loads(line) for line in (run / METRICS_NAME).read_text().splitlines()]
    return [r["iter"] for r in records if key in r], [r[key] for r in records if key in r]


def _signal_at_step(step: int, sig: signal.Signals, times: int = 1) -> Callable[[int], None]:
    """A before_step hook that delivers a real signal to this process just before step `step`."""

    def before_step(it: int) -> None:
        if it == step:
            for _ in range(times):
                signal.raise_signal(sig)

    return before_step


def _without_ns_steps(raw: dict) -> None:
    """Muon's groups from before train.muon_ns_steps: the config's value is put back."""
    assert [group.pop("ns_steps") for group in raw["optimizer"]["param_groups"] if group["muon"]] == [5]


def _before_torchrun(raw: dict) -> None:
    """The optimizer's state keyed by position, as torch writes it, and one random state, not one per rank."""
    names = [name for group in raw["optimizer"]["param_groups"] for name in group["params"]]
    position = {name: i for i, name in enumerate(names)}
    raw["optimizer"]["state"] = {position[name]: s for name, s in raw["optimizer"]["state"].items()}
    for group in raw["optimizer"]["param_groups"]:
        group["params"] = [position[name] for name in group["params"]]
    raw["rng"] = raw["rng"][0]
    del raw["elapsed_s"]  # not written before timed resumes either


def _before_the_trainer(raw: dict) -> None:
    """The dict the training loop wrote by hand before model.gpt owned the format, key by key."""
    for key in ("kept_best_val_loss", "dtype", "log_loss_sum", "log_steps"):  # without dtype, auto resumes in float32
        del raw[key]
    assert set(raw) == {"model_config", "model", "optimizer", "scaler", "iter", "last_eval_iter", "val_loss",
                        "best_val_loss", "rng", "elapsed_s", "tokenizer", "config"}  # a key added since joins the above


@pytest.mark.parametrize(
    ("stop_at", "keys", "rewrite"),
    [
        (7, {}, None),
        (19, {}, None),
        (30, {}, None),
        (19, {"train.optimizer": "muon"}, None),  # its momentum buffers, and its momentum, warming up, from the iter
        (19, {"train.activation_checkpointing": True}, None),  # recomputed: the same numbers, dropout's draws included
        (19, {"train.optimizer": "muon", "train.dtype": "bfloat16"}, None),  # Newton-Schulz in bfloat16 too
        # inductor: the resumed process compiles the same code again (one layer: a cold first compile in half the time)
        (19, {"train.compile": True, "model.n_layer": 1}, None),
        (19, {"train.optimizer": "muon"}, _without_ns_steps),
        (19, {}, _before_torchrun),
        (19, {}, _before_the_trainer),
    ],
)
def test_interrupted_and_resumed_equals_uninterrupted(
    uninterrupted: Callable[..., Path], tmp_path: Path, corpus_path: Path, stop_at: int, keys: dict,
    rewrite: Callable[[dict], None] | None,
) -> None:
    """Stopped by SIGTERM, maybe rewritten in an older layout, resumed: the uninterrupted run's numbers, bit for bit."""
    exact = {**EXACT, **keys}
    reference = uninterrupted(*sorted((k, v) for k, v in exact.items() if k != "train.activation_checkpointing"))
    run = tmp_path / "run"
    torch._dynamo.reset()  # as a new process starts: dynamo recompiling in one process marks shapes dynamic
    hook = _signal_at_step(stop_at, signal.SIGTERM)
    stopped = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **exact)), before_step=hook)
    assert stopped.stopped_by == "SIGTERM" and stopped.iters == stop_at + 1
    raw = torch.load(run / CKPT_NAME, weights_only=True)
    assert raw["iter"] == stop_at + 1
    if rewrite is not None:
        rewrite(raw)
        torch.save(raw, run / CKPT_NAME)
    torch._dynamo.reset()
    assert train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, **exact))).iters == 40

    tolerance = 1e-5 if keys.get("train.compile") else 0  # inductor's CPU kernels differ run to run in the last bits
    for key in ("val_loss", "train_loss") if "log_steps" in raw else ("val_loss",):  # or the log line starts afresh
        (iters, losses), (reference_iters, reference_losses) = _losses(run, key), _losses(reference, key)
        assert iters == reference_iters and losses == pytest.approx(reference_losses, rel=tolerance, abs=0)
    final, expected = load_checkpoint(run / CKPT_NAME).model, load_checkpoint(reference / CKPT_NAME).model
    torch.testing.assert_close(final, expected, rtol=0, atol=tolerance)


def test_a_second_ctrl_c_quits_at_once_and_keeps_the_last_checkpoint(tmp_path: Path, corpus_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when started in the background
    with pytest.raises(KeyboardInterrupt):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **EXACT)),
              before_step=_signal_at_step(25, signal.SIGINT, times=2))
    assert load_checkpoint(tmp_path / "run" / CKPT_NAME).progress.iter == 20  # the evaluation before the interruption
    assert not list((tmp_path / "run").glob("*.tmp"))
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def _tiny_checkpoint(value: float, it: int) -> Checkpoint:
    """A real (tiny) model's checkpoint, every weight `value`: load_checkpoint checks names and shapes."""
    config = GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8)
    weights = {name: torch.full_like(w, value) for name, w in GPT(config).state_dict().items()}
    return Checkpoint(config, weights, tokenizer={}, progress=Progress(iter=it))


def _no_space_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """What shutil.disk_usage says once a disk has filled up."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))


_SHORT_OF_SPACE = RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed; unexpected pos 64 vs 0")  # torch.save's full disk: no errno


@pytest.mark.parametrize(
    ("error", "disk_full", "raised", "says"),
    [
        (KeyboardInterrupt(), False, KeyboardInterrupt, None),
        (_SHORT_OF_SPACE, False, RuntimeError, "unexpected pos"),  # with room left it is a bug: its own traceback
        (_SHORT_OF_SPACE, True, DiskFull, r"not written: the disk holding .* is full \(0.0 MiB"),
    ],
)
def test_an_interrupted_checkpoint_write_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, disk_full: bool, raised: type,
    says: str | None,
) -> None:
    path = tmp_path / CKPT_NAME
    save_checkpoint(path, _tiny_checkpoint(1.0, 1))
    before = path.read_bytes()

    def half_written(obj: object, f) -> None:  # noqa: ANN001
        f.write(b"PK\x03\x04 half a zip file")
        raise error

    monkeypatch.setattr(torch, "save", half_written)
    if disk_full:
        _no_space_left(monkeypatch)
    with pytest.raises(raised, match=says):
        save_checkpoint(path, _tiny_checkpoint(0.0, 2))
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_a_disk_that_fills_up_at_checkpoint_time_is_one_line_and_keeps_the_checkpoint(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line, and the run goes on once there is room."""
    save = torch.save

    def fills_up(obj: dict, f) -> None:  # noqa: ANN001
        if obj["iter"] < 20:
            return save(obj, f)
        f.write(b"PK\x03\x04 the start of a zip file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", fills_up)
    run = tmp_path / "run"
    with pytest.raises(DiskFull) as raised:
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path)))
    ckpt, where = re.escape(str(run / CKPT_NAME)), re.escape(str(run))
    assert re.fullmatch(rf"{ckpt} not written: the disk holding {where} is full \([\d,.]+ MiB free\); {ckpt} keeps "
                        rf"iter 10, the last good state. Free space, then resume: python train.py out_dir={where} "
                        "resume=true", str(raised.value)), raised.value
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 10 and not list(run.glob("*.tmp"))
    monkeypatch.setattr(torch, "save", save)
    assert train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True))).iters == 20


def test_numpys_full_disk_without_an_errno_is_one_line_and_prepares_nothing(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy's tofile raises a bare OSError on a full disk; the dataset folder is then left as it was (none)."""
    from data.prepare import DataConfig, ensure_prepared

    class Unwritable(np.ndarray):
        def tofile(self, f: object) -> None:  # type: ignore[override]
            raise OSError("5 requested and 0 written")  # numpy's words, no errno

    asarray = np.asarray
    monkeypatch.setattr(np, "asarray", lambda *args, **kwargs: asarray(*args, **kwargs).view(Unwritable))
    _no_space_left(monkeypatch)
    with pytest.raises(DiskFull, match=rf"^data.dir={tmp_path / 'data'} not prepared: the disk holding it is full;"):
        ensure_prepared(DataConfig(input=str(corpus_path), dir=str(tmp_path / "data")))  # data.dir, not a temporary
    assert not list(tmp_path.iterdir())


def test_a_full_disk_under_metrics_jsonl_is_one_line(tmp_path: Path) -> None:
    log = MetricsLog(RunDir(tmp_path))
    log.write({"iter": 1, "train_loss": 1.0, "lr": 1e-3})
    before = (tmp_path / METRICS_NAME).read_bytes()
    with mock.patch("builtins.open", side_effect=OSError(errno.EDQUOT, "Disk quota exceeded")):
        with pytest.raises(DiskFull, match=rf"{METRICS_NAME} not written: the disk holding .* is full"):
            log.write({"iter": 2, "train_loss": 1.0, "lr": 1e-3})
    assert (tmp_path / METRICS_NAME).read_bytes() == before


def test_kill_9_during_checkpoint_writes_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """Each writer is a process forked from this one, killed -9 while it saves two states in turn."""
    path = tmp_path / CKPT_NAME
    config = GPTConfig(vocab_size=250_000, block_size=8, n_layer=1, n_head=1, n_embd=8)  # 4M numbers: 16 MB a write
    shapes = GPT(config).state_dict()
    weights = [{name: torch.full_like(w, float(i)) for name, w in shapes.items()} for i in (1, 2)]
    states = [Checkpoint(config, w, {}, progress=Progress(iter=i)) for i, w in zip((1, 2), weights, strict=True)]
    save_checkpoint(path, states[0])
    for delay in (0.13, 0.37, 0.71):
        pid = os.fork()
        if pid == 0:  # the writer: never returns to pytest
            try:
                for i in itertools.count():
                    save_checkpoint(path, states[i % 2])
            finally:
                os._exit(1)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL  # killed mid-write, not ended by an error
        ckpt = load_checkpoint(path)
        assert ckpt.progress.iter in (1, 2)
        assert all(torch.equal(w, torch.full_like(w, float(ckpt.progress.iter))) for w in ckpt.model.values())
