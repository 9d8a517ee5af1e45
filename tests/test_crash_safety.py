"""Nothing a user does should cost them a run: exact resume, preemption, atomic checkpoints, safe loading."""

import errno
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

from common.errors import CheckpointError, DiskFull, TrainingDiverged
from conftest import REACHES_TARGET, REPO, compose_config, run_in_process, tiny_run_overrides
from model import GPT, GPTConfig
from model.gpt import CKPT_NAME, Checkpoint, Progress, load_checkpoint, save_checkpoint
from training.run import train
from training.trainer import METRICS_NAME, MetricsLog, read_records

# Dropout on, so the restored random state matters; 40 iterations, evaluated every 10, logged every 3: a stop
# (and the half run's end, 20) falls inside a log line's window, whose losses so far the checkpoint keeps.
EXACT = {"model.dropout": 0.1, "train.max_iters": 40, "train.eval_interval": 10, "train.log_interval": 3}
HALF = {**EXACT, "train.lr_decay_iters": 40}  # a 20-iteration run with the schedule of the 40-iteration one


@pytest.fixture(scope="module")
def half_run(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> tuple[Path, Path]:
    """An uninterrupted 40-iteration run, and the first 20 iterations of it to resume in each test's own copy."""
    root = tmp_path_factory.mktemp("half")
    train(compose_config(tiny_run_overrides(root / "whole", corpus_path, **HALF)))
    train(compose_config(tiny_run_overrides(root / "half", corpus_path, **{**HALF, "train.max_iters": 20})))
    return root / "whole" / "run", root / "half"


def _val_losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["iter"], r["val_loss"]) for r in records if "val_loss" in r]


def _train_losses(run: Path) -> list[tuple[int, float]]:
    """Each log and eval line's train loss (a log line's: the mean over its window of steps)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["iter"], r["train_loss"]) for r in records if "train_loss" in r]


def _signal_at_step(step: int, sig: signal.Signals, times: int = 1) -> Callable[[int], None]:
    """A before_step hook that delivers a real signal to this process just before step `step`."""

    def before_step(it: int) -> None:
        if it == step:
            for _ in range(times):
                signal.raise_signal(sig)

    return before_step


def _tiny_checkpoint(value: float, it: int) -> Checkpoint:
    """A real (tiny) model's checkpoint, every weight `value`: load_checkpoint checks names and shapes."""
    config = GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8)
    weights = {name: torch.full_like(w, value) for name, w in GPT(config).state_dict().items()}
    return Checkpoint(config, weights, tokenizer={}, progress=Progress(iter=it))


