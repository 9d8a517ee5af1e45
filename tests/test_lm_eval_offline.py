"""docs/serving.md's offline lm-eval command, run as written there: the task shipped in evals/lm_eval_tasks/,
scored through serve.py with no address but the server's reachable."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import REPO, ServeProcess

TASKS = REPO / "evals" / "lm_eval_tasks"


def documented_command() -> str:
    """The lm_eval command of docs/serving.md's offline section, its continued lines joined."""
    section = (REPO / "docs" / "serving.md").read_text(encoding="utf-8").split("### lm-eval offline", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    (command,) = [line for line in block.replace("\\\n", " ").splitlines() if "lm_eval " in line]
    return command


def test_the_shipped_task_is_whole_and_its_data_is_in_the_repository() -> None:
    docs = [json.loads(line) for line in (TASKS / "shakespeare_lines.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(docs) == 100 and all(len(d["endings"]) == 4 and 0 <= d["label"] < 4 for d in docs)
    assert {d["label"] for d in docs} == {0, 1, 2, 3}  # the true ending isn't always first
    assert "test: evals/lm_eval_tasks/shakespeare_lines.jsonl" in (TASKS / "shakespeare_lines.yaml").read_text()


def test_the_documented_offline_lm_eval_command_scores_the_shipped_task(served_run: Path, tmp_path: Path) -> None:
    command = documented_command()
    assert "--include_path evals/lm_eval_tasks --tasks shakespeare_lines" in command
    assert "base_url=http://127.0.0.1:8000/v1/completions" in command and "model=cpu," in command
    server = ServeProcess(served_run)
    try:
        ours = command.replace("http://127.0.0.1:8000", server.url).replace("model=cpu,", "model=run,")
        ours = ours.replace("lm_eval ", f"{shlex.quote(sys.executable)} -m lm_eval ", 1)
        unreachable = "http://127.0.0.1:9"  # a download would go through this proxy, and fail
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"),
               "HTTP_PROXY": unreachable, "HTTPS_PROXY": unreachable, "NO_PROXY": "127.0.0.1"}
        result = subprocess.run(["bash", "-c", ours], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    row = re.search(r"^\|shakespeare_lines\|.*\|acc +\|↑ *\| *([0-9.]+)\|", result.stdout, re.M)
    assert row, result.stdout
    assert 0.0 <= float(row.group(1)) <= 1.0
