"""train.py and sample.py as a user runs them: subprocesses, from another working directory, where only a process
shows it (the seam of each class of mistake, what a whole command writes); the rest is the same command run in
this process (run_in_process)."""

from pathlib import Path

import pytest

from conftest import refused, run_in_process, run_script, tiny_run_overrides


def test_train_then_sample_end_to_end(trained_run: Path, tmp_path: Path) -> None:
    """train.py's files and readable log; the first sample.py as a user runs it (all it writes: stdout); the same
    command again, and with another seed, in this process."""
    for name in ("ckpt.pt", "metrics.jsonl", "config.yaml", ".hydra/config.yaml"):
        assert (trained_run / name).is_file(), name
    log = (trained_run / "train.log").read_text()
    assert "step 20: train loss" in log and "ms/iter" in log and "tok/s" in log and "parameters" in log
    args = [f"out_dir={trained_run}", "start=The", "num_samples=3", "max_new_tokens=40", "seed=7", "device=cpu"]
    first = run_script("sample.py", args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    samples = first.stdout.split("\n---------------\n")[:-1]
    assert len(samples) == 3 and all(s.startswith("The") and len(s) == len("The") + 40 for s in samples)
    assert len(set(samples)) > 1
    assert run_in_process("sample.py", args, cwd=tmp_path).stdout == first.stdout  # same seed, same text
    assert run_in_process("sample.py", [*args[:-2], "seed=8", "device=cpu"], cwd=tmp_path).stdout != first.stdout
    assert not list(tmp_path.iterdir())  # sample.py writes nothing


def test_sample_reads_the_prompt_from_a_file_runs_either_attention_path_and_takes_a_quoted_one(
    trained_run: Path, tmp_path: Path
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The end, or not")
    base = [f"out_dir={trained_run}", f"start=FILE:{prompt}", "num_samples=1", "max_new_tokens=30", "top_k=1"]
    flash = run_in_process("sample.py", [*base, "attn_impl=flash"], cwd=tmp_path)
    assert flash.returncode == 0, flash.stderr
    assert flash.stdout.startswith("The end, or not")
    assert flash.stdout == run_in_process("sample.py", [*base, "attn_impl=math"], cwd=tmp_path).stdout
    args = [f"out_dir={trained_run}", "start='To be, or not'", "max_new_tokens=5", "num_samples=1"]
    quoted = run_in_process("sample.py", args, cwd=tmp_path)
    assert quoted.returncode == 0 and quoted.stdout.startswith("To be, or not")


@pytest.mark.parametrize(
    ("script", "args", "message", "run"),
    [  # a mistake found once the job runs: each script's seam as a user meets it, the others in this process
        ("train.py", ["data.input=/no/such/file.txt"], "error: data.input=/no/such/file.txt does not exist",
         run_script),
        ("sample.py", ["out_dir=/no/such/run"], "error: no checkpoint at /no/such/run/ckpt.pt", run_script),
        ("sample.py", ["start='Zebra\u00e9'"], "error: character '\u00e9' is not in the model's vocabulary",
         run_in_process),
        ("sample.py", ["start=To", "be,", "or", "not"], "error: ", run_in_process),
    ],
)
def test_user_errors_are_one_line_without_traceback(
    trained_run: Path, tmp_path: Path, corpus_path: Path, script: str, args: list[str], message: str, run
) -> None:
    if script == "train.py":
        args = tiny_run_overrides(tmp_path, corpus_path) + args
    elif not any(a.startswith("out_dir=") for a in args):
        args = [f"out_dir={trained_run}", *args]
    result = run(script, args, cwd=tmp_path)
    assert refused(result).startswith(message) and result.stdout == ""
    assert not (tmp_path / "run").exists()  # found before any work
    if "be," in args:
        assert "start=\"'To be, or not'\"" in result.stderr  # how to quote a prompt with commas


@pytest.mark.parametrize(("script", "run"), [("train.py", run_script), ("sample.py", run_in_process)])
def test_cfg_job_shows_the_resolved_config_as_the_readme_says(script: str, run, tmp_path: Path) -> None:
    args = ["experiment=shakespeare_char_cpu"] if script == "train.py" else ["out_dir=RUN"]
    result = run(script, [*args, "--cfg", "job"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("n_embd: 128" if script == "train.py" else "out_dir: RUN") in result.stdout
    assert not list(tmp_path.iterdir())  # only printed: no run directory
