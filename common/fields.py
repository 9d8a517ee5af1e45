"""Config fields that carry their own allowed values, and one check for all of them.

A key's choices or range are declared once, beside the key, in field metadata; `check_fields` walks a config
(nested dataclasses included) and raises one ConfigError naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from common.errors import ConfigError


def option(
    default: Any,
    *,
    choices: Sequence[str] | None = None,
    at_least: float | None = None,
    above: float | None = None,
    below: float | None = None,
    hint: str = "",
) -> Any:
    """A dataclass field with a default and the values it accepts (None always passes: the type allows it or
    OmegaConf refuses it first). `hint` is appended to the error: what to do instead."""
    rules = {"choices": choices, "at_least": at_least, "above": above, "below": below, "hint": hint}
    return dataclasses.field(default=default, metadata={"rules": rules})


def check_fields(config: Any, prefix: str = "") -> None:
    """Every field with rules, in nested dataclasses too; the key is named with its dotted path."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{prefix}{f.name}.")
        elif "rules" in f.metadata and value is not None:
            problem = _problem(value, **f.metadata["rules"])
            if problem:
                raise ConfigError(f"{prefix}{f.name}={value} {problem}")


def _problem(
    value: Any,
    choices: Sequence[str] | None,
    at_least: float | None,
    above: float | None,
    below: float | None,
    hint: str,
) -> str:
    if choices is not None and value not in choices:
        problem = f"is unknown; use one of {', '.join(choices)}"
    elif at_least is not None and value < at_least:
        problem = f"must be >= {at_least}"
    elif above is not None and value <= above:
        problem = f"must be > {above}"
    elif below is not None and value >= below:
        problem = f"must be < {below}"
    else:
        return ""
    return f"{problem}; {hint}" if hint else problem
