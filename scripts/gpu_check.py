"""Every figure a short GPU loan must bring back, from one run under one deadline (--deadline, 480 s by default). The
steps run in this order, so that a run cut short keeps the most; docs/gpu.md estimates each on an H100:

preflight      GPT-2's BPE ranks, offline, and the text; torch, CUDA, driver, GPU; free memory and the CUDA context's
gpt2           GPT-2 124M's tokens/s against nanoGPT's loop compiled (bench.py train): the main figure
speedrun_gpu   train.py runs to val 1.47 (whole val split), one a seed, after a warm-up job that compiles their graphs
shakespeare    nanoGPT's recipe the same way, one seed; the ratio of the two times to target, both warm
cuda steps     steady steps wait for nothing (sync debug mode), AdamW and Muon; a NaN loss, and an inf gradient with a
               finite loss, leave weights, moments and step counts bit for bit as they were
memory         the predicted peak against the measured one: plain and checkpointed judged (within 10 %), compiled
               measured after a warm-up step and reported
sample         sample.py on speedrun_gpu's checkpoint: attention maps and check_causal
flash = math   fused and textbook attention agree: fp32 and bf16 full, bf16 windowed
compile        eager = compiled float32 logits: a windowed rotary model and the default one

    python scripts/gpu_check.py --text input.txt --ranks r50k_base.tiktoken --out gpu_check   # on the GPU
    python scripts/gpu_check.py --dry-run --text input.txt --out /tmp/check                    # tiny, on CPU

Each step may take twice its estimate, or what is left of the deadline if less; one past it is stopped (its
processes killed), keeping what it had measured, and the steps not reached are recorded as skipped.
OUT/gpu_check.json is written after every step; OUT/runs/ keeps each training run's metrics.jsonl and config.yaml,
OUT/maps/ the attention maps, OUT/logs/ each command's output. Exits 1 if a check fails or is cut short.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch._dynamo.utils import counters

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import MEMORY_PROBES, probe_row, run_config  # noqa: E402
from common.files import CONFIG_NAME, METRICS_NAME, read_records  # noqa: E402
from common.runtime import World, make_runtime  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from train import build_trainer, train  # noqa: E402

# Seconds each step takes on one H100 (docs/gpu.md: how each is estimated); a step may take twice its estimate
ESTIMATE_S = {"preflight": 10, "gpt2": 125, "speedrun_gpu": 120, "shakespeare": 75, "cuda steps": 10, "memory": 40,
              "sample": 15, "flash = math": 10, "compile": 15}
SEEDS = (1337, 1, 2)  # speedrun_gpu's; the recipe runs the first
TARGET, TARGET_RATIO = 1.47, 0.35  # val loss; speedrun_gpu's time to it over the recipe's, at most (issue 55)
# The warm-up job before a preset's runs: its training and evaluation graphs compiled, in the process the runs share
WARM_UP = ["train.max_iters=2", "train.warmup_iters=0", "train.eval_from=0", "train.eval_interval=2",
           "train.target_val_loss=null"]
TINY_MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]
TINY_RUN = [*TINY_MODEL, "device=cpu", "train.batch_size=8", "train.max_iters=40", "train.eval_interval=10",
            "train.eval_from=0", "train.eval_iters=4", "train.full_val=false", "train.warmup_iters=5",
            "train.lr_decay_iters=40"]  # the dry run's: random val batches, not the whole split
# (n_layer, n_embd, block_size, batch_size, checkpointing, vocab_size, bf16, compiled): plain, checkpointed, compiled
DRY_RUN_PROBES = [(2, 64, 128, 8, 0, 2048, 0, 0), (4, 64, 128, 8, 1, 65, 1, 0), (2, 64, 128, 8, 0, 2048, 0, 1)]
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"  # tiktoken's cache key
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
STARTED = time.monotonic()


class StepTimeout(BaseException):
    """A step ran past its limit (SIGALRM, again every 5 s): no `except Exception` inside torch swallows it."""


def run_command(command: list[str], log: Path, result: dict) -> int | None:
    """command's exit status, its output in log; None if the step's limit came first: then its whole process group is
    killed (inductor's compile workers too). The step's result says whether it was stopped, and holds the output's
    tail if the command failed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out, subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True) as process:
        try:
            status = process.wait()
        except BaseException as err:
            os.killpg(process.pid, signal.SIGKILL)
            if not isinstance(err, StepTimeout):
                raise
            status = None
    result |= {"stopped": status is None, "log_tail": "" if status == 0 else log.read_text(errors="replace")[-600:]}
    return status


