"""Why a command line was refused, in one line: a misspelt key or preset (with a did-you-mean), a value against its
key's rule, or else Hydra's own reason."""

from __future__ import annotations

import difflib
import sys
import typing
from pathlib import Path

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from common.config import check_key, check_override, exit_on_user_error
from common.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # Hydra's config groups are its folders


def fail(message: str) -> typing.NoReturn:
    """A user's mistake: one line and status 2, as every command says it."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def refused_by_hydra(err: Exception, fix: str = "") -> None:
    """Hydra's reason on one line, status 2, for what check_overrides doesn't judge (a sweep without -m, ...)."""
    if not isinstance(err, HydraException | OmegaConfBaseException):
        return
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
    lines = [line.strip() for text in (str(err), str(cause or "")) for line in text.splitlines() if line.strip()]
    fail((" ".join(lines) or type(err).__name__) + fix)


def check_overrides(args: list[str], schema: type, groups: tuple[str, ...] = ()) -> None:
    """Fail unless every `key=value` names a schema key with a value of its type and range, and every group in
    `groups` a preset. hydra.* and range()/interval() sweeps are Hydra's to judge (each job checks its own)."""
    known, unknown = get_args_parser().parse_known_args(args)
    if known.shell_completion:
        return  # `-sc install=bash` and its queries are not overrides
    overrides = [*known.overrides, *(arg for arg in unknown if not arg.startswith("-"))]  # not `job` of `--cfg job`
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:  # the commonest cause: a value the shell split, or Hydra's symbols unquoted
        refused_by_hydra(err, ". Quote a value with spaces, commas or symbols twice: start=\"'To be, or not'\"")
    for override in parsed:
        key = override.key_or_group
        if override.is_hydra_override() or override.is_delete():
            continue
        with exit_on_user_error():
            if key in groups:
                for value in override.sweep_iterator() if override.is_sweep_override() else [override.value()]:
                    _check_preset(key, value)
            elif not override.is_sweep_override():
                check_override(schema, key, override.value())
            elif isinstance(override.value(), ChoiceSweep):  # a,b,c or choice(a,b,c)
                for value in override.sweep_iterator():
                    check_override(schema, key, value)
            else:
                check_key(schema, key)


def presets(group: str) -> list[str]:
    """A config group's choices: the YAML files in its folder."""
    return sorted(path.stem for path in (CONFIG_DIR / group).glob("*.yaml"))


def _check_preset(group: str, value: object) -> None:
    choices = presets(group)
    if value is None or str(value) in choices:
        return
    close = difflib.get_close_matches(str(value), choices, 1, 0.6)
    guess = f"; did you mean {group}={close[0]}?" if close else ""
    raise ConfigError(f"{group}={value} is unknown{guess} (the choices: {', '.join(choices)})")