@pytest.mark.parametrize(
    ("stop_at", "optimizer", "recompute", "dtype", "compiled"),
    [
        (7, "adamw", False, "float32", False),
        (19, "adamw", False, "float32", False),
        (30, "adamw", False, "float32", False),
        (19, "muon", False, "float32", False),
        (19, "adamw", True, "float32", False),
        (19, "muon", False, "bfloat16", False),
        (19, "adamw", False, "float32", True),  # inductor: the resumed process compiles the same code again
    ],
)
def test_interrupted_and_resumed_equals_uninterrupted(
    half_run: tuple[Path, Path],
    tmp_path: Path,
    corpus_path: Path,
    stop_at: int,
    optimizer: str,
    recompute: bool,
    dtype: str,
    compiled: bool,
) -> None:
    """Muon too: its momentum buffers, and its momentum (still warming up at 40 iterations) from the iteration.
    With train.activation_checkpointing (recompute), against the run without it: the same numbers, dropout's
    draws included. In bfloat16 (autocast, and Muon's Newton-Schulz in bfloat16) against a bfloat16 run."""
    reference, _ = half_run  # the uninterrupted run: EXACT's lr_decay_iters is its max_iters, 40
    exact = {**EXACT, "train.optimizer": optimizer, "train.activation_checkpointing": recompute, "train.dtype": dtype}
    exact["train.compile"] = compiled

    def fresh_process() -> None:
        """As a new process would start: dynamo recompiling in one process marks shapes dynamic, other kernels."""
        if compiled:
            torch._dynamo.reset()

    if optimizer != "adamw" or dtype != "float32" or compiled:
        fresh_process()
        train(compose_config(tiny_run_overrides(tmp_path / "a", corpus_path, **exact)))
        reference = tmp_path / "a" / "run"
    hook = _signal_at_step(stop_at, signal.SIGTERM)
    fresh_process()
    stopped = train(compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, **exact)), before_step=hook)
    assert stopped.stopped_by == "SIGTERM" and stopped.iters == stop_at + 1
    assert load_checkpoint(tmp_path / "b" / "run" / CKPT_NAME).progress.iter == stop_at + 1
    fresh_process()
    resumed = train(compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, resume=True, **exact)))

    assert resumed.iters == 40
    final_a = load_checkpoint(reference / CKPT_NAME).model
    final_b = load_checkpoint(tmp_path / "b" / "run" / CKPT_NAME).model
    if compiled:  # inductor's CPU kernels differ run to run in the last bits (the same weights' loss 1e-12 apart)
        iters, losses = zip(*_val_losses(tmp_path / "b" / "run"), strict=True)
        assert list(iters) == [i for i, _ in _val_losses(reference)]
        assert list(losses) == pytest.approx([loss for _, loss in _val_losses(reference)], rel=1e-6)
        logged = _train_losses(tmp_path / "b" / "run")
        assert [i for i, _ in logged] == [i for i, _ in _train_losses(reference)]
        assert [v for _, v in logged] == pytest.approx([v for _, v in _train_losses(reference)], rel=1e-5)
        assert all(torch.allclose(final_a[k], final_b[k], atol=1e-5) for k in final_a)
        return
    assert _val_losses(tmp_path / "b" / "run") == _val_losses(reference)  # bit-identical
    assert _train_losses(tmp_path / "b" / "run") == _train_losses(reference)  # the logged ones too
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_a_muon_checkpoint_from_before_muon_ns_steps_resumes_exactly(tmp_path: Path, corpus_path: Path) -> None:
    """Its Muon group has no ns_steps: restore() puts the config's back, and the run goes on as if never stopped."""
    exact = {**EXACT, "train.optimizer": "muon"}
    train(compose_config(tiny_run_overrides(tmp_path / "a", corpus_path, **exact)))
    stopped = train(
        compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, **exact)),
        before_step=_signal_at_step(19, signal.SIGTERM),
    )
    assert stopped.stopped_by == "SIGTERM"
    path = tmp_path / "b" / "run" / CKPT_NAME
    raw = _raw(path)
    assert [group.pop("ns_steps") for group in raw["optimizer"]["param_groups"] if group["muon"]] == [5]
    torch.save(raw, path)
    resumed = train(compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, resume=True, **exact)))
    assert resumed.iters == 40
    assert _val_losses(tmp_path / "b" / "run") == _val_losses(tmp_path / "a" / "run")
    final_a = load_checkpoint(tmp_path / "a" / "run" / CKPT_NAME).model
    final_b = load_checkpoint(tmp_path / "b" / "run" / CKPT_NAME).model
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_a_second_ctrl_c_quits_at_once_and_keeps_the_last_checkpoint(tmp_path: Path, corpus_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when started in the background
    hook = _signal_at_step(25, signal.SIGINT, times=2)
    with pytest.raises(KeyboardInterrupt):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **EXACT)), before_step=hook)
    ckpt = load_checkpoint(tmp_path / "run" / CKPT_NAME)
    assert ckpt.progress.iter == 20  # the evaluation before the interruption
    assert not list((tmp_path / "run").glob("*.tmp"))
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_an_interrupted_checkpoint_write_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / CKPT_NAME
    save_checkpoint(path, _tiny_checkpoint(1.0, 1))
    before = path.read_bytes()

    def half_written(obj: object, f) -> None:  # noqa: ANN001
        f.write(b"PK\x03\x04 half a zip file")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, _tiny_checkpoint(0.0, 2))
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    assert load_checkpoint(path).progress.iter == 1