def bpe_ranks(ranks: Path | None) -> str | None:
    """None if tiktoken can read GPT-2's BPE ranks without a network (--ranks is copied into a cache it then reads),
    else why not: tiktoken would try to download them, and hang where packets are dropped."""
    name = hashlib.sha1(R50K_URL.encode()).hexdigest()
    if ranks is not None:
        if not ranks.is_file():
            return f"--ranks {ranks} is no file; pass r50k_base.tiktoken, GPT-2's BPE ranks"
        os.environ["TIKTOKEN_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="tiktoken-")  # the children inherit it
        shutil.copy(ranks, Path(cache) / name)
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    path = Path(cache or Path(tempfile.gettempdir()) / "data-gym-cache") / name
    if not path.is_file():
        return f"GPT-2's BPE ranks are not at {path}; pass --ranks r50k_base.tiktoken"
    if hashlib.sha256(path.read_bytes()).hexdigest() != R50K_SHA256:  # tiktoken would delete it and download
        return f"{path} is not r50k_base's ranks (its sha256 differs); pass --ranks r50k_base.tiktoken"
    return None


def preflight(args: argparse.Namespace, report: dict, result: dict) -> None:
    """The inputs (the BPE ranks first: the main figure needs them), versions, the GPU and its memory (the CUDA
    context: used memory outside the allocator, measured)."""
    args.ranks_missing = bpe_ranks(args.ranks)
    text = args.text is not None and args.text.is_file()
    result |= {"ok": text, "bpe_ranks": args.ranks_missing or "found",
               "text": str(args.text) if text else f"missing: pass --text, tiny Shakespeare's input.txt ({args.text})"}
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    report["versions"] = result["versions"] = versions
    if not args.dry_run:
        torch.zeros(1, device="cuda")  # the context made
        free, total = torch.cuda.mem_get_info()
        driver = None
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        versions |= {"gpu": torch.cuda.get_device_name(), "driver": driver, "gpu_memory_gib": total / 2**30}
        result |= {"free_gib": free / 2**30, "cuda_context_gib": cuda_context_gib()}


def cuda_context_gib() -> float:
    """The GPU memory this process uses outside PyTorch's allocator (the context, cuBLAS's handles, loaded kernels),
    the GPU being otherwise idle."""
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


def gpt2_throughput(args: argparse.Namespace, result: dict) -> None:
    """bench.py train on GPT-2 124M's shape (batch 12 x 1024, grad_accum 4; no evaluation): ours, and nanoGPT's loop
    eager and compiled, on tiny Shakespeare in GPT-2's BPE (throughput doesn't depend on the text)."""
    if args.dry_run:  # tiny, and compiled by aot_eager: the capture without code generation
        overrides = [*TINY_MODEL, "data=shakespeare_char", f"data.dir={args.work / 'data'}", "train.batch_size=4",
                     "train.grad_accum=1"]
        options = ["--train-iters", "3", "--compile-backend", "aot_eager"]
    elif args.ranks_missing:
        result["skipped"] = args.ranks_missing
        return
    else:
        overrides = ["data=shakespeare", f"data.dir={args.work / 'data_bpe'}", "train.grad_accum=4"]
        options = ["--train-iters", "10"]
    out, log = args.work / "train.json", args.out / "logs" / "gpt2.log"
    overrides.append(f"data.input={args.text}")
    command = [sys.executable, str(REPO / "bench.py"), "train", "--device", args.device, "--experiment", "gpt2",
               *options, *(option for override in overrides for option in ("--override", override)), "--json", str(out)]
    status = run_command(command, log, result)
    loops = {r["loop"]: r for r in json.loads(out.read_text())} if status == 0 else {}
    ours = loops.get("train.py", {})
    measured = re.search(r"^train\.py: ([\d.]+) tokens/s", log.read_text(errors="replace"), re.M)  # said early
    result |= {"ok": bool(ours), "tokens_per_sec": ours.get("tokens_per_sec", float(measured[1]) if measured else None),
               **{key: ours.get(key) for key in ("mfu", "peak", "vs_compiled_nanogpt")},
               **{f"{loop} tokens_per_sec": r["tokens_per_sec"] for loop, r in loops.items() if loop != "train.py"}}


def train_runs(args: argparse.Namespace) -> None:
    """--runs: a warm-up job, then a run a seed, in this one process: the runs reuse the warm-up's compiled graphs,
    so none of them pays a compile. Each run stops at val TARGET on the whole val split (a 20-batch train estimate);
    nanoGPT's recipe keeps its 5000-iteration schedule but stops by 2500. WORK/EXPERIMENT/jobs.json: each job's seconds
    and graphs compiled."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    experiment, root = args.runs, args.work / args.runs
    overrides = [f"experiment={experiment}", f"data.dir={args.work / 'data'}", f"data.input={args.text}",
                 f"train.target_val_loss={4.0 if args.dry_run else TARGET}", "train.full_val=true",
                 "train.eval_iters=20"]
    if experiment == "shakespeare":
        overrides += ["train.lr_decay_iters=5000", "train.max_iters=2500"]
    overrides += TINY_RUN if args.dry_run else []
    jobs: dict[str, dict] = {}
    for job, seed in [("warm-up", args.seeds[0]), *((f"seed{seed}", seed) for seed in args.seeds)]:
        warm_up = WARM_UP if job == "warm-up" else []
        graphs, began = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            train(run_config([*overrides, f"seed={seed}", f"out_dir={root / job}", *warm_up]))
        except Exception as err:  # a diverged or out-of-memory seed: said, and the next one runs
            jobs[job] = {"error": f"{type(err).__name__}: {err}"[:300]}
        jobs[job] = {**jobs.get(job, {}), "seconds": time.perf_counter() - began,
                     "graphs": counters["stats"]["unique_graphs"] - graphs}
        (root / "jobs.json").write_text(json.dumps(jobs))


def seed_result(run: Path) -> dict:
    """One run's figures from its metrics.jsonl: iterations, best val and its iteration, time to target, ms/iter."""
    records = read_records(run)[0] if (run / METRICS_NAME).is_file() else []
    evals = [r for r in records if math.isfinite(r.get("val_loss", math.nan))]
    best = min(evals, key=lambda r: r["val_loss"], default={})
    paced = [r["ms_per_iter"] for r in records if "ms_per_iter" in r]
    return {"iters": max((r["iter"] for r in records), default=None), "best_val": best.get("val_loss"),
            "best_val_iter": best.get("iter"), "time_to_target_s": next(
                (r["time_to_target_s"] for r in records if "time_to_target_s" in r), None),
            "ms_per_iter": statistics.median(paced) if paced else None}


def preset_runs(args: argparse.Namespace, experiment: str, seeds: tuple[int, ...], report: dict, result: dict) -> None:
    """A preset's warm-up job and seeds (train_runs, as a child process); results keyed by seed, the runs' files kept
    in OUT/runs. Time to target: the median over seeds, a miss counting as none reached (infinite)."""
    log = args.out / "logs" / f"{experiment}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--runs", experiment, "--seeds",
               ",".join(map(str, seeds)), "--work", str(args.work), "--text", str(args.text)]
    status = run_command(command + (["--dry-run"] if args.dry_run else []), log, result)
    root = args.work / experiment
    jobs = json.loads((root / "jobs.json").read_text()) if (root / "jobs.json").is_file() else {}
    per_seed = {str(seed): seed_result(root / f"seed{seed}") | {key: jobs.get(f"seed{seed}", {}).get(key) for key in (
        "graphs", "error")} for seed in seeds}
    for file in (*root.glob(f"*/{METRICS_NAME}"), *root.glob(f"*/{CONFIG_NAME}")):
        kept = args.out / "runs" / experiment / file.parent.name
        kept.mkdir(parents=True, exist_ok=True)
        shutil.copy(file, kept)
    times = [r["time_to_target_s"] or math.inf for r in per_seed.values()]
    median = statistics.median(times)
    warm_up = jobs.get("warm-up", {})
    result |= {"ok": status == 0 and math.inf not in times,
               "reached": f"{len(times) - times.count(math.inf)} of {len(times)}",
               "median_time_to_target_s": median if math.isfinite(median) else None, "per_seed": per_seed,
               "warm_up_s": warm_up.get("seconds"), "warm_up_graphs": warm_up.get("graphs")}
    if experiment == "shakespeare":
        result |= time_ratio(args, next((s for s in report["steps"] if s["step"] == "speedrun_gpu"), {}), result)


