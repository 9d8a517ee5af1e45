"""Typed configs whose fields carry their own allowed values.

A key's choices or range are declared once, beside the key (`option`); each config dataclass checks itself in
its __post_init__ (most with `check_fields`), so building one checks it. `typed_config` builds them from Hydra's
DictConfig: the config is typed and checked once, at start, and a bad value is one ConfigError naming the key,
the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from common.errors import ConfigError

Config = TypeVar("Config")


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
    """This dataclass's own fields with rules (nested configs check themselves); keys named as prefix + name."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "rules" in f.metadata and value is not None:
            problem = _problem(value, **f.metadata["rules"])
            if problem:
                raise ConfigError(f"{prefix}{f.name}={value} {problem}")


def typed_config(cfg: DictConfig | Config, schema: type[Config]) -> Config:
    """The schema's dataclasses, interpolations such as ${now:} resolved, every value checked as they are built.
    cfg: Hydra's config, a plain one (a saved config.yaml) or an instance of the schema."""
    if not OmegaConf.has_resolver("now"):  # Hydra's, registered once Hydra composes: ${now:%H-%M-%S}
        OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern), use_cache=True)
    if isinstance(cfg, schema):
        cfg = OmegaConf.structured(cfg)
    else:
        _refuse_unknown_keys(cfg, schema)
    if OmegaConf.get_type(cfg) is not schema:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    return OmegaConf.to_object(cfg)


def _refuse_unknown_keys(cfg: Any, schema: type, prefix: str = "") -> None:
    """Hydra's `+key=value` adds a key even to a typed config: refuse one the schema lacks, as Hydra refuses a
    misspelt key without `+`, naming the closest real one."""
    hints = typing.get_type_hints(schema)
    for key in cfg:
        name = f"{prefix}{key}"
        if key not in hints:
            known = list(hints)
            closest = [k for k in known if k.startswith(str(key))] or difflib.get_close_matches(str(key), known, 1, 0.5)
            suggestion = f"; did you mean {prefix}{closest[0]}?" if closest else "; see the keys with --cfg job"
            raise ConfigError(f"{name} is not a key of this config{suggestion}")
        if dataclasses.is_dataclass(hints[key]) and OmegaConf.is_dict(cfg[key]):
            _refuse_unknown_keys(cfg[key], hints[key], f"{name}.")


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
