"""One shape for everything a user did wrong: a code, the key, the message and the fix.

Config loading, allocation parsing and every ``areal_validate_*`` hook report
:class:`Problem` objects so that ``areal check`` can print all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """A single thing wrong with a run, found before anything starts.

    ``code`` is prefixed by whoever found it (``core.unknown-key``,
    ``fsdp.no-pipeline``); ``key`` is the dotted config path concerned, when
    there is one; ``hint`` says how to fix it.
    """

    code: str
    message: str
    hint: str = ""
    key: str = ""

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key else ""
        text = f"[{self.code}] {where}{self.message}"
        if self.hint:
            text += f"\n    fix: {self.hint}"
        return text


class ProblemsError(Exception):
    """Raised when a run cannot start; carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem], source: str = "the run") -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(format_problems(self.problems, source))


def format_problems(problems: list[Problem], source: str = "the run") -> str:
    n = len(problems)
    head = f"{n} problem{'s' if n != 1 else ''} in {source}:"
    body = "\n".join(
        f"  {i}. " + str(p).replace("\n", "\n     ") for i, p in enumerate(problems, 1)
    )
    return f"{head}\n{body}"
