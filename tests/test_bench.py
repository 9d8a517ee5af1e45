"""bench.py and the GPU check run end to end on tiny sizes (their figures are for real sizes, not tests)."""

import json
from pathlib import Path

import pytest
import torch

import bench
from conftest import run_in_process, run_script


def test_bench_py_runs_every_section_on_tiny_sizes(tmp_path: Path, corpus_path: Path) -> None:
    out = tmp_path / "bench.json"
    tiny_train = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16", "train.batch_size=4",
                  f"data.input={corpus_path}", f"data.dir={tmp_path / 'data'}"]
    args = ("train attention sampling sampling-batch memory --memory-probes 0 --num-samples 2 --device cpu --repeats 1 "
            "--train-iters 3 --lengths 16 --block-size 32 --new-tokens 8 --compile-backend aot_eager").split()
    args += ["--json", str(out), *(arg for override in tiny_train for arg in ("--override", override))]
    result = run_script("bench.py", args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    train_rows = [r for r in rows if r["section"] == "train"]
    assert [r["loop"] for r in train_rows] == ["nanoGPT, eager", "nanoGPT, compiled", "train.py"]
    assert all(
        r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 and r["peak"] == "measured float32 matmul" for r in train_rows
    )
    assert train_rows[1]["vs_compiled_nanogpt"] == 1 and "vs_compiled_nanogpt" in result.stdout
    attention = [r for r in rows if r["section"] == "attention"]
    assert {(r["attn_impl"], r["window"], r["T"]) for r in attention} == {("flash", "-", 16), ("math", "-", 16),
                                                                          ("flash", 256, 16)}  # a fresh process each
    assert all(r["seconds"] > 0 and r["peak_mib"] >= 0 and r["time_vs_shortest"] == 1 for r in attention)
    sampling = [r for r in rows if r["section"] == "sampling"]
    assert {(r["attn_impl"], r["kv_cache"]) for r in sampling} == {
        (a, c) for a in ("flash", "math") for c in (False, True)
    }
    assert "speedup" in result.stdout and "time_vs_shortest" in result.stdout
    batch = [r for r in rows if r["section"] == "sampling: batch and nanoGPT"]
    assert [r["way"] for r in batch] == [
        "nanoGPT's loop, one at a time",
        "one at a time, KV cache",
        "one batch, KV cache (sample.py)",
        "the same, streamed",
    ]
    assert batch[0]["vs_nanogpt"] == 1 and all(r["tokens_per_sec"] > 0 and r["samples"] == 2 for r in batch)
    fits = [r for r in rows if r["section"] == "memory: what fits (bf16, block 1024)"]
    assert len(fits) == 16 and fits[0]["plain"] == "batch_size=20 grad_accum=24"  # docs/gpu.md's table


def test_bench_py_rejects_an_unknown_section(tmp_path: Path) -> None:
    result = run_in_process("bench.py", ["trian"], cwd=tmp_path)
    assert result.returncode == 2 and "unknown section trian" in result.stderr


def test_the_measured_matmul_peak_leaves_the_global_random_state_alone() -> None:
    state = torch.get_rng_state()
    assert bench.matmul_flops(torch.device("cpu"), torch.float32) > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_gpu_check_dry_run_passes_on_cpu(tmp_path: Path, corpus_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    result = run_in_process("scripts/gpu_check.py", ["--dry-run", "--text", str(corpus_path), "--out", str(out)],
                            tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = json.loads(out.read_text())
    assert [c["check"] for c in checks] == [
        "flash = math (float32)",
        "flash = math (bfloat16)",
        "flash = math (float32, window 5)",
        "flash = math (bfloat16, window 5)",
        "compile: one graph, no recompiles",
        "memory: peak against the prediction",
        "GPT-2 124M throughput (tiny stand-in)",
        "shakespeare to val <= 4.0 (whole val split, 1 seed)",
        "speedrun_gpu to val <= 4.0 (whole val split, 3 seeds)",
        "time to target: speedrun_gpu / recipe <= 0.35",
        "sample.py: attention maps and check_causal",
    ]
    assert all(c["ok"] for c in checks)
    compiled, memory, gpt2, recipe, speedrun, ratio = checks[4:10]
    assert compiled["graphs"] == 1
    # tensor bytes on CPU: a vocabulary of 2048, where the logits dominate, then checkpointing in bf16 autocast
    assert all(0.9 <= memory[f"{kind} predicted_over_measured"] <= 1.1 for kind in ("plain", "checkpointed"))
    assert memory["compiled predicted_over_measured"] > 0  # compiled by aot_eager: captured, not judged
    ours, reference = gpt2["tokens_per_sec"], gpt2["nanoGPT, compiled tokens_per_sec"]
    assert ours > 0 and gpt2["vs_compiled_nanogpt"] == pytest.approx(ours / reference)
    assert len(recipe["time_to_target_s"]) == 1 and len(speedrun["time_to_target_s"]) == 3
    times = sorted(speedrun["time_to_target_s"])
    assert ratio["ratio"] == pytest.approx(times[1] / recipe["time_to_target_s"][0])
    assert all(0 < c["took_s"] and c["budget_s"] > 0 for c in checks)
    assert result.stdout.splitlines()[-1].startswith("total ") and result.stdout.splitlines()[-1].endswith("of 480 s")
