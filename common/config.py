"""Typed configs whose fields carry their allowed values (`option`), built at start by typed_config: a bad value is one
ConfigError naming the key. run_hydra runs a command: a command line at fault (a misspelt key or preset, with a
did-you-mean; a value against its key's rule; else Hydra's own reason) is one line on stderr and exit status 2."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import math
import operator
import os
import re
import signal
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from common.errors import ConfigError, UserError

Config = TypeVar("Config")
# option()'s bounds: the word a message uses, and the test a value passes
BOUNDS = {"at_least": (">=", operator.ge), "above": (">", operator.gt), "below": ("<", operator.lt),
          "at_most": ("<=", operator.le)}
SEED_MAX = 2**63 - 1  # torch's generators take 64 bits; sample i of sample.py draws from seed + i
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # Hydra's config groups are its folders
# A saved config.yaml read without Hydra resolves ${now:...} as Hydra does (Hydra registers the same resolver again).
OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern), use_cache=True, replace=True)


def option(default: Any, *, path: bool = False, hint: str = "", **rules: Any) -> Any:
    """A field and its rules: choices, or bounds at_least, above, below, at_most; path: `~` expanded; hint: the fix."""
    return dataclasses.field(default=default, metadata={"rules": {**rules, "hint": hint}, "path": path})


def check_fields(config: Any, prefix: str = "") -> None:
    """This dataclass's own fields with rules (nested configs check themselves); keys named as prefix + name."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata.get("path") and isinstance(value, str) and value.startswith("~"):
            value = os.path.expanduser(value)  # only the ~: an unknown ~user, "" and the rest are left as given
            setattr(config, f.name, value)
        if "rules" in f.metadata and value is not None:
            problem = _problem(value, **f.metadata["rules"])
            if problem:
                raise ConfigError(f"{prefix}{f.name}={value} {problem}")


def typed_config(cfg: DictConfig | Config, schema: type[Config]) -> Config:
    """cfg (Hydra's, a saved config.yaml or the schema's) as the schema's dataclasses, each checked as it is built."""
    if isinstance(cfg, schema):
        return OmegaConf.to_object(OmegaConf.structured(cfg))
    _refuse_unknown_keys(cfg, schema)
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is schema:  # as Hydra composes it
        return OmegaConf.to_object(cfg)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))


def key_docs(schema: type, prefix: str = "") -> dict[str, str]:
    """Each key's one description: its field's comment in the schema (the comment on the field's line, else the
    comment lines just above it), groups' keys dotted. --help and docs/reference.md's key tables are made from it."""
    described: dict[str, str] = {}
    for cls in reversed([c for c in schema.__mro__ if dataclasses.is_dataclass(c)]):  # a base's fields first
        source = inspect.getsource(cls)
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        comments = {t.start[0]: t.string[1:].strip() for t in tokens if t.type == tokenize.COMMENT}
        above: list[str] = []
        for number, line in enumerate(source.splitlines(), 1):
            if line.strip().startswith("#"):
                above.append(comments.get(number, ""))
            elif field := re.match(r" {4}(\w+): ", line):
                described[field[1]] = comments.get(number) or " ".join(above)
                above = []
            else:
                above = []
    docs, hints = {}, typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            docs |= key_docs(hint, f"{prefix}{f.name}.")
        else:
            docs[prefix + f.name] = described.get(f.name, "")
    return docs


def keys_help(schema: type, keys: Sequence[str]) -> str:
    """--help's lines for `keys`: each key at its default, and its schema comment (key_docs), wrapped to 120 columns."""
    docs, lines = key_docs(schema), []
    for key in keys:
        default = _default(check_key(schema, key)[1])
        default = re.sub(r"\$\{now:[^}]*\}", "NOW", default)  # the default out_dir: outputs/NOW/NOW
        lines.append(textwrap.fill(docs[key], 118, initial_indent=f"  {f'{key}={default}':<26}  ",
                                   subsequent_indent=" " * 30))
    return "\n".join(lines)


def _default(field: dataclasses.Field) -> str:
    """A field's default as the command line writes it, a control character escaped (sample.py's start: \\n)."""
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in shown(default))


