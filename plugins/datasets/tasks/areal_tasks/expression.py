"""Safe evaluation of arithmetic the model writes: integers, + - * /, parentheses; nothing else.

Written here rather than taken from a library because what is accepted is the
task's rule (which numbers, each used how often, whether division must be
exact) and the accepted grammar must be this small: sympy's ``parse_expr``
calls ``eval``, and general evaluators such as simpleeval accept names, calls
and powers by default. ``ast.parse`` only builds a tree; nothing is executed,
and every node outside the whitelist is refused.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from fractions import Fraction

MAX_LENGTH = 300  # characters: longer text is not an answer to these tasks
MAX_DIGITS = 12  # per number: keeps every result small

OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class ExpressionError(ValueError):
    """The text is not an allowed arithmetic expression; the message says why."""


@dataclass
class Evaluated:
    value: Fraction
    numbers: list[int] = field(default_factory=list)  # every literal, in order of appearance
    inexact_division: bool = False  # some division left a remainder


def evaluate(text: str) -> Evaluated:
    """The exact value of ``text`` and the numbers it uses; :class:`ExpressionError` if not allowed."""
    text = text.strip()
    if not text:
        raise ExpressionError("empty expression")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.replace("×", "*").replace("÷", "/").replace("−", "-"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not an arithmetic expression ({type(exc).__name__})") from None
    out = Evaluated(Fraction(0))
    try:
        out.value = _walk(tree.body, out)
    except RecursionError:
        raise ExpressionError("expression nested too deeply") from None
    return out


def _walk(node: ast.AST, out: Evaluated) -> Fraction:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise ExpressionError(f"{node.value!r} is not a whole number")
        if len(str(node.value)) > MAX_DIGITS:
            raise ExpressionError(f"number with more than {MAX_DIGITS} digits")
        out.numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _walk(node.left, out), _walk(node.right, out)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ExpressionError("division by zero")
        quotient = left / right
        if quotient.denominator != 1 or left.denominator != 1 or right.denominator != 1:
            out.inexact_division = True
        return quotient
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ExpressionError(f"{what} is not allowed (only whole numbers, + - * / and parentheses)")
