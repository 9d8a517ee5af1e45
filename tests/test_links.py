"""A run never writes through a symbolic link planted in its directory: files it replaces are renamed over the link,
files it appends to are opened without following one. The link's target stays as it was."""

from pathlib import Path

import pytest

from common.errors import UserError
from conftest import compose_config, tiny_run_overrides
from train import train


def _precious(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("the user's own\n")
    return target


def test_a_link_by_one_of_a_runs_names_never_writes_to_its_target(tmp_path: Path, corpus_path: Path) -> None:
    target = _precious(tmp_path)
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **{"train.max_iters": 2})))
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "train.log"):
        (run / name).unlink()
        (run / name).symlink_to(target)
    resume = {"resume": True, "resume_with_changes": True, "train.max_iters": 4}
    with pytest.raises(UserError, match=r"train\.log is a symbolic link"):  # appended to: refused, in one line
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **resume)))
    (run / "train.log").unlink()
    train(compose_config(tiny_run_overrides(tmp_path, corpus_path, **resume)))
    assert not any(p.is_symlink() for p in run.iterdir())  # replaced whole: the rename replaces the link
    assert target.read_text() == "the user's own\n"


def test_an_out_dir_linked_to_a_file_is_one_line_and_the_file_stays(tmp_path: Path, corpus_path: Path) -> None:
    target = _precious(tmp_path)
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(UserError, match="is a file, not a directory"):
        train(compose_config(tiny_run_overrides(tmp_path, corpus_path)))
    assert target.read_text() == "the user's own\n"
