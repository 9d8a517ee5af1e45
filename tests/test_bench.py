"""bench.py and the GPU check run end to end on tiny sizes (their figures are for real sizes, not tests)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import training.machine as mfu
from conftest import REPO, run_script


def test_bench_py_runs_every_section_on_tiny_sizes(tmp_path: Path, corpus_path: Path) -> None:
    out = tmp_path / "bench.json"
    tiny_train = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=16",
        "model.block_size=16",
        "train.batch_size=4",
        f"data.input={corpus_path}",
        f"data.dir={tmp_path / 'data'}",
    ]
    args = [
        "train",
        "attention",
        "sampling",
        "sampling-batch",
        "muon",
        "serve",
        "memory",
        "--memory-probes",
        "0",
        "--serve-clients",
        "1",
        "3",
        "--serve-requests",
        "1",
        "--serve-tokens",
        "5",
        "--muon-shapes",
        "24x8",
        "8x16",
        "--num-samples",
        "2",
        "--device",
        "cpu",
        "--repeats",
        "1",
        "--train-iters",
        "3",
        "--lengths",
        "32",
        "16",
        "--attn-shape",
        "1",
        "2",
        "8",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "32",
        "--new-tokens",
        "8",
        "--json",
        str(out),
    ]
    for override in tiny_train:
        args += ["--override", override]
    result = run_script("bench.py", args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    train_rows = [r for r in rows if r["section"] == "train"]
    assert [r["loop"] for r in train_rows] == ["nanogpt-style eager", "train.py"]
    assert all(
        r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 and r["peak"] == "measured float32 matmul" for r in train_rows
    )
    attention = [r for r in rows if r["section"] == "attention"]
    assert {(r["attn_impl"], r["T"]) for r in attention} == {(i, t) for i in ("flash", "math") for t in (16, 32)}
    assert all(r["seconds"] > 0 and r["peak_mib"] >= 0 for r in attention)
    assert {r["window"] for r in attention} == {"-", 256}
    assert all((r["time_vs_shortest"] == 1) == (r["T"] == 16) for r in attention)  # given longest first
    sampling = [r for r in rows if r["section"] == "sampling"]
    assert {(r["attn_impl"], r["kv_cache"]) for r in sampling} == {
        (a, c) for a in ("flash", "math") for c in (False, True)
    }
    assert "speedup" in result.stdout and "math_over_flash_time" in result.stdout
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
    presets = [r for r in rows if r["section"] == "memory: presets"]
    assert {r["preset"] for r in presets} >= {"shakespeare_char_cpu", "gpt2"}
    assert all(r["fp32_gib"] > r["bf16_gib"] > r["bf16_checkpointed_gib"] > 0 for r in presets)
    fits = [r for r in rows if r["section"] == "memory: what fits (bf16, block 1024)"]
    assert len(fits) == 16 and fits[0]["plain"].startswith("batch_size=")
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
    result = run_script("bench.py", ["trian"], cwd=tmp_path)
    assert result.returncode == 2 and "unknown section trian" in result.stderr


@pytest.mark.parametrize(
    ("name", "dtype", "source"),
    [
        ("NVIDIA H200", torch.bfloat16, "datasheet H200 bfloat16"),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, "datasheet H100 bfloat16"),
        ("NVIDIA H100 PCIe", torch.float32, "datasheet H100 PCIe tf32"),
        ("NVIDIA L40S", torch.bfloat16, "datasheet L40S bfloat16"),
        ("NVIDIA L4", torch.float16, "datasheet L4 float16"),
        ("Tesla T4", torch.float16, "measured float16 matmul"),
    ],
)
def test_mfu_peak_comes_from_the_datasheet_by_whole_name_else_is_measured(
    monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype, source: str
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(mfu, "measure_matmul_flops", lambda device, dtype: 65e12)
    peak = mfu.peak_flops(torch.device("cuda"), dtype)
    assert peak.source == source
    if name == "NVIDIA H200":
        assert peak.flops == 989e12


def test_measured_peak_leaves_the_global_random_state_alone() -> None:
    state = torch.get_rng_state()
    assert mfu.measure_matmul_flops(torch.device("cpu"), torch.float32, n=64, repeats=1) > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_gpu_check_dry_run_passes_on_cpu(tmp_path: Path, corpus_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu_check.py"),
            "--dry-run",
            "--text",
            str(corpus_path),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
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
    assert checks[4]["graphs"] == 1 and checks[5]["skipped"] == "needs CUDA's allocator"  # said, not silent
    assert checks[6]["time_to_target_s"] > 0 and checks[7]["time_to_target_s"] > 0 and checks[8]["tokens_per_sec"] > 0
    assert all(0 < c["took_s"] and c["budget_s"] > 0 for c in checks)
    assert result.stdout.splitlines()[-1].startswith("total ") and result.stdout.splitlines()[-1].endswith("of 480 s")
