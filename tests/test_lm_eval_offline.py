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

import pytest
import torch

from conftest import REPO, ServeProcess
from evals.hellaswag import Example, ending_scores
from inference.sampling import load_model

TASKS = REPO / "evals" / "lm_eval_tasks"


def test_the_documented_offline_lm_eval_command_scores_the_shipped_task_as_the_project_does(
    server: ServeProcess, served_run: Path, tmp_path: Path
) -> None:
    """lm-evaluation-harness's local-completions (tokenizer found through /tokenizer_info), offline: each ending's
    log-likelihood and the accuracy equal the project's own multiple-choice scoring (evals/hellaswag.py's), over the
    100 documents shipped with the task (the true ending not always first)."""
    docs = [json.loads(line) for line in (TASKS / "shakespeare_lines.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(docs) == 100 and {d["label"] for d in docs} == {0, 1, 2, 3}
    assert "test: evals/lm_eval_tasks/shakespeare_lines.jsonl" in (TASKS / "shakespeare_lines.yaml").read_text()
    # the lm_eval command of docs/serving.md's offline section, its continued lines joined
    section = (REPO / "docs" / "serving.md").read_text(encoding="utf-8").split("### lm-eval offline", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    (command,) = [line for line in block.replace("\\\n", " ").splitlines() if "lm_eval " in line]
    assert "--include_path evals/lm_eval_tasks --tasks shakespeare_lines" in command
    assert "base_url=http://127.0.0.1:8000/v1/completions" in command and "model=cpu," in command
    ours = command.replace("http://127.0.0.1:8000", server.url).replace("model=cpu,", "model=run,")
    ours = ours.replace("lm_eval ", f"{shlex.quote(sys.executable)} -m lm_eval ", 1)
    ours += f" --output_path {shlex.quote(str(tmp_path / 'out'))} --log_samples"  # each ending's score, to compare
    unreachable = "http://127.0.0.1:9"  # a download would go through this proxy, and fail
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"),
           "HTTP_PROXY": unreachable, "HTTPS_PROXY": unreachable, "NO_PROXY": "127.0.0.1"}
    result = subprocess.run(["bash", "-c", ours], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = re.search(r"^\|shakespeare_lines\|.*\|acc +\|↑ *\| *([0-9.]+)\|", result.stdout, re.M)
    assert row, result.stdout
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    theirs = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}  # per ending: its log-lik.
    loaded = load_model(str(served_run), None, "latest", None)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    correct = 0
    for i, doc in enumerate(docs):
        example = Example(tokenizer.encode(doc["context"]), [tokenizer.encode(" " + e) for e in doc["endings"]],
                          doc["label"])
        sums, _ = ending_scores(model, example, model.config.block_size, torch.device("cpu"))
        assert theirs[i] == pytest.approx(sums.tolist(), abs=1e-4)
        correct += int(sums.argmax()) == doc["label"]
    assert float(row.group(1)) == pytest.approx(correct / len(theirs), abs=1e-4)
