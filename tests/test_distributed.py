"""torchrun on CPU (gloo): N processes train exactly what one process trains with the same global batch."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common.config import typed_config
from common.errors import ConfigError
from common.files import CKPT_NAME
from common.runtime import World, close_process_group
from conftest import REPO, built_once, compose_config, run_in_process, tiny_run_overrides, wait_for_text
from model.checkpoint import load_checkpoint
from train import TrainRunConfig, check_for_world, train
from training.trainer import split_across_ranks

# Four micro-batches a step: one process runs all four, each of two processes two (gradients reduced on the
# second). eval_iters is odd so the train-split batches don't divide evenly between the ranks; the val split is
# evaluated whole (full_val). The first layer attends through a sliding window (its fused path: windowed_attention)
# and hands its values to the second (value_residual: an argument and a return of the blocks, which FSDP2 wraps).
RUN = {
    "train.grad_accum": 4,
    "train.eval_iters": 5,
    "train.full_val": True,
    "train.max_iters": 12,
    "model.attn_window": 8,
    "model.value_residual": True,
}


def torchrun_env(processes: int, threads: int | None = None) -> dict[str, str]:
    """The cores shared out between the processes (threads: each one's, if given): two processes with every core's
    thread each ran 3.5x slower on 2 cores (these runs compare within 1e-4, not bit for bit)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads or max(1, torch.get_num_threads() // processes))}


def torchrun(processes: int, args: list[str], cwd: Path, threads: int | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = torchrun_env(processes, threads)
    return subprocess.run([*command, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def failure(result: subprocess.CompletedProcess) -> str:
    """torchrun's summary ends stderr; a rank's own dying words (a C++ abort) come earlier, so keep those too."""
    words = ("terminate called", "what():", "Fatal Python error", "Traceback", "Error")
    dying = [line for line in result.stderr.splitlines() if any(w in line for w in words)]
    return "\n".join(dying[:40]) + "\n...\n" + result.stderr[-2000:]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def same_evaluations(one: Path, two: Path, iters: list[int]) -> list[list[float]]:
    """Two runs' losses at every evaluation (train, val, val_bpb), equal within 1e-4: the second's."""
    evals = [[r for r in records(run) if "val_loss" in r] for run in (one, two)]
    assert [r["iter"] for r in evals[0]] == [r["iter"] for r in evals[1]] == iters
    losses = [[[r["train_loss"], r["val_loss"], r["val_bpb"]] for r in run_evals] for run_evals in evals]
    for want, have in zip(*losses, strict=True):
        assert have == pytest.approx(want, abs=1e-4)
    return losses[1]


# The two-process runs: FSDP2 with AdamW, and Muon under DDP (every rank orthogonalises the same averaged gradients;
# DDP with AdamW: test_compiled_ddp_on_two_processes_matches_one_eager_process). Both recompute their blocks in
# backward (train.activation_checkpointing), which changes no number.
TWO_PROCESS_RUNS = {"fsdp": ("fsdp", "adamw"), "ddp-muon": ("ddp", "muon")}


@pytest.fixture(params=list(TWO_PROCESS_RUNS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, corpus_path: Path):
    """A TWO_PROCESS_RUNS run and the one-process run with its optimizer, each trained once. Each rank resolves the
    former's out_dir differently (its ${now:}, here even its rank): all must use rank 0's."""
    parallel, optimizer = TWO_PROCESS_RUNS[request.param]

    def two(tmp: Path) -> None:
        overrides = [o for o in tiny_run_overrides(tmp, corpus_path, **RUN) if not o.startswith("out_dir=")]
        out_dir = "out_dir=outputs/${now:%Y-%m-%d_%H-%M-%S}/rank${oc.env:RANK}"
        chosen = [f"train.parallel={parallel}", f"train.optimizer={optimizer}", "train.activation_checkpointing=true"]
        result = torchrun(2, [*overrides, out_dir, *chosen], cwd=tmp)
        assert result.returncode == 0, failure(result)
        assert [p.name for p in tmp.glob("outputs/*/*")] == ["rank0"], "the ranks wrote to different directories"

    def one(tmp: Path) -> None:
        train(compose_config(tiny_run_overrides(tmp, corpus_path, **RUN, **{"train.optimizer": optimizer})))

    two_dir = next(built_once(tmp_path_factory, request.param, two).glob("outputs/*/rank0"))
    return two_dir, built_once(tmp_path_factory, f"one-{optimizer}", one) / "run"


def test_two_processes_match_one_process_and_only_rank_0_writes_the_run(runs: tuple[Path, Path]) -> None:
    """The standard for DDP and FSDP2 alike: the same losses at every evaluation, within 1e-4."""
    two_processes, one_process = runs
    got = same_evaluations(one_process, two_processes, [0, 10, 12])
    assert got[-1][1] < got[0][1] - 0.2  # and the runs did learn something
    lines = [(r["iter"], "val_loss" in r) for r in records(two_processes)]
    assert len(lines) == len(set(lines))  # no record written twice
    files = sorted(p.name for p in two_processes.iterdir())
    assert files == [".hydra", ".lock", CKPT_NAME, "config.yaml", "metrics.jsonl", "train.log"]
    log = (two_processes / "train.log").read_text()
    assert "2 processes" in log and log.count("done:") == 1
    cwd = two_processes.parents[2]  # tmp/outputs/DATE_TIME/rank0
    assert (cwd / OmegaConf.load(two_processes / "config.yaml").out_dir).resolve() == two_processes.resolve()


def test_fsdp_checkpoint_loads_in_one_process_resumes_and_samples(runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Gathered full state: the names and shapes of a one-process checkpoint, for FSDP2 (and DDP)."""
    two_processes, one_process = runs
    sharded = load_checkpoint(two_processes / CKPT_NAME)
    single = load_checkpoint(one_process / CKPT_NAME)
    assert sharded.model.keys() == single.model.keys()
    for name, tensor in single.model.items():
        torch.testing.assert_close(sharded.model[name], tensor, atol=1e-3, rtol=0)
    assert sharded.optimizer["state"].keys() == single.optimizer["state"].keys()

    run = tmp_path / "run"
    shutil.copytree(two_processes, run)
    sample = run_in_process("sample.py", [f"out_dir={run}", "max_new_tokens=8", "num_samples=1"], tmp_path)
    assert sample.returncode == 0, sample.stderr
    config = OmegaConf.load(run / "config.yaml")  # resumed by one process, optimizer state and all
    config.out_dir, config.resume, config.train.max_iters = str(run), True, 14
    config.resume_with_changes = True
    assert train(config).iters == 14 and [r["iter"] for r in records(run) if "val_loss" in r][-1] == 14


def test_grad_accum_must_divide_among_the_processes_and_muon_refuses_fsdp() -> None:
    """grad_accum is global; Muon needs each hidden matrix whole, which FSDP2 would shard (one process shards none)."""
    overrides = ["train.optimizer=muon", "train.parallel=fsdp", "train.grad_accum=3"]
    train = typed_config(compose_config(overrides), TrainRunConfig).train
    check_for_world(train, World(size=1))
    with pytest.raises(ConfigError, match=r"train.grad_accum=3 .* not divisible by the 2 processes"):
        check_for_world(train, World(rank=1, size=2))
    train.grad_accum = 2
    line = (
        "train.optimizer=muon needs each hidden matrix whole, and train.parallel=fsdp shards them; "
        "use train.parallel=ddp (or train.optimizer=adamw)"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
        check_for_world(train, World(rank=1, size=2))
    train.parallel = "ddp"
    check_for_world(train, World(rank=1, size=2))


@pytest.mark.parametrize("batches", [0, 1, 4, 5, 7])
def test_eval_batches_are_shared_once_each_with_equal_passes(batches: int) -> None:
    items = [(torch.tensor([i]), torch.tensor([i])) for i in range(batches)]
    shares = [list(split_across_ranks(iter(items), World(rank=r, size=3))) for r in range(3)]
    assert len({len(s) for s in shares}) == 1  # FSDP2: every rank runs the same number of forward passes
    counted = sorted(int(x) for share in shares for x, _, keep in share if keep)
    assert counted == list(range(batches))


@pytest.mark.parametrize("runs", ["fsdp"], indirect=True)
def test_an_fsdp_run_resumes_on_two_processes_and_a_sigterm_to_torchrun_stops_it_with_a_checkpoint(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """The full checkpoint's optimizer state loaded sharded; then a scheduler's SIGTERM reaches torchrun, which
    forwards it: the ranks agree on a step, and rank 0 writes the checkpoint before any rank exits."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    resumed_at = load_checkpoint(run / CKPT_NAME).progress.iter
    args = [f"out_dir={run}", "resume=true", "resume_with_changes=true", "train.max_iters=100000"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", REPO / "train.py"]
    process = subprocess.Popen(
        [*command, *args, "train.log_interval=1"], cwd=tmp_path, stderr=subprocess.PIPE, text=True, env=torchrun_env(2)
    )
    wait_for_text(run / "metrics.jsonl", f'{{"iter": {resumed_at + 3}, ')  # a few steps after the resume
    assert process.poll() is None, process.communicate()[1][-3000:]
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    stopped_at = load_checkpoint(run / CKPT_NAME).progress.iter
    log = (run / "train.log").read_text()
    assert stopped_at >= resumed_at + 3 and "stopped by SIGTERM" in log, stderr[-3000:]
    assert f"resuming {run} at iter {resumed_at}" in log and log.count("stopped by SIGTERM") == 1


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_closing_frees_an_fsdp_process_group_at_once_not_at_interpreter_exit(tmp_path: Path) -> None:
    """DTensor's caches keep FSDP2's mesh, and its gloo group, alive until exit, where the group's threads may
    drop tensors after Python is gone (a rare SIGABRT once training is done). close_process_group frees it."""
    def gloo_threads() -> int:
        names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
        return sum(name.startswith("pt_gloo") for name in names)

    before = gloo_threads()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = fully_shard(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), mesh=init_device_mesh("cpu", (1,))
        )
        model(torch.randn(2, 4)).sum().backward()
        assert gloo_threads() > before
        del model  # as train() drops its trainer
    finally:
        close_process_group()  # never leave the group to later tests
    assert gloo_threads() == before


# One micro-batch a process, so DDP syncs every backward (no no_sync variant to trace), and test_compile.py's GPT-2
# block with a windowed layer at its batch: the graphs it compiled are inductor's cache hits here.
COMPILED_RUN = {"model.bias": True, "model.block_size": 64, "model.attn_window": 16, "model.window_pattern": "SL",
                "model.pos_emb": "rope", "train.batch_size": 4, "train.grad_accum": 2, "train.max_iters": 6,
                "train.eval_interval": 6, "train.eval_iters": 2, "train.full_val": False}


def test_compiled_ddp_on_two_processes_matches_one_eager_process(tmp_path: Path, corpus_path: Path) -> None:
    """torch.compile (inductor) of the DDP-wrapped model, traced by each rank, trains what one uncompiled process
    trains: dynamo's DDP support keeps the gradient reduction in the compiled backward."""
    train(compose_config(tiny_run_overrides(tmp_path / "one", corpus_path, **COMPILED_RUN)))
    overrides = tiny_run_overrides(tmp_path / "two", corpus_path, **COMPILED_RUN, **{"train.compile": True})
    # test_compile's thread count too: inductor compiles it into its CPU kernels (and into its cache's keys)
    result = torchrun(2, [*overrides, "train.parallel=ddp"], cwd=tmp_path, threads=torch.get_num_threads())
    assert result.returncode == 0, failure(result)
    assert "compile True, 2 processes (ddp)" in (tmp_path / "two" / "run" / "train.log").read_text()
    got = same_evaluations(tmp_path / "one" / "run", tmp_path / "two" / "run", [0, 6])
    assert got[-1][1] < got[0][1]  # it learned
