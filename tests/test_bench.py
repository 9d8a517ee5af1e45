"""bench.py and the GPU check run end to end on tiny sizes (their figures are for real sizes, not tests)."""

import json
from pathlib import Path

import torch

import bench
from benchmarks import memory
from conftest import run_in_process, run_script
from model import GPTConfig


def test_bench_py_runs_every_section_on_tiny_sizes(tmp_path: Path, corpus_path: Path) -> None:
    out = tmp_path / "bench.json"
    tiny_train = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16", "train.batch_size=4",
                  f"data.input={corpus_path}", f"data.dir={tmp_path / 'data'}"]
    args = ("train attention sampling sampling-batch muon serve memory --memory-probes 0 --serve-clients 1 3 "
            "--serve-requests 1 --muon-shapes 24x8 8x16 --num-samples 2 --device cpu --repeats 1 --train-iters 3 "
            "--lengths 16 --block-size 32 --new-tokens 8").split()
    args += ["--json", str(out), *(arg for override in tiny_train for arg in ("--override", override))]
    result = run_script("bench.py", args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    train_rows = [r for r in rows if r["section"] == "train"]
    assert [r["loop"] for r in train_rows] == ["nanogpt-style eager", "train.py"]
    assert all(
        r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 and r["peak"] == "measured float32 matmul" for r in train_rows
    )
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
    muon = [r for r in rows if r["section"] == "muon: Newton-Schulz"]
    ways = ["ours, float32", "ours, bfloat16"] + ["torch.optim.Muon's (bfloat16)"] * hasattr(torch.optim, "Muon")
    assert [(r["shape"], r["way"]) for r in muon] == [(shape, way) for shape in ("24x8", "8x16") for way in ways]
    assert all(r["ms"] > 0 and 0.6 < r["sv_min"] <= r["sv_max"] < 1.2 and r["err_vs_uvt"] < 0.3 for r in muon)
    assert all((r["speedup"] == 1 and r["diff_vs_ours_fp32"] == 0) == (r["way"] == ways[0]) for r in muon)
    fits = [r for r in rows if r["section"] == "memory: what fits (bf16, block 1024)"]
    assert len(fits) == 16 and fits[0]["plain"] == "batch_size=18 grad_accum=27"  # docs/gpu.md's table
    serve = [r for r in rows if r["section"] == "serve"]
    assert [(r["way"], r["clients"]) for r in serve] == [
        ("sample.py, one sample", 1),
        ("the engine alone, in-process", 1),
        ("the engine alone, in-process", 3),
        ("serve.py, streaming clients", 1),
        ("serve.py, streaming clients", 3),
    ]
    assert all(r["aggregate_tokens_per_sec"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in serve)
    assert all((r["vs_one_client"] == 1) == (r["clients"] == 1) for r in serve)


def test_bench_py_rejects_an_unknown_section(tmp_path: Path) -> None:
    result = run_in_process("bench.py", ["trian"], cwd=tmp_path)
    assert result.returncode == 2 and "unknown section trian" in result.stderr


def test_the_measured_matmul_peak_leaves_the_global_random_state_alone() -> None:
    state = torch.get_rng_state()
    assert bench.matmul_flops(torch.device("cpu"), torch.float32) > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_checkpointing_fits_larger_batches_and_the_largest_batch_fits() -> None:
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    budget = 20 * 2**30
    plain, checkpointed = (memory.largest_batch(gpt2, budget, True, ck) for ck in (False, True))
    assert 0 < plain < checkpointed
    for batch, ck in ((plain, False), (checkpointed, True)):
        fits, one_more = (memory.training_memory(gpt2, b, True, ck) for b in (batch, batch + 1))
        assert fits <= budget < one_more
    assert memory.largest_batch(gpt2, 2**30, True, True) == 0  # the weights and AdamW's state alone take 1.9 GiB


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
        "shakespeare to val <= 4.0",
        "speedrun_gpu to val <= 4.0",
        "GPT-2 124M throughput (tiny stand-in)",
    ]
    assert all(c["ok"] for c in checks)
    # bench.py memory's first two probes on CPU (peak RSS above the RSS before the model, two AdamW steps in a process
    # of their own): GPT-2's vocabulary, where the logits and their gradients dominate, then activation checkpointing
    memory = checks[5]
    assert checks[4]["graphs"] == 1 and 0.85 <= memory["predicted_over_measured"] <= 1.15
    assert 0.85 <= memory["checkpointed_predicted_over_measured"] <= 1.15
    assert checks[6]["time_to_target_s"] > 0 and checks[7]["time_to_target_s"] > 0 and checks[8]["tokens_per_sec"] > 0
    assert all(0 < c["took_s"] and c["budget_s"] > 0 for c in checks)
    assert result.stdout.splitlines()[-1].startswith("total ") and result.stdout.splitlines()[-1].endswith("of 480 s")