def time_ratio(args: argparse.Namespace, speedrun: dict, recipe: dict) -> dict:
    """speedrun_gpu's median time to target over the recipe's, both warm (no compile in either), and both with their
    warm-up job's seconds added (about what each would take compiling alone)."""
    times = [speedrun.get("median_time_to_target_s"), recipe["median_time_to_target_s"]]
    if None in times:
        return {"ok": False, "ratio": "not measured: a median time to target is missing"}
    warm_ups = [speedrun["warm_up_s"], recipe["warm_up_s"]]
    ratio, with_warm_up = times[0] / times[1], (times[0] + warm_ups[0]) / (times[1] + warm_ups[1])
    ok = ratio <= TARGET_RATIO or args.dry_run  # tiny models say nothing of the ratio
    return {"ok": recipe["ok"] and ok, f"speedrun_gpu / recipe (target <= {TARGET_RATIO})": ratio,
            "the same, each with its warm-up": with_warm_up}


def cuda_steps(args: argparse.Namespace, result: dict) -> None:
    """train.py's step on the tiny model, eager, for AdamW and Muon: steps 2-5 under CUDA's sync debug mode (each wait
    is a warning), an inf gradient with a finite loss at step 6, a NaN loss at step 8, train.on_nonfinite=skip. On a
    CPU no sync is counted (tests/test_trainer.py counts host reads there)."""
    result["ok"] = True
    for optimizer in ("adamw", "muon"):
        syncs, skipped = step_checks(args, optimizer)
        result |= {f"{optimizer} syncs in steps 2-5": len(syncs) if args.device == "cuda" else None,
                   f"{optimizer} skips": skipped, **({f"{optimizer} first syncs": syncs[:3]} if syncs else {})}
        result["ok"] &= not syncs and skipped == "both, the steps around them applied"


