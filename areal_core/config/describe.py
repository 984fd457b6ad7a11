"""The config reference table in docs/config.md, generated from the schema
(a test keeps the page and the schema in step)."""

from __future__ import annotations

import dataclasses
import typing

from areal_core.config.schema import RunConfig

_RULE_WORDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _rules(meta: dict) -> str:
    parts = [f"{_RULE_WORDS[k]} {v}" for k, v in meta.items() if k in _RULE_WORDS]
    if "choices" in meta:
        parts.append("one of " + ", ".join(map(str, meta["choices"])))
    if "min_length" in meta:
        parts.append("no empty string" if meta["min_length"] == 1 else f"strings of >= {meta['min_length']} characters")
    if meta.get("allow_inf"):
        parts.append(".inf allowed")
    return ", ".join(parts)


def key_rows(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, default, rules, help) for every leaf key, in schema order."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(key_rows(hints[f.name], f"{prefix}{f.name}."))
        elif f.name != "extra":
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{prefix}{f.name}", repr(default), _rules(dict(f.metadata)), f.metadata.get("help", "")))
    return rows


def key_table() -> str:
    lines = ["| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{k}` | `{d}` | {r} | {h} |" for k, d, r, h in key_rows()]
    return "\n".join(lines)