def test_a_disk_that_fills_up_at_checkpoint_time_is_one_line_and_keeps_the_checkpoint(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was an OSError traceback; the previous ckpt.pt stayed intact, and stays so."""
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
    assert re.fullmatch(
        rf"{re.escape(str(run / CKPT_NAME))} not written: the disk holding {re.escape(str(run))} is full \([\d,.]+ MiB "
        rf"free\); {re.escape(str(run / CKPT_NAME))} keeps iter 10, the last good state. Free space, then resume: "
        rf"python train.py out_dir={re.escape(str(run))} resume=true",
        str(raised.value),
    ), raised.value
    assert load_checkpoint(run / CKPT_NAME).progress.iter == 10 and not list(run.glob("*.tmp"))
    monkeypatch.setattr(torch, "save", save)
    assert train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True))).iters == 20


def _no_space_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """What shutil.disk_usage says once a disk has filled up."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))


def test_torch_saves_full_disk_without_an_errno_is_one_line_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save with too little space raises RuntimeError("... unexpected pos ..."), not an OSError."""
    path = tmp_path / CKPT_NAME
    save_checkpoint(path, _tiny_checkpoint(0.0, 1))
    before = path.read_bytes()

    def short_of_space(obj: dict, f) -> None:  # noqa: ANN001
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed; unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", short_of_space)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # with room left it is a bug: its own traceback
        save_checkpoint(path, _tiny_checkpoint(0.0, 2))
    _no_space_left(monkeypatch)
    with pytest.raises(DiskFull, match=rf"^{re.escape(str(path))} not written: the disk holding .* is full \(0.0 MiB"):
        save_checkpoint(path, _tiny_checkpoint(0.0, 2))
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_numpys_full_disk_without_an_errno_is_one_line_and_prepares_nothing(
    tmp_path: Path, corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy's tofile raises a bare OSError on a full disk; the dataset folder is then left as it was (none)."""
    import types

    import numpy as np

    import data.text_tokens
    from data.prepare import DataConfig, ensure_prepared

    class Unwritable(np.ndarray):
        def tofile(self, f: object) -> None:  # type: ignore[override]
            raise OSError("5 requested and 0 written")  # numpy's words, no errno

    numpy = types.SimpleNamespace(**{name: getattr(np, name) for name in dir(np) if not name.startswith("__")})
    numpy.asarray = lambda *args, **kwargs: np.asarray(*args, **kwargs).view(Unwritable)
    monkeypatch.setattr(data.text_tokens, "np", numpy)
    _no_space_left(monkeypatch)

    with pytest.raises(DiskFull, match=rf"^data.dir={tmp_path / 'data'} not prepared: the disk holding it is full;"):
        ensure_prepared(DataConfig(input=str(corpus_path), dir=str(tmp_path / "data")))  # data.dir, not a temporary
    assert not (tmp_path / "data").exists() and not list(tmp_path.iterdir())


def test_a_full_disk_under_metrics_jsonl_is_one_line(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.write({"iter": 1, "train_loss": 1.0, "lr": 1e-3})
    before = (tmp_path / METRICS_NAME).read_bytes()
    with mock.patch("builtins.open", side_effect=OSError(errno.EDQUOT, "Disk quota exceeded")):
        with pytest.raises(DiskFull, match=rf"{METRICS_NAME} not written: the disk holding .* is full"):
            log.write({"iter": 2, "train_loss": 1.0, "lr": 1e-3})
    assert (tmp_path / METRICS_NAME).read_bytes() == before


_WRITER = """
import os, sys, torch
sys.path.insert(0, {repo!r})
from pathlib import Path
from model import GPT, GPTConfig
from model.gpt import Checkpoint, Progress, save_checkpoint
torch.set_num_threads(1)  # no OpenMP pool for a forked child to inherit
path = Path({path!r})
config = GPTConfig(vocab_size=250_000, block_size=8, n_layer=1, n_head=1, n_embd=8)  # 4M numbers: 16 MB a write
shapes = GPT(config).state_dict()
weights = [{{name: torch.full_like(w, float(i)) for name, w in shapes.items()}} for i in (1, 2)]
states = [Checkpoint(config, w, {{}}, progress=Progress(iter=i)) for i, w in zip((1, 2), weights)]
save_checkpoint(path, states[0])
for _ in sys.stdin:  # each line: a writer process, forked from this one, whose pid the test kills with SIGKILL
    pid = os.fork()
    if pid == 0:
        i = 0
        while True:
            i += 1
            save_checkpoint(path, states[i % 2])
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def test_kill_9_during_checkpoint_writes_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """Each writer is its own process (forked, so torch is imported once), killed -9 while it saves in a loop."""
    path = tmp_path / CKPT_NAME
    writers = subprocess.Popen(
        [sys.executable, "-c", _WRITER.format(repo=str(REPO), path=str(path))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for delay in (0.13, 0.37, 0.71):
            writers.stdin.write("write\n")
            writers.stdin.flush()
            pid = int(writers.stdout.readline())
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            assert writers.stdout.readline().strip() == "reaped"
            ckpt = load_checkpoint(path)
            assert ckpt.progress.iter in (1, 2)
            assert all(torch.equal(w, torch.full_like(w, float(ckpt.progress.iter))) for w in ckpt.model.values())
    finally:
        writers.stdin.close()
        assert writers.wait(timeout=60) == 0


def test_a_diverging_run_stops_naming_the_iteration_and_keeps_the_good_checkpoint(
    tmp_path: Path, corpus_path: Path
) -> None:
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 10})))
    good = (tmp_path / "run" / CKPT_NAME).read_bytes()
    explode = {"train.learning_rate": 1e30, "train.max_iters": 20, "train.eval_interval": 1, "resume": True}
    explode["resume_with_changes"] = True
    kept = r"the loss is not finite at iter 1\d.*; .*ckpt.pt keeps iter (1\d), the last good state"
    with pytest.raises(TrainingDiverged, match=kept) as info:
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **explode)))
    ckpt = load_checkpoint(tmp_path / "run" / CKPT_NAME)
    assert ckpt.progress.iter == int(re.search(kept, str(info.value)).group(1))  # the message names the file's
    assert (tmp_path / "run" / CKPT_NAME).read_bytes() == good or ckpt.progress.iter > 10
    assert math.isfinite(ckpt.progress.val_loss) and all(torch.isfinite(t).all() for t in ckpt.model.values())


def test_a_diverged_run_under_skip_gives_up_writes_no_checkpoint_and_strict_metrics(
    tmp_path: Path, corpus_path: Path
) -> None:
    """lr 1e30 makes the weights so large that every later loss is NaN: each step is skipped, the evaluation at 10,
    NaN too, writes no checkpoint, and the one at 20, none of whose steps since 10 applied, gives up in one line."""
    extra = {"train.learning_rate": 1e30, "train.warmup_iters": 0, "train.on_nonfinite": "skip"}
    with pytest.raises(TrainingDiverged, match=r"at the last 1\d steps, up to iter 19: .* gives up; no ckpt.pt"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **extra)))
    assert not (tmp_path / "run" / CKPT_NAME).exists()
    # metrics.jsonl stays strict JSON: the NaN val losses are written null, and read back as NaN
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    strict = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl")) for line in lines]
    vals = [(r["iter"], r["val_loss"]) for r in strict if "val_loss" in r]
    assert vals[-1] == (10, None) and math.isfinite(vals[0][1])
    records, damaged = read_records(tmp_path / "run")
    assert damaged == 0 and math.isnan([r for r in records if "val_loss" in r][-1]["val_loss"])


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    path = tmp_path / CKPT_NAME
    torch.save({"model": _RunsCode(marker), "model_config": {}}, path)
    with pytest.raises(CheckpointError, match=f"{path} is not a readable checkpoint") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)
    assert not marker.exists()
    pickle.loads(pickle.dumps(_RunsCode(marker)))  # the payload is real: plain unpickling runs it
    assert marker.exists()


@pytest.mark.parametrize("content", ["truncated", "text", "empty"])
def test_truncated_or_foreign_checkpoints_are_one_line_errors(tmp_path: Path, content: str) -> None:
    path = tmp_path / CKPT_NAME
    save_checkpoint(path, _tiny_checkpoint(1.0, 1))
    data = {
        "truncated": path.read_bytes()[: path.stat().st_size // 2],
        "text": b"hello, not a checkpoint\n",
        "empty": b"",
    }[content]
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=str(path)) as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_sampling_refuses_a_checkpoint_without_a_tokenizer(tmp_path: Path) -> None:
    from common.config import typed_config
    from inference.sampling import SampleConfig, load_sampler

    save_checkpoint(tmp_path / CKPT_NAME, _tiny_checkpoint(0.0, 1))  # tokenizer={}
    with pytest.raises(CheckpointError, match=f"{tmp_path / CKPT_NAME} holds no tokenizer"):
        load_sampler(typed_config(SampleConfig(out_dir=str(tmp_path)), SampleConfig))


def test_sample_py_names_a_broken_checkpoint(tmp_path: Path) -> None:
    (tmp_path / CKPT_NAME).write_text("not a checkpoint")
    result = run_in_process("sample.py", [f"out_dir={tmp_path}"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {tmp_path / CKPT_NAME} is not a readable checkpoint")


def test_a_prompt_longer_than_the_context_is_cropped_with_a_warning(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from conftest import sample_py

    prompt = tmp_path / "long.txt"
    prompt.write_text("the " * 20)  # 80 characters, block_size 32
    sample_py([f"out_dir={trained_run}", f"start=FILE:{prompt}", "num_samples=1", "max_new_tokens=5"])
    out, err = capsys.readouterr()
    assert "warning: the prompt has 80 tokens; the model sees only its last 32" in err
    assert out.startswith("the " * 20)


def test_an_unavailable_device_is_a_one_line_error(
    trained_run: Path, tmp_path: Path, corpus_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The command's line, from train.py; sample.py's main says the same."""
    from conftest import sample_py, user_error

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_in_process("train.py", [*tiny_run_overrides(tmp_path, corpus_path), "device=cuda"], cwd=tmp_path)
    line = result.stderr.strip()
    assert result.returncode == 2 and "\n" not in line and "device=cuda" in line and "device=cpu" in line, line
    line = user_error(capsys, lambda: sample_py([f"out_dir={trained_run}", "device=cuda"])).strip()
    assert "\n" not in line and "device=cuda" in line and "device=cpu" in line, line


def test_a_new_run_refuses_a_directory_that_holds_one(tmp_path: Path, corpus_path: Path) -> None:
    from common.errors import ConfigError

    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 5})))
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run; pass resume=true"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 5})))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_resuming_a_run_that_reached_its_target_does_nothing_more(tmp_path: Path, corpus_path: Path) -> None:
    first = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **REACHES_TARGET)))
    again = train(compose_config(tiny_run_overrides(tmp_path, corpus_path, resume=True, **REACHES_TARGET)))
    assert again.iters == first.iters < 400
    records = (tmp_path / "run" / "metrics.jsonl").read_text().count("time_to_target_s")
    assert records == 1


