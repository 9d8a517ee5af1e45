"""The layers' imports point one way: common < model, data < evals < training, so the model and the data can be used,
and tested, without the trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

ALLOWED = {
    "common": {"common"},
    "model": {"common", "model"},
    "data": {"common", "data"},
    "evals": {"common", "data", "evals", "model"},
}
OURS = {"analysis", "common", "data", "evals", "inference", "model", "training"}


def _imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & OURS


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_lower_layers_import_nothing_from_higher_ones(package: str) -> None:
    files = sorted((REPO / package).glob("*.py"))
    assert files
    for path in files:
        stray = _imported_packages(path) - ALLOWED[package]
        assert not stray, f"{path.relative_to(REPO)} imports {sorted(stray)}"


def test_training_and_inference_import_nothing_of_each_other() -> None:
    """What both need (the checkpoint format, the runtime, the configs' building blocks) lives below them."""
    for package, other in (("training", "inference"), ("inference", "training")):
        for path in sorted((REPO / package).glob("*.py")):
            assert other not in _imported_packages(path), f"{path.relative_to(REPO)} imports {other}"


def test_functions_fit_on_a_screen() -> None:
    """At most 70 lines a function, its decorators included."""
    for package in ("analysis", "common", "data", "evals", "inference", "model", "training", "."):
        for path in sorted((REPO / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    assert node.end_lineno - start < 70, f"{path.relative_to(REPO)}: {node.name} has over 70 lines"


def _imported_files(path: Path) -> set[Path]:
    """The project's files that `path` imports, anywhere in it but under `if TYPE_CHECKING:` (annotations only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        guard = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in (getattr(guard, "id", None), getattr(guard, "attr", None)):
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    files = {REPO / (name.replace(".", "/") + ".py") for name in names}
    files |= {REPO / name.replace(".", "/") / "__init__.py" for name in names}
    return {file for file in files if file.is_file() and file != path}


def test_no_files_import_each_other_even_through_others() -> None:
    """Each file can be read, and changed, before the files that import it: the imports form no cycle."""
    paths = [*REPO.glob("*.py"), *(path for folder in [*OURS, "scripts"] for path in (REPO / folder).glob("*.py"))]
    imports = {path: _imported_files(path) for path in paths}
    assert any(imports.values())
    done: set[Path] = set()

    def visit(path: Path, trail: list[Path]) -> None:
        if path in trail:
            cycle = trail[trail.index(path):] + [path]
            pytest.fail(" -> ".join(str(p.relative_to(REPO)) for p in cycle))
        if path not in done:
            for imported in imports.get(path, ()):
                visit(imported, [*trail, path])
            done.add(path)

    for path in paths:
        visit(path, [])
