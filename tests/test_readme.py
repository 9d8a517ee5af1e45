"""The README is the front door: short, its links alive, and every command in it one the commands accept."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from common.config import check_overrides, key_docs, typed_config
from conftest import REPO, compose_config
from eval import EvalConfig
from sample import SampleConfig
from serve import ServeConfig
from train import TrainRunConfig
from training.resume import CONFIG_GROUPS

README = (REPO / "README.md").read_text(encoding="utf-8")
SCHEMAS = {
    "train.py": (TrainRunConfig, CONFIG_GROUPS, "config"),
    "sample.py": (SampleConfig, (), "sample"),
    "eval.py": (EvalConfig, (), "eval"),
    "serve.py": (ServeConfig, (), "serve"),
}


def _commands() -> list[list[str]]:
    """Every `python SCRIPT ...` line of the README's bash blocks, split as the shell would (comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["python"] and words[1:2] and words[1] in SCHEMAS:
                commands.append(words[1:])
    return commands


def test_the_readme_is_a_front_door_of_about_200_lines() -> None:
    assert len(README.splitlines()) <= 220
    first_screen = "\n".join(README.splitlines()[:40])
    assert "docs/explorer.png" in first_screen and "--index-url https://download.pytorch.org/whl/cpu" in first_screen
    cpu_line = README.index("download.pytorch.org/whl/cpu")
    assert cpu_line < README.index('pip install ".[dev]"')  # the CPU build before the install, not after


def test_every_link_in_the_readme_leads_somewhere() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert len(targets) >= 10
    for target in targets:
        assert (REPO / target).exists(), target


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c)[:60])
def test_every_command_in_the_readme_is_accepted(command: list[str]) -> None:
    """Each override checked as the command checks it, and the whole config composed and typed (a sweep's
    values are checked one by one by check_overrides)."""
    script, *args = command
    schema, groups, config_name = SCHEMAS[script]
    check_overrides(args, schema, groups)  # exits with status 2 on anything wrong
    if "-m" not in args:
        typed_config(compose_config(args, config_name), schema)


def test_the_readme_runs_every_command_a_newcomer_needs() -> None:
    scripts = {command[0] for command in _commands()}
    assert scripts == set(SCHEMAS)
    assert ["train.py", "experiment=shakespeare_char_cpu", "out_dir=runs/cpu"] in _commands()


def test_the_test_section_installs_what_the_tests_need_before_running_them() -> None:
    """After the set-up's `pip install .` alone, pytest is missing: the section says to install the dev extra."""
    section = README[README.index("## Test"):README.index("## Where next")]
    assert 'pip install ".[dev]"' in section
    assert section.index('pip install ".[dev]"') < section.index("python -m pytest")


def test_reference_md_describes_every_key_as_its_schema_does() -> None:
    """Each key is described once, by its field's comment: docs/reference.md's tables are made from the schemas
    (scripts/key_tables.py), and every key has a description."""
    spec = importlib.util.spec_from_file_location("key_tables", REPO / "scripts" / "key_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    assert text.split(tables.BEGIN)[1].split(tables.END)[0] == tables.section(), "run python scripts/key_tables.py"
    for _, schema in tables.COMMANDS:
        assert all(key_docs(schema).values()), [key for key, doc in key_docs(schema).items() if not doc]
    assert "| `train.max_iters` | `2000` | an integer, >= 0 | optimizer steps;" in text
