"""Find the final answer in a completion: ``\\boxed{}``, ``####``, "the answer is", the last number not rejected.

Pure string work, no library: math-verify extracts too, but it does not say
which rule matched, and the GSM8K ``####`` marker is not one of its rules.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Extracted(NamedTuple):
    answer: str
    method: str  # boxed | gsm8k | answer_is | last_number | ambiguous (the last number is one of alternatives)


BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
GSM8K = re.compile(r"####\s*([^\n]+)")
ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
# -1,234.5 | 3/4 | .5 ; a thousands separator needs exactly three digits after it
NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?(?![\w])")
# "18 dollars", "$18 per day", "3/4 of a cup": a number, then words only (no digits, no math)
NUMBER_THEN_WORDS = re.compile(r"(\$?-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?)\s+([A-Za-z][A-Za-z' -]*)")
MATH_WORDS = {"pi", "i", "e", "sqrt", "x", "y", "z", "n", "k"}  # a symbol, not a unit: leave the answer whole
# What the prose says against the number that follows: "7, not 8", "rather than 8", "instead of 8", "isn't 8"
REJECTED = re.compile(r"(?:\bnot|n't|\brather than|\binstead of|\bnever)\s+(?:(?:equal|equals|be|is|to)\s+)*$",
                      re.IGNORECASE)
# A stated answer's rejected tail: "7, not 8" -> "7"
REJECTED_TAIL = re.compile(r",?\s*(?:but\s+)?(?:not|rather than|instead of)\b.*$", re.IGNORECASE)
# "7 or 8": the number after it is an alternative to one before it
ALTERNATIVE = re.compile(r"\bor\s+$", re.IGNORECASE)
SENTENCE_END = re.compile(r"[.!?\n]\s")


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


def _stated(answer: str) -> str:
    """A stated answer without its frame, a rejected alternative (", not 8") or a unit."""
    tidy = _tidy(answer)
    kept = REJECTED_TAIL.sub("", tidy).strip() or tidy
    return _drop_unit(_tidy(kept))


def _last_number(text: str) -> Extracted | None:
    """The last number the prose does not reject ("7, not 8" -> 7); ``ambiguous`` when it is an alternative to
    another number of its sentence ("7 or 8")."""
    numbers = [m for m in NUMBER.finditer(text) if any(c.isdigit() for c in m.group(0))]
    kept = [m for m in numbers if not REJECTED.search(text[max(0, m.start() - 40):m.start()])]
    if not kept:
        return None
    last = kept[-1]
    sentence_start = max((e.end() for e in SENTENCE_END.finditer(text, 0, last.start())), default=0)
    if ALTERNATIVE.search(text[max(0, last.start() - 10):last.start()]) and any(
            m.start() >= sentence_start for m in kept[:-1]):
        return Extracted(last.group(0), "ambiguous")
    return Extracted(last.group(0), "last_number")


def nesting_depth(text: str) -> int:
    """The deepest nesting of (), [] and {} in ``text`` (LaTeX's ``\\{`` counted too)."""
    depth = deepest = 0
    for c in text:
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
    return deepest


def extract_answer(text: str) -> Extracted | None:
    """The completion's final answer and the rule that found it, or None. In order: the last ``\\boxed{}``,
    the last ``#### ...`` line, the last "the answer is ..." / "final answer: ...", the last number the prose
    does not reject."""
    boxed = last_boxed(text)
    if boxed:
        return Extracted(boxed, "boxed")
    hits = GSM8K.findall(text)
    if hits and _tidy(hits[-1]):
        return Extracted(_stated(hits[-1]), "gsm8k")
    hits = ANSWER_IS.findall(text)
    if hits and _tidy(hits[-1]):
        return Extracted(_stated(hits[-1]), "answer_is")
    return _last_number(text)