def _raw(path: Path) -> dict:
    """ckpt.pt as stored: a flat dict."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _resume_copy(half_run: tuple[Path, Path], tmp_path: Path, corpus_path: Path, rewrite: Callable) -> None:
    """Copy the half run, rewrite its checkpoint's raw dict, resume it to 40: the same val losses as the whole."""
    whole, half = half_run
    shutil.copytree(half, tmp_path / "b")
    path = tmp_path / "b" / "run" / CKPT_NAME
    rewritten = rewrite(_raw(path), path)
    torch.save(rewritten, path)
    resumed = train(
        compose_config(tiny_run_overrides(tmp_path / "b", corpus_path, resume=True, resume_with_changes=True, **HALF))
    )
    assert resumed.iters == 40
    assert _val_losses(tmp_path / "b" / "run") == _val_losses(whole)
    if "log_steps" in rewritten:  # older layouts start the line under way afresh at the resume
        assert _train_losses(tmp_path / "b" / "run") == _train_losses(whole)


def test_a_checkpoint_from_before_torchrun_support_resumes_exactly(
    half_run: tuple[Path, Path], tmp_path: Path, corpus_path: Path
) -> None:
    """Earlier checkpoints keyed the optimizer state by position and held one random state, not one per rank."""
    from common.runtime import Runtime
    from training.distributed import load_full_state
    from training.schema import OptimConfig
    from training.trainer import make_optimizer

    def old_layout(raw: dict, path: Path) -> dict:
        model = load_checkpoint(path).build_model()
        optimizer = make_optimizer(model, OptimConfig(), Runtime(torch.device("cpu"), torch.float32))
        load_full_state(model, optimizer, raw["model"], raw["optimizer"])
        raw["optimizer"], raw["rng"] = optimizer.state_dict(), raw["rng"][0]
        del raw["elapsed_s"]  # not written before timed resumes either
        assert isinstance(next(iter(raw["optimizer"]["state"])), int)
        return raw

    _resume_copy(half_run, tmp_path, corpus_path, old_layout)