def step_checks(args: argparse.Namespace, optimizer: str) -> tuple[list[str], str]:
    """cuda_steps' for one optimizer: where steps 2-5 waited for the device, and whether both bad steps left the state
    as it was."""
    out_dir = args.work / f"steps-{optimizer}"
    config = run_config([*TINY_MODEL, f"device={args.device}", f"data.input={args.text}",
                         f"data.dir={args.work / 'data'}", f"out_dir={out_dir}", f"train.optimizer={optimizer}",
                         "train.max_iters=10", "train.compile=false", "train.eval_from=100", "train.log_interval=100",
                         "train.on_nonfinite=skip", "train.batch_size=8"])
    out_dir.mkdir(parents=True)
    trainer = build_trainer(config, World(), make_runtime(args.device, "auto"))
    model, cuda = trainer.model, args.device == "cuda"
    first_row = torch.tensor([0], device=model.lm_head.weight.device)
    model.transformer.h[0].mlp.c_fc.weight.register_hook(
        lambda g: g.index_fill(0, first_row, math.inf) if trainer.progress.iter == 6 else g)
    model.lm_head.register_forward_hook(
        lambda module, inputs, out: out * math.nan if trainer.progress.iter == 8 and module.training else out)
    states, syncs = {}, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def before_step(it: int) -> None:
            """Keeps a copy of the weights and every optimizer state tensor (moments, momentum buffers, step counts) and
            the warnings so far; CUDA warns of each sync in steps 2-5."""
            optimizer_state = trainer.optimizer.state_dict()["state"].values()
            moments = [v for s in optimizer_state for v in s.values() if torch.is_tensor(v)]
            states[it] = [v.clone() for v in (*model.state_dict().values(), *moments)]
            syncs[it] = len(caught)
            if cuda and it in (2, 6):
                torch.cuda.set_sync_debug_mode("warn" if it == 2 else "default")

        trainer.before_step = before_step
        try:
            trainer.fit()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    waits = [f"{w.filename}:{w.lineno}" for w in caught[syncs[2] : syncs[6]] if "synchroniz" in str(w.message)]
    same = {it: all(map(torch.equal, states[it], states[it + 1])) for it in (5, 6, 7, 8)}
    skipped = {(True, True): "both", (True, False): "the inf gradient only", (False, True): "the NaN loss only"}.get(
        (same[6], same[8]), "neither")
    applied = ", the steps around them applied" if not same[5] and not same[7] else ", but steps 5 or 7 changed nothing"
    return waits, skipped + applied


