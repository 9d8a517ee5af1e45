"""bench.py and the GPU check end to end on tiny sizes (their figures are for real sizes, not tests); the memory
estimate against the tensor bytes measured, and the commands that refuse, before allocating, what can't fit."""

import json
import re
from pathlib import Path

import pytest
import torch

import bench
from conftest import refused, run_in_process
from model import GPTConfig


def test_bench_py_runs_every_section_on_tiny_sizes(tmp_path: Path, corpus_path: Path) -> None:
    out = tmp_path / "bench.json"
    tiny_train = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16", "train.batch_size=4",
                  f"data.input={corpus_path}", f"data.dir={tmp_path / 'data'}"]
    args = ("train attention sampling sampling-batch memory --memory-probes 0 --num-samples 2 --device cpu --repeats 1 "
            "--train-iters 3 --lengths 16 --block-size 32 --new-tokens 8 --compile-backend aot_eager").split()
    overrides = [a for o in tiny_train for a in ("--override", o)]
    result = run_in_process("bench.py", [*args, "--json", str(out), *overrides], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    train = [r for r in rows if r["section"] == "train"]
    assert [r["loop"] for r in train] == ["nanoGPT, eager", "nanoGPT, compiled", "train.py"]
    assert all(r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 and r["peak"] == "measured float32 matmul" for r in train)
    assert train[1]["vs_compiled_nanogpt"] == 1
    attention = [r for r in rows if r["section"] == "attention"]
    assert {(r["attn_impl"], r["window"], r["T"]) for r in attention} == {("flash", "-", 16), ("math", "-", 16),
                                                                          ("flash", 256, 16)}
    assert all(r["seconds"] > 0 and r["peak_mib"] >= 0 and r["time_vs_shortest"] == 1 for r in attention)
    sampling = [r for r in rows if r["section"] == "sampling"]
    assert {(r["attn_impl"], r["kv_cache"]) for r in sampling} == {(a, c) for a in ("flash", "math")
                                                                   for c in (False, True)}
    assert all(column in result.stdout for column in ("vs_compiled_nanogpt", "time_vs_shortest", "speedup"))
    batch = [r for r in rows if r["section"] == "sampling: batch and nanoGPT"]
    assert [r["way"] for r in batch] == ["nanoGPT's loop, one at a time", "one at a time, KV cache",
                                         "one batch, KV cache (sample.py)", "the same, streamed"]
    assert batch[0]["vs_nanogpt"] == 1 and all(r["tokens_per_sec"] > 0 and r["samples"] == 2 for r in batch)
    fits = [r for r in rows if r["section"] == "memory: what fits (bf16, block 1024)"]
    assert len(fits) == 16 and fits[0]["plain"] == "batch_size=20 grad_accum=24"  # docs/gpu.md's table
    unknown = run_in_process("bench.py", ["trian"], cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown section trian" in unknown.stderr


GPU_CHECK_STEPS = ["preflight", "gpt2", "speedrun_gpu", "shakespeare", "cuda steps", "memory", "sample", "flash = math",
                   "compile"]


def test_gpu_check_dry_run_passes_on_cpu(tmp_path: Path, corpus_path: Path) -> None:
    """Every step in order, each within its limit; per-seed results after a warm-up job, the ratio from the medians,
    the skip checks, the memory verdicts, and the runs' files and maps kept in --out."""
    out = tmp_path / "check"
    result = run_in_process("scripts/gpu_check.py", ["--dry-run", "--text", str(corpus_path), "--out", str(out)],
                            tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    steps = {step["step"]: step for step in report["steps"]}
    assert list(steps) == GPU_CHECK_STEPS
    assert all(s["ok"] and 0 < s["took_s"] <= s["limit_s"] for s in steps.values()), result.stdout
    assert report["versions"]["torch"] == torch.__version__
    gpt2 = steps["gpt2"]
    reference = gpt2["nanoGPT, compiled tokens_per_sec"]
    assert gpt2["vs_compiled_nanogpt"] == pytest.approx(gpt2["tokens_per_sec"] / reference)
    speedrun, recipe = steps["speedrun_gpu"], steps["shakespeare"]
    assert list(speedrun["per_seed"]) == ["1337", "1", "2"] and list(recipe["per_seed"]) == ["1337"]
    for run in [*speedrun["per_seed"].values(), *recipe["per_seed"].values()]:
        assert run["best_val"] <= 4.0 and run["best_val_iter"] == run["iters"] and run["ms_per_iter"] > 0
        assert run["time_to_target_s"] > 0 and run["graphs"] == 0 and run["error"] is None  # none after the warm-up
    times = sorted(run["time_to_target_s"] for run in speedrun["per_seed"].values())
    assert speedrun["median_time_to_target_s"] == times[1] and speedrun["warm_up_s"] > 0
    ratio = recipe["speedrun_gpu / recipe (target <= 0.35)"]
    assert ratio == pytest.approx(times[1] / recipe["median_time_to_target_s"])
    assert all(steps["cuda steps"][f"{o} skips"] == "both, the steps around them applied" for o in ("adamw", "muon"))
    assert all(0.9 <= steps["memory"][f"{kind} predicted_over_measured"] <= 1.1 for kind in ("plain", "checkpointed"))
    assert steps["compile"]["windowed logits vs eager"] <= 1e-3 and speedrun["warm_up_graphs"] == 0  # CPU: eager
    runs = [out / "runs" / "speedrun_gpu" / f"seed{seed}" for seed in (1337, 1, 2)]
    assert all((run / "metrics.jsonl").is_file() and (run / "config.yaml").is_file() for run in runs)
    assert (out / "maps" / "index.html").is_file() and (out / "logs" / "speedrun_gpu.log").is_file()


def test_gpu_check_stops_at_its_deadline_and_marks_the_steps_it_did_not_reach(tmp_path: Path, corpus_path: Path
                                                                             ) -> None:
    out = tmp_path / "check"
    args = ["--dry-run", "--text", str(corpus_path), "--out", str(out), "--deadline", "3"]
    assert run_in_process("scripts/gpu_check.py", args, tmp_path).returncode == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert [step["step"] for step in report["steps"]] == GPU_CHECK_STEPS and report["steps"][0]["ok"]
    stopped = [step for step in report["steps"] if "error" in step]
    assert len(stopped) == 1 and stopped[0]["error"].startswith("stopped at its limit")
    after = report["steps"][report["steps"].index(stopped[0]) + 1 :]
    assert after and all(step["skipped"] == "the 3 s deadline had passed" for step in after)
    assert report["total_s"] < 15  # the step under way is stopped at the deadline, its processes killed


@pytest.mark.parametrize(
    "probe",
    [  # (n_layer, n_embd, block_size, batch_size, checkpointing, vocab_size, bf16, compiled); the GPU check's dry run
        # judges a vocabulary whose logits dominate, and a checkpointed model under bf16 autocast
        (4, 64, 128, 8, 0, 65, 1, 0),  # the blocks dominate, under bf16 autocast
        (4, 64, 128, 8, 1, 65, 0, 0),  # checkpointed
        (2, 64, 128, 8, 1, 2048, 1, 0),
    ],
)
def test_the_predicted_peak_is_within_10_percent_of_the_measured_tensor_bytes(probe: tuple[int, ...]) -> None:
    """Two AdamW steps on CPU: the peak of live tensor bytes, from every allocation and free the profiler records."""
    row = bench.probe_row(probe, "cpu")
    assert 0.9 <= row["predicted_over_measured"] <= 1.1, row


def test_checkpointing_fits_larger_batches_and_the_largest_batch_fits() -> None:
    """A batch fits when its predicted tensors, with the allocator's reserve, and the CUDA context fit the GPU."""
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False)
    gpu = 20 * 2**30
    plain, checkpointed = (bench.largest_batch(gpt2, gpu, True, ck) for ck in (False, True))
    assert 0 < plain < checkpointed
    for batch, ck in ((plain, False), (checkpointed, True)):
        fits, one_more = (bench.training_memory(gpt2, b, True, ck) * bench.RESERVED_OVER_ALLOCATED
                          + bench.CUDA_CONTEXT for b in (batch, batch + 1))
        assert fits <= gpu < one_more
    assert bench.largest_batch(gpt2, 2**30, True, True) == 0  # the weights and AdamW's state alone take 1.5 GiB


def test_an_absurd_model_or_sample_count_is_one_line_from_the_command_line(
    tmp_path: Path, corpus_path: Path, trained_run: Path
) -> None:
    """sample.py num_samples=10000000 once took 7.5 GB before it was stopped: each sample has a KV cache."""
    args = [f"data.input={corpus_path}", f"data.dir={tmp_path / 'data'}", "model.n_embd=65536", "model.n_layer=64"]
    result = run_in_process("train.py", [*args, "device=cpu", f"out_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert " GiB" in refused(result) and not (tmp_path / "run").exists()
    result = run_in_process("sample.py", [f"out_dir={trained_run}", "num_samples=10000000", "max_new_tokens=5"],
                            tmp_path)
    assert re.fullmatch(r"error: num_samples=10000000 needs about .* GiB, .*; lower num_samples", refused(result))


def test_evaluation_scores_in_passes_that_fit(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """eval.py batch_size=100000 on GPT-2's vocabulary once took 5 GB: the batch is lowered to what fits in half the
    memory (the sums are the same in more passes), and a single window that can't fit is refused."""
    import common.runtime
    from common.errors import ConfigError
    from inference.eval_run import _fitting_batch

    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=2, n_head=2, n_embd=64)
    per_window = 1024 * (16 * 50257 + 64 * 64)
    monkeypatch.setattr(common.runtime, "memory_bytes", lambda device: 2 * 10 * per_window)
    monkeypatch.setattr("inference.eval_run.memory_bytes", lambda device: 2 * 10 * per_window)
    assert _fitting_batch(100_000, config, 1024, torch.device("cpu")) == 10
    assert "batch_size=100000 windows don't fit in memory; scoring 10 a pass" in capsys.readouterr().err
    assert _fitting_batch(4, config, 1024, torch.device("cpu")) == 4
    monkeypatch.setattr(common.runtime, "memory_bytes", lambda device: per_window // 2)
    with pytest.raises(ConfigError, match="^one window of context=1024 needs about .*; lower context$"):
        _fitting_batch(4, config, 1024, torch.device("cpu"))