def test_a_checkpoint_in_the_layout_before_the_trainer_resumes_exactly_and_samples(
    half_run: tuple[Path, Path], tmp_path: Path, corpus_path: Path
) -> None:
    """The dict the training loop wrote by hand before model.gpt owned the format, key by key."""
    from common.config import typed_config
    from inference.sampling import SampleConfig, load_sampler
    from model.gpt import Decoding

    def before_the_trainer(raw: dict, path: Path) -> dict:
        legacy = {
            "model_config": raw["model_config"],
            "model": raw["model"],
            "optimizer": raw["optimizer"],
            "scaler": raw["scaler"],
            "iter": raw["iter"],
            "last_eval_iter": raw["last_eval_iter"],
            "val_loss": raw["val_loss"],
            "best_val_loss": raw["best_val_loss"],
            "rng": raw["rng"],
            "elapsed_s": raw["elapsed_s"],
            "tokenizer": raw["tokenizer"],
            "config": raw["config"],
        }
        # train.keep_best's (missing: none kept) and the precision trained in (missing: auto resumes in float32)
        added_since = {"kept_best_val_loss", "dtype", "log_loss_sum", "log_steps"}
        assert set(legacy) == set(raw) - added_since  # the keys today's writer keeps
        return legacy

    _resume_copy(half_run, tmp_path, corpus_path, before_the_trainer)
    sampler = load_sampler(typed_config(SampleConfig(out_dir=str(tmp_path / "b" / "run")), SampleConfig))
    (sample,) = sampler.generate(sampler.encode_prompt("The"), 1, 8, Decoding(0.8, 200))
    assert len(sampler.tokenizer.decode(sample.ids)) == len("The") + 8