def peak_memory(args: argparse.Namespace, result: dict) -> None:
    """bench.py memory's probes, GPT-2 124M in bf16 on CUDA: the predicted peak over the measured one and the
    allocator's reserved over allocated; plain and checkpointed (batch 16) judged, compiled (batch 12: the gpt2 step's
    graph) measured after its warm-up step and reported, as the model is fitted on eager steps. The dry run compiles
    with aot_eager."""
    probes = DRY_RUN_PROBES if args.dry_run else MEMORY_PROBES["cuda"]
    result["ok"] = True
    for kind, probe in zip(("plain", "checkpointed", "compiled"), probes, strict=True):
        row = probe_row(probe, args.device, "aot_eager" if args.dry_run else "inductor")
        result |= {f"{kind} measured_gib": row["measured_mib"] / 1024,
                   f"{kind} predicted_over_measured": row["predicted_over_measured"],
                   f"{kind} reserved_over_allocated": row["reserved_over_allocated"]}
        result["ok"] &= kind == "compiled" or 0.9 <= row["predicted_over_measured"] <= 1.1
    if args.device == "cuda":  # cuBLAS's handles and the kernels loaded since the preflight
        result["cuda_context_gib"] = cuda_context_gib()


def sample_with_maps(args: argparse.Namespace, result: dict) -> None:
    """sample.py on speedrun_gpu's first run: the attention explorer written, and the mask held on both paths."""
    maps, log = args.out / "maps", args.out / "logs" / "sample.log"
    command = [sys.executable, str(REPO / "sample.py"), f"out_dir={args.work / 'speedrun_gpu' / f'seed{SEEDS[0]}'}",
               "start=ROMEO:", "max_new_tokens=40", "num_samples=1", f"attention_dir={maps}", "check_causal=true"]
    status = run_command(command, log, result)
    output = log.read_text(errors="replace")
    held = "causality check" in output and "MASK LEAKED" not in output
    result["ok"] = status == 0 and held and (maps / "index.html").is_file()


def paths_agree(args: argparse.Namespace, result: dict) -> None:
    """Largest difference of logits and gradients between flash and math, relative to the largest value: fp32 and
    bf16 full, and bf16 windowed (training's precision; a window that is no multiple of FlexAttention's 128-token
    blocks: on CUDA one compile of FlexAttention). fp32 means fp32: TF32 off."""
    torch.set_float32_matmul_precision("highest")
    config = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)
    config = replace(config, block_size=32, n_layer=2, n_head=2, n_embd=32) if args.dry_run else config
    windowed = replace(config, attn_window=5 if args.dry_run else 100, pos_emb="rope")
    result["ok"] = True
    for shape, dtype, tolerance in ((config, torch.float32, 1e-4), (config, torch.bfloat16, 5e-2),
                                    (windowed, torch.bfloat16, 5e-2)):
        torch.manual_seed(0)
        models = {impl: GPT(replace(shape, attn_impl=impl)).to(args.device) for impl in ("flash", "math")}
        models["math"].load_state_dict(models["flash"].state_dict())
        idx = torch.randint(shape.vocab_size, (4, shape.block_size), device=args.device)
        outputs = {}
        for impl, model in models.items():
            with torch.autocast(args.device, dtype, enabled=dtype != torch.float32):
                logits, loss = model(idx, idx)
            loss.backward()
            outputs[impl] = (logits.float(), torch.cat([p.grad.flatten() for p in model.parameters()]).float())
        name = f"{str(dtype).removeprefix('torch.')}{'' if shape.attn_window is None else ' windowed'}"
        for i, what in enumerate(("logits", "grads")):
            flash, math_ = outputs["flash"][i], outputs["math"][i]
            result[f"{name} {what}"] = rel = ((flash - math_).abs().max() / math_.abs().max()).item()
            result["ok"] &= rel <= tolerance


