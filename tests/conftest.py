"""Shared fixtures. Everything runs offline on CPU with text made or carried here.

Stronger checks use the real corpus and GPT-2 ranks when .ci/run points at them:
GPT_TEST_CORPUS=path/to/tinyshakespeare.txt and TIKTOKEN_CACHE_DIR holding r50k_base's ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import os
import pydoc_data.topics
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tiktoken
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.hydra import Hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig
from tiktoken_ext.openai_public import r50k_pat_str

import eval as eval_command
import sample as sample_command
import serve as serve_command
import train as train_command
from common.files import RunDir
from model.checkpoint import Checkpoint

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
TINY_BPE = "tiny_test_bpe"
# Every modern model option on at once (model/gpt.py's GPTConfig), as the speedrun may combine them.
MODERN = dict(norm="rmsnorm", qk_norm=True, logit_softcap=15.0, x0_mix=True, value_residual=True, bigram_embed=True,
              pos_emb="rope", activation="relu2")
# Merges in rank order; each is the concatenation of two earlier tokens, as BPE learns them.
_TINY_MERGES = [b"th", b"he", b"in", b"er", b"an", b" t", b" a", b"the", b" the", b"ou", b"on", b"re", b"nd", b"and",
                b" and"]



def register_schemas() -> None:
    """The commands' schemas, as imported here, for Hydra's compose (run_in_process's __main__ copies replace them)."""
    ConfigStore.instance().store(name="train_schema", node=train_command.TrainRunConfig)
    for name, command in (("sample", sample_command), ("eval", eval_command), ("serve", serve_command)):
        ConfigStore.instance().store(name=f"{name}_schema", node=getattr(command, f"{name.title()}Config"))


register_schemas()
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: each worker, and every command it starts, on one thread
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# A reduction's last bits depend on the thread count: pinned here (and so in every command a test starts), runs
# that tests compare bit for bit use the same count.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
# The tests write nothing under $HOME: the caches and settings that wandb, Hugging Face's libraries (lm-eval's
# datasets) and matplotlib would keep there go to this session's own folder, as do those of every command it starts.
_HOME_STAND_IN = Path(tempfile.mkdtemp(prefix="gpt-lab-tests-"))
atexit.register(shutil.rmtree, _HOME_STAND_IN, ignore_errors=True)
for _name in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME", "HF_DATASETS_CACHE", "WANDB_DIR", "WANDB_CONFIG_DIR",
              "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    os.environ[_name] = str(_HOME_STAND_IN / _name.lower())


def tiny_encoding() -> tiktoken.Encoding:
    """A real tiktoken BPE with GPT-2's pre-tokenizer and a handful of merges, built without any download."""
    ranks = {bytes([b]): b for b in range(256)}
    for token in _TINY_MERGES:
        ranks[token] = len(ranks)
    return tiktoken.Encoding(
        name=TINY_BPE, pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)}
    )


@pytest.fixture(autouse=True)
def _process_state_restored() -> Iterator[None]:
    """What a script run in this process may change for all of it (signal handlers: sample.py's SIGPIPE, train.py's
    SIGTERM; serve.py's thread count) is put back after each test."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGPIPE)}
    threads = torch.get_num_threads()
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _register_tiny_bpe() -> None:
    """Make `data.tokenizer=tiny_test_bpe` resolve by name, like any installed tiktoken encoding."""
    tiktoken.registry.ENCODINGS[TINY_BPE] = tiny_encoding()


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Shakespeare where CI provides it, else Python's own help topics (465k characters of English)."""
    shared = os.environ.get("GPT_TEST_CORPUS")
    if shared and Path(shared).is_file():
        return Path(shared)
    path = tmp_path_factory.mktemp("corpus") / "pydoc_topics.txt"
    path.write_text("".join(pydoc_data.topics.topics.values()), encoding="utf-8")
    return path


def run_script(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / script), *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def run_in_process(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """run_script's twin in this process: `python SCRIPT ARGS` from cwd, the script run as __main__ on that argv as
    the interpreter runs it (for `-m data.prepare`, the main() its __main__ calls), without the ~4 s of an
    interpreter's start and imports. Left out: the logging set-up Hydra does for a job, which would reach every later
    test in this process. Its exit status, stdout and stderr, as run_script returns them; a bug's exception
    propagates (a subprocess would print its traceback)."""
    out, err = io.StringIO(), io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGPIPE)}  # the scripts set them
    code: object = 0
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(cwd)
        patch.setattr(sys, "argv", [str(REPO / script), *args])
        patch.setenv("HYDRA_FULL_ERROR", "1")  # run_hydra sets it; put back afterwards
        patch.setattr(Hydra, "run", functools.partialmethod(Hydra.run, with_log_configuration=False))
        try:
            if script == "-m data.prepare":
                from data.prepare import main

                main()
            else:
                runpy.run_path(str(REPO / script), run_name="__main__")
        except SystemExit as stopped:
            code = 0 if stopped.code is None else stopped.code
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            register_schemas()
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def refused(result: subprocess.CompletedProcess) -> str:
    """A user's mistake as every command says it: exit status 2 and one line on stderr, "error: ..."; that line."""
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, (
        result.returncode, result.stderr)
    return result.stderr.rstrip("\n")


def train_py(args: list[str]) -> None:
    """`python train.py ARGS` from the current directory, in this process (run_in_process): its output on this
    process's stdout and stderr, a failure as SystemExit with its status."""
    _ran(run_in_process("train.py", args, Path.cwd()))


