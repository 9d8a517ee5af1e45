"""Nothing is written through a symbolic link: a run directory (or attention_dir) from someone else could point its
files anywhere the user can write, and a config field (wandb.run_name) would land there verbatim."""

import os
from pathlib import Path

import pytest

from common.errors import UserError
from common.files import discard_temporaries
from conftest import compose_config, run_script, tiny_run_overrides
from data.errors import DataError
from training.run import RUN_FILES, train


def _precious(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("the user's own\n")
    return target


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_new_run_refuses_a_run_directory_holding_a_link_by_one_of_its_names(
    tmp_path: Path, corpus_path: Path, name: str
) -> None:
    target = _precious(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(target.parent if name == ".hydra" else target)
    with pytest.raises(UserError, match=rf"holds {name} as a symbolic link \(to {target.parent}"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"wandb.run_name": "'echo owned'"})))
    assert target.read_text() == "the user's own\n" and os.listdir(target.parent) == ["precious.txt"]
    assert sorted(os.listdir(run)) == [name] and (run / name).is_symlink()  # the failed start took nothing else


def test_a_resume_refuses_a_link_put_in_place_of_its_metrics(tmp_path: Path, corpus_path: Path) -> None:
    target = _precious(tmp_path)
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 5})))
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.unlink()
    metrics.symlink_to(target)
    result = run_script("train.py", [*tiny_run_overrides(tmp_path, corpus_path), "resume=true"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: out_dir={tmp_path / 'run'} holds metrics.jsonl as a symbolic link (to {target}), and nothing is "
        "written through links; remove it, or use another out_dir"
    )
    assert target.read_text() == "the user's own\n"


def test_stale_temporaries_that_are_links_go_without_being_followed(tmp_path: Path) -> None:
    """A planted ckpt.pt.PID.tmp pointing nowhere yet would make the next save create its target."""
    missing = tmp_path / "elsewhere" / "created.txt"
    (tmp_path / "ckpt.pt.4242.tmp").symlink_to(missing)
    (tmp_path / "ckpt.pt.4243.tmp").symlink_to(_precious(tmp_path))
    discard_temporaries(tmp_path / "ckpt.pt")
    assert list(tmp_path.glob("ckpt.pt.*")) == [] and not missing.exists()
    assert (tmp_path / "elsewhere" / "precious.txt").read_text() == "the user's own\n"


def test_attention_dir_refuses_a_link_by_one_of_its_names(tmp_path: Path) -> None:
    from analysis.attention_maps import check_output_dir

    target = _precious(tmp_path)
    out = tmp_path / "maps"
    out.mkdir()
    (out / "attention.npz").symlink_to(target)
    with pytest.raises(DataError, match=r"holds files sample.py didn't write \(attention.npz \(a symbolic link\)\)"):
        check_output_dir(out)
    assert target.read_text() == "the user's own\n"


def test_a_run_s_tokens_are_never_prepared_again_under_it(tmp_path: Path, corpus_path: Path) -> None:
    """Run A trained on data.dir while B, with data.val_fraction=0.3 and the same data.dir, prepared it again: A
    crashed 30 iterations later. Now B is refused in one line while A reads, and prepares once A has ended."""
    from data.config import DataConfig
    from data.prepare import ensure_prepared

    other = DataConfig(name="x", input=str(corpus_path), dir=str(tmp_path / "data"), val_fraction=0.3)
    refusals: list[str] = []

    def prepare_beside(it: int) -> None:
        if it == 2:
            with pytest.raises(DataError) as refused:
                ensure_prepared(other)
            refusals.append(str(refused.value))

    result = train(compose_config(tiny_run_overrides(tmp_path, corpus_path)), before_step=prepare_beside)
    assert result.iters == 20 and len(refusals) == 1
    assert refusals[0] == (
        f"data.dir={tmp_path / 'data'} holds tokens a running run is reading, and preparing data.* here would replace "
        "them under it; wait for it to end, or name another data.dir"
    )
    assert ensure_prepared(other).meta["val_fraction"] == 0.3  # A has ended: nothing in use


def test_a_planted_temporary_is_never_written_through(tmp_path: Path) -> None:
    """config.yaml.PID.tmp (PIDs are easy to guess in a container) planted as a link: replaced, not followed."""
    from common.files import temporary_beside, write_text_atomically

    target = _precious(tmp_path)
    path = tmp_path / "config.yaml"
    temporary_beside(path).symlink_to(target)
    write_text_atomically(path, "seed: 1\n")
    assert path.read_text() == "seed: 1\n" and not path.is_symlink()
    assert target.read_text() == "the user's own\n" and not temporary_beside(path).exists()


def test_out_dir_that_cannot_be_a_directory_is_one_line(tmp_path: Path, corpus_path: Path) -> None:
    from common.errors import ConfigError

    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out_dir, why in [
        (tmp_path / "dangling", f"is a symbolic link to {tmp_path / 'nowhere'}, which doesn't exist; name a directory"),
        (tmp_path / ("a" * 300), "is a path this system refuses (File name too long); name a directory"),
    ]:
        with pytest.raises(ConfigError, match=rf"^out_dir={out_dir} {why}$".replace("(", r"\(").replace(")", r"\)")):
            train(compose_config(tiny_run_overrides(tmp_path, corpus_path, out_dir=out_dir)))
    assert not (tmp_path / "nowhere").exists()


def test_a_dead_holders_pid_file_goes_once_a_run_got_going(tmp_path: Path, corpus_path: Path) -> None:
    """Put back only after a failed start: a run that trained, then failed, leaves no .lock.pid behind."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock.pid").write_text("4242")

    def fail_at_3(it: int) -> None:
        if it == 3:
            raise RuntimeError("a bug in the third step")

    with pytest.raises(RuntimeError, match="a bug in the third step"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path)), before_step=fail_at_3)
    assert not (run / ".lock.pid").exists() and (run / "metrics.jsonl").exists()


def test_a_run_waits_for_a_preparation_under_way_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import fcntl
    import json
    import logging
    import threading

    from data.folder_locks import IN_USE
    from data.prepare import PreparedData, in_use

    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 3}))
    data = PreparedData(tmp_path, {"vocab_size": 3})
    with open(tmp_path / IN_USE, "ab") as preparing:
        fcntl.flock(preparing, fcntl.LOCK_EX)
        entered = threading.Event()

        def run() -> None:
            with in_use(data):
                entered.set()

        with caplog.at_level(logging.INFO):
            waiting = threading.Thread(target=run)
            waiting.start()
            assert not entered.wait(0.5)  # waits while the folder is being prepared
            fcntl.flock(preparing, fcntl.LOCK_UN)
            waiting.join(10)
    assert entered.is_set() and f"waiting for another process to finish preparing {tmp_path}" in caplog.text