def key_table(schema: type) -> str:
    """docs/reference.md's table of a schema's keys: default, what a value may be, and the key_docs description."""
    rows = ["| key | default | value | what |", "| --- | --- | --- | --- |"]
    for key, doc in key_docs(schema).items():
        _, field, hint = check_key(schema, key)
        rules = {k: v for k, v in field.metadata.get("rules", {}).items() if k != "hint"}
        allowed = ", ".join(rules.pop("choices", ())) or _kind(hint)
        allowed += " or null" if type(None) in typing.get_args(hint) and "null" not in allowed else ""
        allowed += "".join(f", {BOUNDS[bound][0]} {shown(value)}" for bound, value in rules.items())
        doc = doc.replace("|", r"\|")  # a | inside a cell would end it
        rows.append(f"| `{key}` | `{_default(field)}` | {allowed} | {doc} |")
    return "\n".join(rows) + "\n"


def check_key(schema: type, key: str) -> tuple[type, dataclasses.Field, Any]:
    """The dataclass holding the dotted `key`, its field and the field's type; else a ConfigError naming the closest
    key (a class constant such as ModelConfig.KEYS is no key)."""
    owner, hint, prefix = schema, schema, ""
    for name in key.split("."):
        if not dataclasses.is_dataclass(hint):
            raise ConfigError(f"{prefix[:-1]} is a value, not a group of keys, so {key} is not a key")
        owner, fields = hint, {f.name: f for f in dataclasses.fields(hint)}
        if name not in fields:
            raise ConfigError(_unknown_key(name, fields, prefix))
        field, hint, prefix = fields[name], typing.get_type_hints(owner)[name], f"{prefix}{name}."
    return owner, field, hint


def check_override(schema: type, key: str, value: Any) -> None:
    """Check a `key=value`: known key, its type and rules; else a ConfigError naming it (not Hydra's `+key` advice)."""
    owner, field, hint = check_key(schema, key)
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: judged once resolved
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={shown(value)}: {key} is a group of keys; set one as {key}.KEY=VALUE")
        for sub_key, sub_value in value.items():  # train={max_iters:2,batch_size:8}
            check_override(schema, f"{key}.{sub_key}", sub_value)
        return
    node = OmegaConf.structured(owner)
    try:
        node[field.name] = value  # OmegaConf's own conversion ("1e-3" to a float), as when Hydra merges
    except ValidationError:
        raise ConfigError(f"{key}={shown(value)} is not {_kind(hint)}") from None
    value = node[field.name]
    problem = _problem(value, **field.metadata["rules"]) if "rules" in field.metadata and value is not None else ""
    if problem:
        raise ConfigError(f"{key}={shown(value)} {problem}")


def shown(value: Any) -> str:
    """A value as it is written on the command line: null, true, [a,b]."""
    if value is None or isinstance(value, bool):
        return str(value).lower() if value is not None else "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(shown, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def _kind(hint: Any) -> str:
    """What a type annotation accepts, in words: `int | None` is "an integer or null"."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = typing.get_args(hint) if union else (hint,)
    kinds = {int: "an integer", float: "a number", bool: "true or false", str: "text", type(None): "null",
             list: "a list such as [a,b]", tuple: "a list such as [a,b]"}
    words = [kinds.get(typing.get_origin(t) or t, getattr(t, "__name__", "?")) for t in members]
    return " or ".join(sorted(words, key=lambda word: word == "null"))


def _unknown_key(key: str, hints: dict[str, Any], prefix: str) -> str:
    """The closest keys named: by their initials (lr: learning_rate), their start, or their spelling."""
    known = list(hints)
    initials = [k for k in known if "_" in k and "".join(word[:1] for word in k.split("_")) == key]
    closest = [k for k in known if k.startswith(key)] or difflib.get_close_matches(key, known, 1, 0.5)
    guesses = " or ".join(prefix + k for k in [*initials, *closest][:2])
    suggestion = f"; did you mean {guesses}?" if guesses else "; see the keys with --cfg job"
    return f"{prefix}{key} is not a key of this config{suggestion}"


def _refuse_unknown_keys(cfg: Any, schema: type, prefix: str = "") -> None:
    """Hydra's `+key=value` adds a key even to a typed config: refused, naming the closest real key."""
    hints = typing.get_type_hints(schema)
    for key in cfg:
        if key not in hints:
            raise ConfigError(_unknown_key(str(key), hints, prefix))
        if dataclasses.is_dataclass(hints[key]) and OmegaConf.is_dict(cfg[key]):
            _refuse_unknown_keys(cfg[key], hints[key], f"{prefix}{key}.")


