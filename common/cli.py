"""Why a command line was refused, in one line: a did-you-mean, a bad value's key and rule, or quoting that works."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override
from hydra.errors import HydraException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from common.config import check_key, check_override, end_quietly_when_stdout_closes, exit_on_user_error
from common.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # Hydra's config groups are its folders


def fail(message: str) -> typing.NoReturn:
    """A user's mistake: one line and status 2, as every command says it."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def refused_by_hydra(err: Exception) -> None:
    """Hydra's reason on one line, status 2, for refusals check_overrides can't explain (a sweep without -m, ...)."""
    if not isinstance(err, HydraException | OmegaConfBaseException):
        return
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
    lines = [line.strip() for text in (str(err), str(cause or "")) for line in text.splitlines() if line.strip()]
    fail(" ".join(lines) or type(err).__name__)


def check_arguments(args: list[str], schema: type, groups: tuple[str, ...], usage: Callable[[], str]) -> None:
    """Before Hydra sees them: --help prints `usage`; dashed keys, hydra.job.chdir and sweeps are checked."""
    if "-h" in args or "--help" in args:
        end_quietly_when_stdout_closes()
        print(usage().strip())
        sys.exit(0)
    check_overrides(args, schema, groups)


def check_overrides(args: list[str], schema: type, groups: tuple[str, ...] = ()) -> None:
    """Fail unless every `key=value` parses and names a schema key with a value of its type and range, and every group
    in `groups` a preset. hydra.* and range()/interval() sweeps are Hydra's to judge (each job checks its own)."""
    if get_args_parser().parse_known_args(args)[0].shell_completion:
        return  # `-sc install=bash` and its queries are not overrides
    _refuse_dashed_keys(args, schema, groups)
    parsed = _parse(args, schema, groups)
    for override in parsed:
        key = override.key_or_group
        if key == "hydra.job.chdir" and str(override.value()).lower() in ("true", "yes", "on", "1", "y"):
            fail("hydra.job.chdir=true would run the command in Hydra's output directory, where relative paths "
                 "(out_dir, data.dir) name other places than they do here; drop it: paths resolve from here")
        if override.is_hydra_override() or override.is_delete():
            continue
        with exit_on_user_error():
            if key in groups:
                for value in override.sweep_iterator() if override.is_sweep_override() else [override.value()]:
                    _check_preset(key, value)
                continue
            if not override.is_sweep_override():
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


def _refuse_dashed_keys(args: list[str], schema: type, groups: tuple[str, ...]) -> None:
    """`--max_iters=100`: fail with the override to write. Only Hydra's flags in full pass (argparse takes prefixes)."""
    hydra_flags = {flag for action in get_args_parser()._actions for flag in action.option_strings}
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg in hydra_flags or arg.partition("=")[0] in hydra_flags:
            continue
        name, eq, value = arg[2:].partition("=")
        shown = arg
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-") and "=" not in args[i + 1]:
            value, shown = args[i + 1], f"{arg} {args[i + 1]}"
        key = _key_named(name.replace("-", "_"), schema, groups)
        if key is None:
            fail(f"{arg} is not an option: settings are written key=value, no dashes (see --help)")
        fail(f"{shown}: settings are Hydra overrides, without dashes; write {key}={value or 'VALUE'}")


def _key_named(name: str, schema: type, groups: tuple[str, ...]) -> str | None:
    """The key or group a dashed option means: itself, or the one key whose last part it is (max_iters)."""
    if name in groups:
        return name
    try:
        check_key(schema, name)
        return name
    except ConfigError:
        pass
    found = [key for key in _leaf_keys(schema) if key.rsplit(".", 1)[-1] == name]
    return found[0] if len(found) == 1 else None


def _leaf_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for name, hint in typing.get_type_hints(schema).items():
        nested = dataclasses.is_dataclass(hint)
        keys += _leaf_keys(hint, f"{prefix}{name}.") if nested else [f"{prefix}{name}"]
    return keys


def _not_an_override(text: str, schema: type, groups: tuple[str, ...]) -> str:
    """What a bare word on the command line (no `=`) was probably meant to be."""
    group = next((g for g in groups if text in presets(g)), None)
    if group:
        return f"{text} is not an override; did you mean {group}={text}?"
    if "out_dir" in typing.get_type_hints(schema) and (Path(text).is_dir() or "/" in text or "\\" in text):
        return f"{text} is not an override; to name a run directory, write out_dir={text}"
    return f"{text} is not an override: settings are written key=value (see --help)"


def _parse(args: list[str], schema: type, groups: tuple[str, ...]) -> list[Override]:
    """The overrides parsed; else one line saying how to quote a value, or what a bare word may have meant."""
    overrides = _overrides(args)
    bare = next((o for o in overrides if "=" not in o and not o.startswith(("~", "+"))), None)
    split_by_the_shell = any(q in o for o in overrides for q in "'\"") or any(o.endswith(",") for o in overrides)
    if bare is not None and not split_by_the_shell:  # a quoted value the shell split is the quoting hint's case
        fail(_not_an_override(bare, schema, groups))
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except ValueError as err:  # Python's limit on integer digits, hit while Hydra parses a number
        if "digits" not in str(err):
            raise
        long = next((o for o in overrides if sum(c.isdigit() for c in o) > 4300), "a value")
        key = long.partition("=")[0] if "=" in long else long[:40]
        fail(f"{key}= has a number of more than 4300 digits; no key takes one that long")
    except OverrideParseException:
        text = " ".join(overrides)
        tilde = next((o for o in overrides if re.match(r"[^=~'\"]+=~", o)), None)  # zsh passes ~ on unexpanded
        if tilde is not None:
            key, _, value = tilde.partition("=")
            home = value == "~" or value.startswith("~/")
            also = f" (~ is then your home directory), or write {key}=$HOME{value[1:]}" if home else ""
            fail(f"{tilde}: Hydra can't read a value starting with ~ unquoted; quote it for Hydra, "
                 f"{key}=\"'{value}'\"{also}")
        windows = ""
        if "\\" in text:
            windows = (" A Windows path works unquoted (data.input=C:\\Users\\me\\input.txt); quoted, double a "
                       "backslash before the closing quote: \"data.dir='C:\\data\\\\'\"")
        fail(f"can't parse the overrides `{text}`. Quote values with spaces, commas or symbols twice, once for the "
             f"shell and once for Hydra: start=\"'To be, or not'\".{windows}")


def _overrides(args: list[str]) -> list[str]:
    """The overrides among the arguments, as Hydra's own parser sees them: not `job` in `--cfg job`."""
    known, unknown = get_args_parser().parse_known_args(args)
    return [*known.overrides, *(a for a in unknown if not a.startswith("-"))]
