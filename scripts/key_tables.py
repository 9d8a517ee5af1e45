"""docs/reference.md's tables of every key, made from the schemas' field comments (common/config.py's key_docs): each
key is described once, in the code. `python scripts/key_tables.py` rewrites the section between the markers;
tests/test_readme.py fails while it is out of date."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.config import key_table  # noqa: E402
from eval import EvalConfig  # noqa: E402
from sample import SampleConfig  # noqa: E402
from serve import ServeConfig  # noqa: E402
from train import TrainRunConfig  # noqa: E402

REFERENCE = REPO / "docs" / "reference.md"
BEGIN, END = "<!-- key tables: scripts/key_tables.py writes them -->\n", "<!-- end of the key tables -->\n"
COMMANDS = ("train.py", TrainRunConfig), ("sample.py", SampleConfig), ("eval.py", EvalConfig), ("serve.py", ServeConfig)


def section() -> str:
    return "".join(f"\n### {command}\n\n{key_table(schema)}" for command, schema in COMMANDS) + "\n"


def main() -> None:
    before, rest = REFERENCE.read_text(encoding="utf-8").split(BEGIN)
    after = rest.split(END)[1]
    REFERENCE.write_text(before + BEGIN + section() + END + after, encoding="utf-8")
    print(f"wrote {REFERENCE}'s key tables")


if __name__ == "__main__":
    main()
