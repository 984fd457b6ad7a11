"""Load a run config: YAML file + ``key=value`` overrides -> typed :class:`RunConfig`.

Every problem is collected, not just the first: unknown keys (with the
closest known key), wrong types and out-of-range values each become a
:class:`~areal_core.problems.Problem` naming the key path, the value and what
is allowed. OmegaConf reads YAML and dotted overrides (it also gets ``1e-5``
right, which PyYAML reads as a string); the typed walk is ours because
OmegaConf's structured configs stop at the first error.

Beyond a field's own rules every value meets the limits of what reads it: a
number is finite (no ``nan``, no ``.inf`` unless the field's metadata says
``allow_inf=True``) and within a float's range, an integer fits in 64 bits, a
string holds no NUL character, and the items of a ``list[str]`` field are
strings (``min_length`` applies to each).
"""

from __future__ import annotations

import dataclasses
import math
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
        merged = _read_file(path)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not re.fullmatch(r"[A-Za-z_][\w\-]*(\.[A-Za-z_][\w\-]*)*", key.strip()):
            fix = "write overrides as dotted.key=value, e.g. actor.optimizer.lr=1e-5"
            if not sep and (item.endswith((".yaml", ".yml")) or "/" in item):
                fix += " (a config file comes first, before the overrides)"
            problems.append(Problem("core.override", f"cannot read override {_short(repr(item))}", fix,
                                    key=_short(key.strip())))
            continue
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key.strip()}={value}"]))
        except Exception as exc:  # YAML scanner errors and container clashes alike: the user's input
            reason = " ".join(str(exc).split())
            problems.append(Problem("core.override",
                                    f"cannot apply override {_short(repr(item))}: {_short(reason, 300)}",
                                    "check the value's YAML syntax, and that a section is not set to a plain value "
                                    "(or the reverse) by two overrides", key=key.strip()))
    try:
        raw = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        problems.append(Problem("core.interpolation", str(exc).splitlines()[0],
                                "fix the ${...} reference so it names an existing key"))
        raw = OmegaConf.to_container(merged, resolve=False)
    return raw if isinstance(raw, dict) else {}, problems


def _read_file(path: str) -> Any:
    """The YAML file at ``path`` as an OmegaConf mapping; every way it cannot be one is a ProblemsError."""
    from omegaconf import DictConfig, OmegaConf

    def refuse(code: str, message: str, fix: str) -> ProblemsError:
        return ProblemsError([Problem(code, message, fix)], source=_short(str(path)))

    file = Path(path)
    try:
        is_file, is_dir = file.is_file(), file.is_dir()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise refuse("core.config-file", f"cannot read config {_short(str(path))}: {reason}",
                     "give the path of a YAML config, or write key=value for an override") from None
    if not is_file:
        what = "is a directory, not a file" if is_dir else "does not exist"
        raise refuse("core.config-file", f"config {path} {what}", "give the path of a YAML config")

    def not_yaml(exc: Exception) -> ProblemsError:
        return refuse("core.yaml", f"{path} is not valid YAML: {_short(str(exc), 600)}".strip(),
                      "fix the YAML syntax at the line shown")

    try:
        text = file.read_text(encoding="utf-8")
    except Exception as exc:  # a file not in UTF-8, an unreadable file
        raise not_yaml(exc) from None
    try:
        loaded, failure = OmegaConf.load(file), None
    except Exception as exc:  # yaml.YAMLError and friends: shown with where, unless the shape says more
        loaded, failure = None, exc
    # OmegaConf reads an empty file as {} and a lone word as {word: None}; PyYAML tells them apart.
    if failure is not None or not isinstance(loaded, DictConfig) or len(loaded) == 0 or (
            len(loaded) == 1 and list(OmegaConf.to_container(loaded, resolve=False).values()) == [None]):
        shape = _top_level(text)
        if shape is None:
            raise refuse("core.config-file", f"config {path} is empty (it sets no key; comments do not count), so "
                         "the run would be the core defaults, not the built-in demo",
                         "write the run's keys in it (copy the built-in demo: cli/areal_cli/demo.yaml), write {} "
                         "to mean the core defaults, or give no config for the built-in demo")
        if shape is not dict:
            what = {list: "a list", str: "a string"}.get(shape, f"a single {getattr(shape, '__name__', 'value')}")
            raise refuse("core.yaml", f"{path} must hold a mapping of keys at the top level, not {what}",
                         "write the config as 'key: value' lines")
        if failure is not None:
            raise not_yaml(failure)
        if not isinstance(loaded, DictConfig):
            raise refuse("core.yaml", f"{path} must hold a mapping of keys at the top level",
                         "write the config as 'key: value' lines")
    return loaded


def _top_level(text: str) -> type | None:
    """The type of the YAML document's top level (None for an empty one), or dict when PyYAML cannot tell."""
    import yaml

    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except Exception:  # not YAML to PyYAML (its constructors raise more than YAMLError): OmegaConf's reading decides
        return dict
    return None if data is None else type(data)


