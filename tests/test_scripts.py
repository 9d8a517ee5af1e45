"""train.py and sample.py as a user runs them: subprocesses, from another working directory, where only a process
shows it (the seam of each class of mistake, what a whole command writes); the rest is the same command run in
this process (run_in_process)."""

from pathlib import Path

import pytest
import torch

from conftest import refused, run_in_process, run_script, tiny_run_overrides
from inference.sampling import load_model


def test_train_then_sample_end_to_end(trained_run: Path, tmp_path: Path) -> None:
    """The first sample.py as a user runs it (all it writes: stdout); the same command again, and with another seed,
    in this process. (What train.py writes, as a user runs it: test_hardening's run under $HOME.)"""
    args = [f"out_dir={trained_run}", "start=The", "num_samples=3", "max_new_tokens=40", "seed=7", "device=cpu"]
    first = run_script("sample.py", args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    samples = first.stdout.split("\n---------------\n")[:-1]
    assert len(samples) == 3 and all(s.startswith("The") and len(s) == len("The") + 40 for s in samples)
    assert len(set(samples)) > 1
    assert run_in_process("sample.py", args, cwd=tmp_path).stdout == first.stdout  # same seed, same text
    assert run_in_process("sample.py", [*args[:-2], "seed=8", "device=cpu"], cwd=tmp_path).stdout != first.stdout
    assert not list(tmp_path.iterdir())  # sample.py writes nothing


def test_sample_reads_the_prompt_from_a_file_cropped_to_the_context_on_either_attention_path_or_a_quoted_one(
    trained_run: Path, tmp_path: Path
) -> None:
    prompt = tmp_path / "long.txt"
    prompt.write_text("the " * 20)  # 80 characters, block_size 32
    base = [f"out_dir={trained_run}", f"start=FILE:{prompt}", "num_samples=1", "max_new_tokens=30", "top_k=1"]
    flash = run_in_process("sample.py", [*base, "attn_impl=flash"], cwd=tmp_path)
    assert flash.returncode == 0 and flash.stdout.startswith("the " * 20), flash.stderr
    assert "warning: the prompt has 80 tokens; the model sees only its last 32" in flash.stderr
    assert flash.stdout == run_in_process("sample.py", [*base, "attn_impl=math"], cwd=tmp_path).stdout
    loaded = load_model(str(trained_run), None, "latest", "math")  # as sample.py, eval.py and serve.py load it
    assert {block.attn.attn_impl for block in loaded.model.transformer.h} == {loaded.model.config.attn_impl} == {"math"}
    assert loaded.checkpoint.model_config.attn_impl == "flash"  # the file's, as trained
    args = [f"out_dir={trained_run}", "start='To be, or not'", "max_new_tokens=5", "num_samples=1"]
    quoted = run_in_process("sample.py", args, cwd=tmp_path)
    assert quoted.returncode == 0 and quoted.stdout.startswith("To be, or not")


@pytest.mark.parametrize(
    ("script", "args", "message", "run"),
    [  # a mistake found once the job runs: sample.py's seam as a user meets it, the others in this process
        ("train.py", ["data.input=/no/such/file.txt"], "error: data.input=/no/such/file.txt does not exist",
         run_in_process),
        ("sample.py", ["out_dir=/no/such/run"], "error: no checkpoint at /no/such/run/ckpt.pt", run_script),
        ("sample.py", ["start='Zebra\u00e9'"], "error: character '\u00e9' is not in the model's vocabulary",
         run_in_process),
        ("sample.py", ["start=To", "be,", "or", "not"], "error: ", run_in_process),
        ("sample.py", ["device=DEVICE"], "device=DEVICE is not available on this machine; use device=cpu",
         run_in_process),  # train.py's: test_train
        ("sample.py", ["start=FILE:TMP"], "start=FILE:TMP is a directory", run_in_process),
        ("sample.py", ["start=FILE:TMP/none.txt"], "start=FILE:TMP/none.txt does not exist", run_in_process),
        ("sample.py", ["start=FILE:TMP/prompt.bin"], "TMP/prompt.bin is not UTF-8 text (invalid start byte at byte 6)",
         run_in_process),
    ],
)
def test_user_errors_are_one_line_without_traceback(
    trained_run: Path, tmp_path: Path, corpus_path: Path, script: str, args: list[str], message: str, run
) -> None:
    (tmp_path / "prompt.bin").write_bytes(b"ROMEO:\xff\xfe")
    device = "mps" if torch.cuda.is_available() else "cuda"
    args = [arg.replace("TMP", str(tmp_path)).replace("DEVICE", device) for arg in args]
    message = message.replace("TMP", str(tmp_path)).replace("DEVICE", device)
    if script == "train.py":
        args = tiny_run_overrides(tmp_path, corpus_path) + args
    elif not any(a.startswith("out_dir=") for a in args):
        args = [f"out_dir={trained_run}", *args]
    result = run(script, args, cwd=tmp_path)
    assert message in refused(result) and result.stdout == ""
    assert not (tmp_path / "run").exists()  # found before any work
    if "be," in args:
        assert "start=\"'To be, or not'\"" in result.stderr  # how to quote a prompt with commas