def compiled_like_eager(args: argparse.Namespace, result: dict) -> None:
    """Float32 logits in eval mode, torch.compile (fullgraph) against eager, the largest difference relative to the
    largest logit: a windowed rotary model (FlexAttention on CUDA) and the schema's default one. (One graph over
    training steps: the preset runs' warm_up_graphs and graphs per seed.) TF32 off."""
    torch.set_float32_matmul_precision("highest")
    models = {"windowed": GPTConfig(vocab_size=65, vocab_multiple=64, block_size=256, n_layer=2, n_head=6, n_embd=384,
                                    pos_emb="rope", attn_window=100),
              "default": GPTConfig(vocab_size=65, vocab_multiple=64, block_size=64, n_layer=4, n_head=4, n_embd=128)}
    if args.dry_run:
        models = {name: replace(config, n_layer=2, n_head=2, n_embd=32) for name, config in models.items()}
    result["ok"] = True
    for name, config in models.items():
        torch.manual_seed(0)
        model = GPT(config).to(args.device).eval()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager" if args.dry_run else "inductor")
        idx = torch.randint(config.vocab_size, (4, config.block_size), device=args.device)
        with torch.no_grad():
            eager = model(idx)[0]
            result[f"{name} logits vs eager"] = ((compiled(idx)[0] - eager).abs().max() / eager.abs().max()).item()
        result["ok"] &= result[f"{name} logits vs eager"] <= 1e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: checks that the script works")
    parser.add_argument("--text", type=Path, help="tiny Shakespeare's input.txt")
    parser.add_argument("--ranks", type=Path, help="r50k_base.tiktoken, GPT-2's BPE ranks, for an offline machine")
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="results' folder (default: %(default)s)")
    parser.add_argument("--deadline", type=float, default=480, help="seconds for the whole run (default: %(default)s)")
    parser.add_argument("--runs", help=argparse.SUPPRESS)  # the child process of one preset's runs
    parser.add_argument("--seeds", type=lambda s: tuple(map(int, s.split(","))), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runs:
        return train_runs(args)
    args.device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; use --dry-run to check the script on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # token files and checkpoints: not kept
    report: dict = {"deadline_s": args.deadline, "versions": {}, "steps": []}
    args.ranks_missing = "the preflight did not finish"
    steps = {
        "preflight": partial(preflight, args, report),
        "gpt2": partial(gpt2_throughput, args),
        "speedrun_gpu": partial(preset_runs, args, "speedrun_gpu", SEEDS, report),
        "shakespeare": partial(preset_runs, args, "shakespeare", SEEDS[:1], report),  # nanoGPT's recipe
        "cuda steps": partial(cuda_steps, args),
        "memory": partial(peak_memory, args),
        "sample": partial(sample_with_maps, args),
        "flash = math": partial(paths_agree, args),
        "compile": partial(compiled_like_eager, args),
    }
    signal.signal(signal.SIGALRM, _time_out)
    try:
        for name, step in steps.items():
            report["steps"].append(run_step(name, step, args))
            write_json(args.out / "gpu_check.json", report)  # kept if the loan ends now
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    report["total_s"] = time.monotonic() - STARTED
    write_json(args.out / "gpu_check.json", report)
    print(f"total {report['total_s']:.0f} s of {args.deadline:.0f}; {args.out / 'gpu_check.json'}")
    sys.exit(0 if all(s["ok"] for s in report["steps"]) else 1)


def _time_out(signum: int, frame: object) -> None:
    raise StepTimeout


def write_json(path: Path, report: dict) -> None:
    """Strict JSON: a NaN or an infinity (a difference of NaN outputs, a target never reached) as null."""
    def strict(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        return [strict(v) for v in value] if isinstance(value, list) else value

    path.write_text(json.dumps(strict(report), indent=1))


def run_step(name: str, step: Callable[[dict], None], args: argparse.Namespace) -> dict:
    """One step under its limit: twice its estimate (the dry run: none), cut to what is left of the deadline. The step
    fills its result as it goes: one stopped at its limit keeps what it had measured."""
    left = args.deadline - (time.monotonic() - STARTED)
    limit = left if args.dry_run else min(2 * ESTIMATE_S[name], left)
    if limit <= 0:
        result = {"step": name, "ok": False, "skipped": f"the {args.deadline:.0f} s deadline had passed"}
        print(f"SKIP  {name}: {result['skipped']}", flush=True)
        return result
    began, result = time.monotonic(), {"ok": False}
    signal.setitimer(signal.ITIMER_REAL, limit, 5)  # again every 5 s, should torch catch the first
    try:
        step(result)
    except StepTimeout:
        result["stopped"] = True
    except Exception as err:  # one failed step (a compile error, an out-of-memory) costs only its own answer
        result |= {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if result.pop("stopped", False):  # at the limit (its command killed)
        result |= {"ok": False, "error": f"stopped at its limit, {limit:.0f} s"}
    result = {"step": name, **result, "took_s": time.monotonic() - began, "limit_s": limit}
    shown = figures({k: v for k, v in result.items() if v not in (None, "")
                     and k not in ("step", "ok", "took_s", "limit_s", "per_seed", "log_tail", "versions")})
    print(f"{'PASS' if result['ok'] else 'FAIL'}  {name}: {shown} [{result['took_s']:.0f} s of {limit:.0f} s]",
          flush=True)
    for seed, values in result.get("per_seed", {}).items():
        print(f"      seed {seed}: {figures(values)}", flush=True)
    return result


def figures(values: dict) -> str:
    """The figures as a line prints them, floats to four significant digits."""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


if __name__ == "__main__":
    main()
