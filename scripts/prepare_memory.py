"""Peak memory (RSS) and wall time of preparing a big text, `python -m data.prepare`: the kernel's peak RSS of the
process (wait4's ru_maxrss, what `/usr/bin/time -v` reports as "Maximum resident set size").

    python scripts/prepare_memory.py --text input.txt --mb 200 1000 --tokenizers char r50k_base
    python scripts/prepare_memory.py --text input.txt --mb 200 --repo /tmp/old     # another checkout's code

Each text is --text repeated to at least that many MB (10^6 bytes), written to a temporary folder with its token
files and deleted afterwards. r50k_base offline needs TIKTOKEN_CACHE_DIR as docs/reference.md says. --repo runs another
checkout's data.prepare with this interpreter, e.g. the code before streaming: git worktree add /tmp/old HEAD.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def repeated_text(source: Path, megabytes: int, path: Path) -> None:
    """Whole copies of `source` (no character is cut) until the file reaches the size."""
    block = source.read_bytes()
    with path.open("wb") as f:
        for _ in range(-(-megabytes * 10**6 // len(block))):
            f.write(block)


def measure(repo: Path, text: Path, tokenizer: str, data_dir: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "data.prepare",
        f"data.input={text}",
        f"data.dir={data_dir}",
        f"data.tokenizer={tokenizer}",
    ]
    started = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, cwd=repo, stdout=log, stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            log.seek(0)
            sys.exit(f"{' '.join(command)} failed:\n{log.read().decode(errors='replace')[-3000:]}")
    meta = json.loads((data_dir / "meta.json").read_text())
    return {
        "text_mb": round(text.stat().st_size / 10**6),
        "tokenizer": tokenizer,
        "peak_rss_mb": round(usage.ru_maxrss / (1024**2 if sys.platform == "darwin" else 1024)),  # bytes on macOS
        "wall_s": round(wall, 1),
        "tokens": meta["train_tokens"] + meta["val_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, required=True, help="the text to repeat, e.g. tiny Shakespeare")
    parser.add_argument("--mb", type=int, nargs="+", default=[200])
    parser.add_argument("--tokenizers", nargs="+", default=["char"])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose data.prepare runs")
    parser.add_argument("--tmp", type=Path, help="where the texts go (default: the system's temporary folder)")
    args = parser.parse_args()
    if not hasattr(os, "wait4"):
        sys.exit("this needs os.wait4 (Linux, macOS) to read a process's peak memory")
    print(f"{'text MB':>8} {'tokenizer':>10} {'peak RSS MB':>12} {'wall s':>8} {'tokens':>14}  ({args.repo})")
    for megabytes in args.mb:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            text = Path(tmp) / "input.txt"
            repeated_text(args.text, megabytes, text)
            for tokenizer in args.tokenizers:
                row = measure(args.repo, text, tokenizer, Path(tmp) / tokenizer)
                shutil.rmtree(Path(tmp) / tokenizer)
                print(
                    f"{row['text_mb']:>8} {row['tokenizer']:>10} {row['peak_rss_mb']:>12} {row['wall_s']:>8} "
                    f"{row['tokens']:>14,}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
