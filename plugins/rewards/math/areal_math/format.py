"""The ``format`` reward: does the completion have the required ``<think>`` block and tags?"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from areal_core.api import Reward
from areal_core.config.schema import spec

TAG_NAME = re.compile(r"[A-Za-z][\w.-]*")


@dataclass
class FormatConfig:
    """Keys of the ``reward`` section when ``reward.name: format``."""

    think: bool = spec(True, help="require a non-empty <think>...</think> block before anything else")
    think_tag: str = spec("think", pattern=TAG_NAME.pattern, help="the reasoning block's tag name")
    tags: list = spec(factory=list, help="tags that must each enclose non-empty text after the reasoning, e.g. [answer]")
    partial: bool = spec(False, help="score the fraction of requirements met instead of all-or-nothing")


def tag_problems(tags: Any, key: str = "reward.tags") -> list[tuple[str, str, str]]:
    """What is wrong with a ``tags`` value, as (key, message, fix) triples."""
    if not isinstance(tags, list):
        return [(key, f"{tags!r} is not a list", "write it as a list of tag names, e.g. [answer]")]
    return [(f"{key}[{i}]", f"{t!r} is not a tag name", "use letters, digits, '_', '-', '.' (e.g. answer)")
            for i, t in enumerate(tags) if not isinstance(t, str) or not TAG_NAME.fullmatch(t)]


def block(tag: str) -> str:
    return rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>"


class FormatReward(Reward):
    """1.0 when every requirement holds (or, with ``partial``, the fraction that does).

    Requirements: with ``think``, the completion starts with one
    ``<think>...</think>`` block holding text; each tag of ``tags`` encloses
    text somewhere after it. Returns ``{"reward", "missing": [...], "reason"}``.
    """

    config_class = FormatConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.options: FormatConfig = self.context.options or FormatConfig()
        problems = tag_problems(self.options.tags)
        if problems:
            raise ValueError("; ".join(f"{key}: {message}; fix: {fix}" for key, message, fix in problems))

    def __call__(self, prompt: str, completion: str, item: Any) -> dict:
        o = self.options
        checks: list[tuple[str, bool]] = []
        rest = completion
        if o.think:
            m = re.match(r"\s*" + block(o.think_tag), completion, re.DOTALL)
            single = len(re.findall(f"<{re.escape(o.think_tag)}>", completion)) == 1
            checks.append((f"<{o.think_tag}> block first", bool(m and m.group(1).strip() and single)))
            rest = completion[m.end():] if m else completion
        for tag in o.tags:
            m = re.search(block(tag), rest, re.DOTALL)
            checks.append((f"<{tag}>", bool(m and m.group(1).strip())))
        if not checks:
            return {"reward": 1.0, "missing": [], "reason": "no requirement configured"}
        missing = [name for name, ok in checks if not ok]
        met = len(checks) - len(missing)
        reward = met / len(checks) if o.partial else float(not missing)
        return {"reward": reward, "missing": missing,
                "reason": "ok" if not missing else "missing " + ", ".join(missing)}