def _problem(value: Any, choices: Sequence[str] | None = None, hint: str = "", **bounds: float) -> str:
    """What is wrong with `value` under a field's rules, in words ("must be >= 1"); "" if nothing."""
    broken = [f"must be {BOUNDS[name][0]} {bound}" for name, bound in bounds.items()
              if not BOUNDS[name][1](value, bound)]
    if bounds and isinstance(value, float) and not math.isfinite(value):
        broken = ["must be a finite number"]
    elif choices is not None and value not in choices:
        broken = [f"is unknown; use one of {', '.join(choices)}"]
    return (f"{broken[0]}; {hint}" if hint else broken[0]) if broken else ""


def fail(message: str) -> typing.NoReturn:
    """A user's mistake: one line and status 2, as every command says it."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def end_quietly_when_stdout_closes() -> None:
    """A reader that leaves (`sample.py | head`) ends the command as it ends `cat`: by SIGPIPE, without a word."""
    if hasattr(signal, "SIGPIPE"):  # not on Windows
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def run_hydra(task: Callable[[DictConfig], None], config_name: str, schema: type, groups: tuple[str, ...] = (),
              usage: Callable[[], str] = str) -> None:
    """Runs a command: Hydra composes configs/`config_name`.yaml and the command line into `task`'s config. A user's
    mistake, on the command line (a sweep's, all at once) or found by the task, is one line and exit status 2."""
    args = sys.argv[1:]
    if "-h" in args or "--help" in args or "-m" in args or "--multirun" in args:
        _help_or_sweep(args, schema, groups, usage)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing and exiting

    @functools.wraps(task)  # Hydra names the job after the task's file
    def job(cfg: DictConfig) -> None:
        try:
            task(cfg)
        except UserError as err:
            _fail_job(err)

    try:
        hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=config_name)(job)()
    except (Exception, KeyboardInterrupt) as err:
        _exit_if_not_a_bug(err, args, schema, groups)
        raise


def _help_or_sweep(args: list[str], schema: type, groups: tuple[str, ...], usage: Callable[[], str]) -> None:
    """--help prints `usage`; a sweep's every value is checked before its first job runs."""
    if "-h" in args or "--help" in args:
        end_quietly_when_stdout_closes()
        print(usage().strip())
        sys.exit(0)
    check_overrides(args, schema, groups)


def _fail_job(err: UserError) -> typing.NoReturn:
    """A job's mistake in one line; a sweep's job says which it is, and the sweep stops there."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    fail(f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)}): {err}" if multirun else str(err))


def _exit_if_not_a_bug(err: BaseException, args: list[str], schema: type, groups: tuple[str, ...]) -> None:
    """Ctrl-C: status 130; the command line at fault, or what only Hydra can say: one line. A bug returns, to raise."""
    if isinstance(err, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    check_overrides(args, schema, groups)
    refused_by_hydra(err)


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
        key, sweep = override.key_or_group, override.is_sweep_override()
        if override.is_hydra_override() or override.is_delete():
            continue
        try:
            if sweep and key not in groups and not isinstance(override.value(), ChoiceSweep):
                check_key(schema, key)  # range() or interval(): each job checks its own value
                continue
            for value in override.sweep_iterator() if sweep else [override.value()]:
                if key not in groups:
                    check_override(schema, key, value)
                elif value is not None and str(value) not in (choices := presets(key)):
                    close = difflib.get_close_matches(str(value), choices, 1, 0.6)
                    guess = f"; did you mean {key}={close[0]}?" if close else ""
                    raise ConfigError(f"{key}={value} is unknown{guess} (the choices: {', '.join(choices)})")
        except ConfigError as err:
            fail(str(err))


def presets(group: str) -> list[str]:
    """A config group's choices: the YAML files in its folder."""
    return sorted(path.stem for path in (CONFIG_DIR / group).glob("*.yaml"))


def literal_text(args: list[str], keys: tuple[str, ...]) -> list[str]:
    """`${` escaped in the text values of `keys`, so Hydra doesn't resolve `start='Cost: ${price}'`."""
    return [re.sub(r"(?<!\\)\$\{", r"\\${", arg) if arg.split("=")[0].lstrip("+~") in keys else arg for arg in args]
