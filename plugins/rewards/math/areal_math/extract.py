"""Find the final answer in a completion: ``\\boxed{}``, ``####``, "the answer is", last number.

Pure string work, no library: math-verify extracts too, but it does not say
which rule matched, and the GSM8K ``####`` marker is not one of its rules.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Extracted(NamedTuple):
    answer: str
    method: str  # boxed | gsm8k | answer_is | last_number


BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
GSM8K = re.compile(r"####\s*([^\n]+)")
ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
# -1,234.5 | 3/4 | .5 ; a thousands separator needs exactly three digits after it
NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?(?![\w])")
# "18 dollars", "$18 per day", "3/4 of a cup": a number, then words only (no digits, no math)
NUMBER_THEN_WORDS = re.compile(r"(\$?-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?)\s+([A-Za-z][A-Za-z' -]*)")
MATH_WORDS = {"pi", "i", "e", "sqrt", "x", "y", "z", "n", "k"}  # a symbol, not a unit: leave the answer whole


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces), or None."""
    starts = [m.end() for m in BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _tidy(answer: str) -> str:
    """Drop what frames an answer in prose: surrounding $ or \\( \\), bold, a final period."""
    answer = re.sub(r"\.\s*$", "", answer.strip())
    answer = re.sub(r"^\*\*|\*\*$", "", answer).strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left) + len(right) - 1:
            answer = answer[len(left):len(answer) - len(right)].strip()
    return re.sub(r"\.\s*$", "", answer).strip()


def _drop_unit(answer: str) -> str:
    """``18 dollars`` -> ``18``: math-verify reads trailing words as symbols multiplying the number."""
    match = NUMBER_THEN_WORDS.fullmatch(answer)
    if match is None or not any(c.isdigit() for c in match.group(1)):
        return answer
    if any(word.lower() in MATH_WORDS for word in match.group(2).split()):
        return answer
    return match.group(1)


def extract_answer(text: str) -> Extracted | None:
    """The completion's final answer and the rule that found it, or None."""
    boxed = last_boxed(text)
    if boxed:
        return Extracted(boxed, "boxed")
    hits = GSM8K.findall(text)
    if hits and _tidy(hits[-1]):
        return Extracted(_drop_unit(_tidy(hits[-1])), "gsm8k")
    hits = ANSWER_IS.findall(text)
    if hits and _tidy(hits[-1]):
        return Extracted(_drop_unit(_tidy(hits[-1])), "answer_is")
    numbers = [m.group(0) for m in NUMBER.finditer(text) if any(c.isdigit() for c in m.group(0))]
    if numbers:
        return Extracted(numbers[-1], "last_number")
    return None