def sample_py(args: list[str]) -> None:
    """`python sample.py ARGS` as train_py runs train.py."""
    _ran(run_in_process("sample.py", args, Path.cwd()))


def _ran(result: subprocess.CompletedProcess) -> None:
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode:
        raise SystemExit(result.returncode)


def user_error(capsys: pytest.CaptureFixture, call: Callable[[], None]) -> str:
    """What a command prints when the user is at fault: exit status 2, its line on stderr (returned), no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        call()
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    return err


def start_script(script: str, args: list[str], cwd: Path) -> subprocess.Popen:
    """A command running in the background, its output captured: for the tests that signal it."""
    command = [sys.executable, str(REPO / script), *args]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_text(path: Path, text: str, timeout: float = 120) -> None:
    """Until the file holds `text` (a run's metrics.jsonl reaching a kind of record), or the timeout."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)


_BUILT: dict[str, Path] = {}  # built_once's directories, by name, in this process


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory that build(directory) fills once for the whole session: under pytest -n N the first worker to
    need it builds it while any other waits, and all then read it (a test that changes it works on a copy)."""
    if name in _BUILT:
        return _BUILT[name]
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        build(path)
    else:
        from filelock import FileLock  # torch's own dependency

        path = tmp_path_factory.getbasetemp().parent / name  # this session's, shared by its workers
        built = path.with_name(f"{name}.built")
        with FileLock(f"{path}.lock"):
            if not built.is_file():
                shutil.rmtree(path, ignore_errors=True)  # a build that failed
                path.mkdir()
                build(path)
                built.touch()
    _BUILT[name] = path
    return path


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Path:
    """A tiny char-level run made by train.py itself, shared by the tests that sample from it."""

    def build(tmp: Path) -> None:
        result = run_script("train.py", tiny_run_overrides(tmp, corpus_path, **{"train.max_iters": 60}), cwd=tmp)
        assert result.returncode == 0, result.stderr

    return built_once(tmp_path_factory, "trained", build) / "run"


def assert_same_logits_and_gradients(models: tuple[torch.nn.Module, torch.nn.Module], idx, targets) -> None:
    """Two models with the same weights (the flash and the math path): the same logits and, after backward, the
    same gradient for every parameter, to 1e-5."""
    results = []
    for model in models:
        logits, loss = model(idx, targets)
        loss.backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    torch.testing.assert_close(logits_a, logits_b, atol=1e-5, rtol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-5, rtol=0, msg=name)


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The config a script would see (train.py's by default; config_name="sample" for sample.py's)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


# A tiny run that reaches val 3.6 well before its 400 iterations.
REACHES_TARGET = {"train.target_val_loss": 3.6, "train.max_iters": 400, "train.eval_interval": 5,
                  "train.learning_rate": 3e-3}


def tiny_run_overrides(tmp_path: Path, corpus: Path, **extra: object) -> list[str]:
    """A run small enough to take seconds on CPU."""
    base = {"out_dir": tmp_path / "run", "device": "cpu", "data.input": corpus, "data.dir": tmp_path / "data",
            "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32, "train.batch_size": 8,
            "train.max_iters": 20, "train.eval_interval": 10, "train.eval_iters": 4, "train.log_interval": 5,
            "train.warmup_iters": 2, "train.dtype": "float32"}  # runs compared number for number say their precision
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _missing_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return 'the selenium client is not installed (pip install ".[dev]")'
    for program, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(program) is None:
            return f"{program} is not on PATH (apt-get install {package}, as .ci/run does)"
    return None


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session, through Debian's chromedriver (never Selenium Manager: offline).
    Without them the browser tests skip, saying why; under CI (the CI variable set) they fail instead."""
    why = _missing_browser()
    if why is not None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI runs the browser tests with none skipped, but {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def served_run(tmp_path_factory: pytest.TempPathFactory, corpus_path: Path) -> Path:
    """A tiny char-level run with room for a prompt and a few dozen tokens (block_size 96), for serve.py."""
    from train import train

    extra = {"model.block_size": 96, "train.max_iters": 60, "train.eval_interval": 60, "train.learning_rate": 3e-3}

    def build(tmp: Path) -> None:
        train(compose_config(tiny_run_overrides(tmp, corpus_path, **extra)))

    return built_once(tmp_path_factory, "served", build) / "run"


class ServeProcess:
    """serve.py on a free loopback port, for the API and page tests; stop() sends a signal and waits."""

    def __init__(self, run: Path, *overrides: str) -> None:
        import httpx

        args = [sys.executable, str(REPO / "serve.py"), f"out_dir={run}", "port=0", "device=cpu", *overrides]
        self.process = subprocess.Popen(args, cwd=run.parent, stderr=subprocess.PIPE, text=True)
        line = self.process.stderr.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+) ", line)
        assert match, line + self.process.stderr.read()
        self.url = match.group(1)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def post(self, body: object, path: str = "/v1/completions", **kwargs: object):
        return self.http.post(path, json=body, **kwargs)

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.http.close()
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=30), self.process.stderr.read()


@pytest.fixture(scope="session")
def server(served_run: Path) -> Iterator[ServeProcess]:
    """serve.py with its default settings, one a session for the tests whose requests all end before they do (a test
    of other settings or of stopping starts its own); it must stop without a traceback."""
    server = ServeProcess(served_run)
    yield server
    _, stderr = server.stop()
    assert "Traceback" not in stderr, stderr


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """A checkpoint written as a run writes it: through its RunDir, whole or not at all."""
    RunDir(path.parent).write(path.name, checkpoint.write)
