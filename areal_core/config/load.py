"""Load a run config: YAML file + ``key=value`` overrides -> typed :class:`RunConfig`.

Every problem is collected, not just the first: unknown keys (with the
closest known key), wrong types and out-of-range values each become a
:class:`~areal_core.problems.Problem` naming the key path, the value and what
is allowed. OmegaConf reads YAML and dotted overrides (it also gets ``1e-5``
right, which PyYAML reads as a string); the typed walk is ours because
OmegaConf's structured configs stop at the first error.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

from areal_core.config.schema import COMPONENT_SECTIONS, RunConfig
from areal_core.discovery import closest
from areal_core.problems import Problem, ProblemsError

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "a list", dict: "a mapping"}


def read_raw(path: str | None, overrides: list[str]) -> tuple[dict, list[Problem]]:
    """The user's YAML merged with overrides, as plain containers (no types yet)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    problems: list[Problem] = []
    merged = OmegaConf.create({})
    if path is not None:
        file = Path(path)
        if not file.is_file():
            what = "is a directory, not a file" if file.is_dir() else "does not exist"
            raise ProblemsError(
                [Problem("core.config-file", f"config {path} {what}", "give the path of a YAML config")],
                source=str(path),
            )
        try:
            loaded = OmegaConf.load(file)
        except Exception as exc:  # yaml.YAMLError and friends: show where
            raise ProblemsError(
                [Problem("core.yaml", f"{path} is not valid YAML: {exc}".strip(), "fix the YAML syntax at the line shown")],
                source=str(path),
            ) from None
        if not isinstance(loaded, type(merged)):
            raise ProblemsError(
                [Problem("core.yaml", f"{path} must hold a mapping of keys at the top level, not a list",
                         "write the config as 'key: value' lines")],
                source=str(path),
            )
        merged = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not re.fullmatch(r"[A-Za-z_][\w\-]*(\.[A-Za-z_][\w\-]*)*", key.strip()):
            problems.append(Problem("core.override", f"cannot read override {item!r}",
                                    "write overrides as dotted.key=value, e.g. actor.optimizer.lr=1e-5",
                                    key=key.strip()))
            continue
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key.strip()}={value}"]))
        except Exception as exc:  # YAML scanner errors and container clashes alike: the user's input
            reason = " ".join(str(exc).split())
            problems.append(Problem("core.override", f"cannot apply override {item!r}: {reason}",
                                    "check the value's YAML syntax, and that a section is not set to a plain value "
                                    "(or the reverse) by two overrides", key=key.strip()))
    try:
        raw = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        problems.append(Problem("core.interpolation", str(exc).splitlines()[0],
                                "fix the ${...} reference so it names an existing key"))
        raw = OmegaConf.to_container(merged, resolve=False)
    return raw if isinstance(raw, dict) else {}, problems


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def coerce(value: Any, typ: Any, key: str) -> tuple[Any, Problem | None]:
    """Value converted to ``typ``, or a problem naming key, value and expected type."""
    origin = typing.get_origin(typ) or typ
    if value is None:
        return None, Problem("core.type", "has no value", f"give {key} a value, e.g. {key}=...", key)
    ok = False
    if origin is bool:
        ok = isinstance(value, bool)
    elif origin is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = float(value), True
        elif isinstance(value, str):
            try:
                value, ok = float(value), True
            except ValueError:
                ok = False
    elif origin is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        ok = isinstance(value, str)
    elif origin in (list, dict):
        ok = isinstance(value, origin)
    if ok:
        return value, None
    return value, Problem("core.type", f"{_describe(value)} is not {_TYPE_WORDS.get(origin, origin)}",
                          f"set {key} to {_TYPE_WORDS.get(origin, origin)}", key)


def range_problem(value: Any, meta: dict, key: str) -> Problem | None:
    """The first rule in ``meta`` that ``value`` breaks, as a problem."""
    checks = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"))
    for name, test, word in checks:
        if name in meta and not test(value, meta[name]):
            return Problem("core.range", f"{value!r} is out of range; it must be {word} {meta[name]}",
                           f"set {key} to a value {word} {meta[name]}", key)
    if "choices" in meta and value not in meta["choices"]:
        options = ", ".join(map(str, meta["choices"]))
        guess = closest(str(value), [str(c) for c in meta["choices"]])
        return Problem("core.choice", f"{value!r} is not allowed; choose one of: {options}",
                       f"set {key}={guess or meta['choices'][0]}", key)
    if "pattern" in meta and not re.fullmatch(meta["pattern"], str(value)):
        return Problem("core.pattern", f"{value!r} is not a valid name (letters, digits, '_', '-', '.')",
                       f"rename {key}", key)
    return None


def build(cls: type, raw: dict, prefix: str, problems: list[Problem], extras_ok: bool = False) -> Any:
    """Instantiate dataclass ``cls`` from ``raw``, appending every problem found.

    With ``extras_ok`` unknown keys are kept in the instance's ``extra`` dict
    (they belong to the selected component and are checked once it resolves).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        field = fields.get(key)
        if field is None:
            if extras_ok:
                extra[key] = value
                continue
            known = [n for n in fields if n != "extra"]
            guess = closest(str(key), known)
            hint = f"did you mean {prefix}{guess}?" if guess else f"remove it; keys here are: {', '.join(known)}"
            problems.append(Problem("core.unknown-key", "unknown key", hint, path))
            continue
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                problems.append(Problem("core.type", f"{_describe(value)} is not a mapping",
                                        f"write {path} as a section of keys", path))
                continue
            sub_extras = prefix == "" and key in COMPONENT_SECTIONS
            values[key] = build(typ, value, f"{path}.", problems, extras_ok=sub_extras)
            continue
        converted, problem = coerce(value, typ, path)
        if problem is None:
            problem = range_problem(converted, dict(field.metadata), path)
        if problem is not None:
            problems.append(problem)
            continue
        values[key] = converted
    instance = cls(**values)
    # Defaults are checked too: a component's config_class may ship a bad default.
    for name, field in fields.items():
        if name not in values and field.metadata:
            default = getattr(instance, name)
            if not dataclasses.is_dataclass(default) and default is not None:
                problem = range_problem(default, dict(field.metadata), f"{prefix}{name}")
                if problem is not None:
                    problems.append(problem)
    if extra:
        instance.extra = {**instance.extra, **extra}
    return instance


def load_config(path: str | None = None, overrides: list[str] | None = None) -> tuple[RunConfig, list[Problem]]:
    """The typed config and every problem found in types and ranges.

    Component-specific keys are not checked here (see
    :func:`areal_core.config.validate.validate_run`, which resolves the
    selected components).
    """
    from areal_core.config.dtype import resolve_dtype

    raw, problems = read_raw(path, list(overrides or []))
    config = build(RunConfig, raw, "", problems)
    config.model.dtype = resolve_dtype(config.model.dtype)  # engines only ever see a concrete dtype
    return config, problems