def _short(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters for a message."""
    return text if len(text) <= limit else f"{text[:limit - 20]}...{text[-12:]} ({len(text)} characters)"


def _describe(value: Any) -> str:
    return f"{_show(value)} ({type(value).__name__})"


def _show(value: Any) -> str:
    """``repr(value)`` as a message may quote it: a huge integer by its size, a long text cut short."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        try:
            digits = str(len(str(abs(value))))
        except ValueError:  # beyond Python's int-to-text limit (4300 digits)
            digits = f"about {int(value.bit_length() * math.log10(2)) + 1}"
        return f"{'-' if value < 0 else ''}an integer of {digits} digits"
    text = repr(value)
    return _short(text)


INT_LIMIT = 2**63 - 1  # what torch, numpy and every server behind the engines hold


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
        if ok and not -INT_LIMIT <= value <= INT_LIMIT:
            return value, Problem("core.range", f"{_show(value)} is too large; an integer must fit in 64 bits "
                                  f"(-{INT_LIMIT} to {INT_LIMIT})", f"set {key} to a smaller integer", key)
    elif origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                value, ok = float(value), True
            except OverflowError:
                return value, Problem("core.range", f"{_show(value)} is too large for a number (at most about "
                                      f"1.8e308)", f"set {key} to a smaller number", key)
        elif isinstance(value, str):
            try:
                value, ok = float(value), True
            except ValueError:
                ok = False
    elif origin is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        ok = isinstance(value, str)
        if ok and "\x00" in value:
            return value, Problem("core.type", f"{_show(value)} holds a NUL character",
                                  f"remove the \\0 from {key}", key)
    elif origin in (list, dict):
        ok = isinstance(value, origin)
        args = typing.get_args(typ)
        if ok and origin is list and args:
            items = []
            for i, item in enumerate(value):
                item, problem = coerce(item, args[0], f"{key}[{i}]")
                if problem is not None:
                    return value, problem
                items.append(item)
            value = items
    if ok:
        return value, None
    return value, Problem("core.type", f"{_describe(value)} is not {_TYPE_WORDS.get(origin, origin)}",
                          f"set {key} to {_TYPE_WORDS.get(origin, origin)}", key)


def range_problem(value: Any, meta: dict, key: str) -> Problem | None:
    """The first rule in ``meta`` that ``value`` breaks, as a problem.

    A float is finite unless ``allow_inf`` (then ``±inf`` passes, ``nan`` never); ``min_length`` is the
    least length of a string, or of each string in a list.
    """
    if isinstance(value, float) and not math.isfinite(value) and not (meta.get("allow_inf") and math.isinf(value)):
        allowed = "a finite number or .inf" if meta.get("allow_inf") else "a finite number"
        zero = re.search(r"(?:^|; )(0 (?:=|disables) [^;]*)", meta.get("help", ""))  # "0 = off" says how to say "never"
        return Problem("core.range", f"{value!r} is not a finite number",
                       f"set {key} to {allowed}" + (f" ({zero.group(1)})" if zero else ""), key)
    if "min_length" in meta:
        texts = value if isinstance(value, list) else [value]
        for i, text in enumerate(texts):
            if isinstance(text, str) and len(text) < meta["min_length"]:
                where = f"item {i} ({text!r}) " if isinstance(value, list) else ""
                what = "empty" if meta["min_length"] == 1 else f"shorter than {meta['min_length']} characters"
                return Problem("core.range", f"{where}is {what}", f"remove it from {key}" if where
                               else f"set {key} to a longer text", key)
    checks = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"))
    for name, test, word in checks:
        if name in meta and not test(value, meta[name]):
            return Problem("core.range", f"{_show(value)} is out of range; it must be {word} {meta[name]}",
                           f"set {key} to a value {word} {meta[name]}", key)
    if "choices" in meta and value not in meta["choices"]:
        options = ", ".join(map(str, meta["choices"]))
        guess = closest(str(value), [str(c) for c in meta["choices"]])
        return Problem("core.choice", f"{_show(value)} is not allowed; choose one of: {options}",
                       f"set {key}={guess or meta['choices'][0]}", key)
    if "pattern" in meta and not re.fullmatch(meta["pattern"], str(value)):
        return Problem("core.pattern", f"{_show(value)} is not a valid name (letters, digits, '_', '-', '.')",
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
        if isinstance(value, bool) and "bool_words" in field.metadata:  # YAML reads on / off as true / false
            value = field.metadata["bool_words"][value]
        converted, problem = coerce(value, typ, path)
        if problem is None:
            problem = range_problem(converted, dict(field.metadata), path)
        if problem is not None:
            problems.append(problem)
            continue
        values[key] = converted
    try:
        instance = cls(**values)
    except Exception as exc:  # a config_class's own __post_init__ check, or a field it left without a default
        where = prefix.rstrip(".") or "the config"
        problems.append(Problem("core.config-class", f"{cls.__name__} refused these values: {type(exc).__name__}: "
                                f"{_short(str(exc), 300)}", f"correct the keys under {where}", prefix.rstrip(".")))
        try:
            instance = cls()
        except Exception:
            return None
        values = {}
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

