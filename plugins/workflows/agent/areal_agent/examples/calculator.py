"""A tool-using agent written with the official ``openai`` client: multi-step arithmetic with a calculator.

The agent offers one tool, ``calculator`` (an OpenAI ``tools`` schema: one
string argument, ``expression``), and runs the usual tool loop: the model is
called; while its reply holds tool calls each is evaluated and its result sent
back as a ``tool`` message; the first reply without tool calls is the final
answer. The loop stops after :data:`MAX_CALLS` model calls. The reward is the
final answer's correctness against ``item["answer"]`` (1.0 or 0.0); the
``run_shaped`` variant adds :data:`TOOL_CREDIT` for an episode whose first
call to the calculator was well formed (a name it knows, an expression it
can evaluate), so that a model that never answers right still gets a
gradient. Accuracy counts only the correctness part (``eval.success: 1.0``).

The prompt is written for a small model whose chat template knows nothing of
tools (SmolLM2): a system message that shows the Hermes call format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which the proxy
parses into ``tool_calls``) and one solved example, written as the text the
model should produce (a template without tool support would drop a
structured ``tool_calls`` example). The item's question is the dataset's own
user message (``dataset.name: arithmetic`` with ``style: chat``), else
``What is {item["expression"]}?``.

``calculate`` never calls ``eval``: ``ast.parse`` builds a tree and only
numbers, ``+ - * /``, unary minus and parentheses are evaluated (exactly, as
fractions); anything else is refused with a message the model sees as the
tool's result.
"""

from __future__ import annotations

import ast
import json
import math
import re
from fractions import Fraction
from typing import Any

import openai

MAX_CALLS = 4  # model calls per episode: enough for a call or two and the answer
TOOL_CREDIT = 0.2  # run_shaped: reward for a well-formed calculator call (below eval.success, so not "correct")
MAX_EXPRESSION = 200  # characters the calculator reads
MAX_NUMBER = 10 ** 12  # larger literals or intermediate results are refused

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}

SYSTEM = ("You are a math assistant with a calculator. Do not compute in your head: call the calculator, written as "
          "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"...\"}}</tool_call>. "
          "When it answers, reply with 'Answer: ' and the number.")
EXAMPLE = [
    {"role": "user", "content": "What is 14 * 3 - 5?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "14 * 3 - 5"}}'
                                     '</tool_call>'},
    {"role": "tool", "tool_call_id": "example", "content": "37"},
    {"role": "assistant", "content": "Answer: 37"},
]


class CalculatorError(ValueError):
    """The text is not an arithmetic expression the calculator accepts; the message says why."""


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def calculate(expression: str) -> Fraction:
    """The exact value of ``expression`` (numbers, + - * /, unary minus, parentheses); :class:`CalculatorError`
    for anything else (names, calls, powers, attributes, ...), for division by zero and for huge numbers."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("give an expression, e.g. 12 * (3 + 4)")
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"{expression!r} is not an arithmetic expression") from None
    try:
        return _value(tree.body)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise CalculatorError(f"{node.value} is not a number")
        value = Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        value = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _value(node.left), _value(node.right)
        if right == 0:
            raise CalculatorError("division by zero")
        value = left / right
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_value(node.left), _value(node.right))
    else:
        what = type(getattr(node, "op", node)).__name__
        raise CalculatorError(f"{what} is not allowed: only numbers, + - * / and parentheses")
    if abs(value) > MAX_NUMBER:
        raise CalculatorError(f"a number above {MAX_NUMBER:.0e}")
    return value


def show(value: Fraction) -> str:
    """A value as the calculator answers it: an integer, else a decimal (at most 6 places)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0")


def tool_result(name: str, arguments: str) -> tuple[str, bool]:
    """(the tool message's text, whether the call was well formed) for one tool call of the model."""
    if name != CALCULATOR["function"]["name"]:
        return f"error: there is no tool {name!r}; use calculator", False
    try:
        args = json.loads(arguments or "{}")
        expression = args.get("expression") if isinstance(args, dict) else None
        return show(calculate(expression)), True
    except (ValueError, CalculatorError) as exc:  # bad JSON too: json.JSONDecodeError is a ValueError
        return f"error: {exc}", False


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER = re.compile(r"answer\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def final_answer(text: str | None) -> Fraction | None:
    """The number a final reply answers: after its last ``Answer:``, else its last number; None if none."""
    text = (text or "").replace(",", "")
    marked = ANSWER.findall(text)
    numbers = marked or NUMBER.findall(text)
    return Fraction(numbers[-1]) if numbers else None


def messages_for(item: dict) -> list[dict]:
    """The system message, the solved example, then the item's question."""
    question = [m for m in item.get("messages") or [] if m.get("role") == "user"][-1:] or [
        {"role": "user", "content": f"What is {item['expression']}?"}]
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE, *question]


async def solve(item: dict, base_url: str, api_key: str) -> tuple[bool, bool]:
    """Run the tool loop once: (the final answer is right, the first calculator call was well formed)."""
    messages = messages_for(item)
    well_formed = None
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300) as client:
        for _ in range(MAX_CALLS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            if not message.tool_calls:
                answer = final_answer(message.content)
                return answer is not None and answer == Fraction(str(item["answer"])), bool(well_formed)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                text, ok = tool_result(call.function.name, call.function.arguments)
                well_formed = ok if well_formed is None else well_formed
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return False, bool(well_formed)  # still calling tools at the cap: no answer


async def run(item: dict, base_url: str, api_key: str) -> float:
    """The episode's reward: 1.0 for a right final answer, else 0.0."""
    right, _ = await solve(item, base_url, api_key)
    return float(right)


async def run_shaped(item: dict, base_url: str, api_key: str) -> float:
    """As :func:`run`, plus :data:`TOOL_CREDIT` when the first calculator call was well formed."""
    right, well_formed = await solve(item, base_url, api_key)
    return float(right) + TOOL_CREDIT * well_formed
