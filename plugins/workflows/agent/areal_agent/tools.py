"""Model text -> OpenAI ``tool_calls``, for the Hermes / Qwen and Llama 3 formats.

Hermes / Qwen2.5 / Qwen3 write ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(one block per call, text around them is content). Llama 3.x writes the JSON
object ``{"name": ..., "parameters": {...}}`` as the whole message, optionally
after ``<|python_tag|>``, several separated by ``;``.

A block that does not parse (bad JSON, no name) is left in the content as the
model wrote it: parsing never raises, so a garbled tool call reaches the agent
as text instead of failing the request.

Given the request's tools (``offered``), a call is returned only for a function
offered: a reply naming another function (``rm_rf``) comes back whole as
content, with ``errors`` saying why. Bare JSON (Llama 3 without
``<|python_tag|>``) is also what an ordinary answer may look like
(``{"name": "Bob", "parameters": {"age": 3}}``), so it becomes a call only when
its arguments also hold every property the offered function's schema requires.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("auto", "hermes", "llama3", "none")
HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass
class Parsed:
    """What one model reply says: ``content`` (None when only tool calls), ``tool_calls`` in OpenAI's shape,
    and ``errors`` (one line per block that looked like a tool call but did not parse)."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _call(name: Any, arguments: Any) -> dict | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):  # some models already write the arguments as a JSON string
        try:
            json.loads(arguments)
        except ValueError:
            return None
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _from_object(obj: Any) -> dict | None:
    if not isinstance(obj, dict):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj.get("name"), arguments)


def parse_hermes(text: str) -> Parsed:
    calls, errors, kept, last = [], [], [], 0
    for match in HERMES_BLOCK.finditer(text):
        body = match.group(1).strip()
        try:
            call = _from_object(json.loads(body))
        except ValueError as exc:
            call, why = None, f"not JSON ({exc})"
        else:
            why = "no 'name' with 'arguments' (an object)"
        if call is None:
            errors.append(f"<tool_call> block at character {match.start()}: {why}")
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    if not calls:
        return Parsed(text, [], errors)
    content = "".join(kept).strip()
    return Parsed(content or None, calls, errors)


def parse_llama3(text: str) -> Parsed:
    body = text.strip()
    prefix = ""
    if PYTHON_TAG in body:
        prefix, _, body = body.partition(PYTHON_TAG)
        body = body.strip()
    if not body.startswith("{"):
        return Parsed(text)
    calls = []
    decoder = json.JSONDecoder()
    rest = body
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError as exc:
            return Parsed(text, [], [f"Llama 3 tool call: not JSON ({exc})"])
        call = _from_object(obj)
        if call is None:
            return Parsed(text, [], ["Llama 3 tool call: no 'name' with 'parameters' (an object)"])
        calls.append(call)
        rest = rest[end:].strip().lstrip(";").strip()
    return Parsed(prefix.strip() or None, calls)


def offered_functions(tools: list | None) -> dict[str, dict]:
    """The request's function tools: name -> its parameters schema ({} when it gives none)."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            out[function["name"]] = params if isinstance(params, dict) else {}
    return out


def _unoffered(call: dict, offered: dict[str, dict], schema: bool) -> str | None:
    """Why ``call`` is not a call of an offered function (its name; with ``schema``, also an argument its schema
    requires), or None."""
    name = call["function"]["name"]
    if name not in offered:
        return f"the reply calls {name!r}, which is not among the request's tools ({', '.join(offered) or 'none'})"
    arguments = json.loads(call["function"]["arguments"])
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} are not an object"
    missing = [key for key in offered[name].get("required") or [] if key not in arguments] if schema else []
    if missing:
        return f"the call of {name!r} lacks the required argument(s) {', '.join(map(str, missing))}"
    return None


def parse_tool_calls(text: str, parser: str = "auto", offered: dict[str, dict] | None = None) -> Parsed:
    """Split ``text`` into content and tool calls with ``parser`` (``auto`` tries Hermes, then Llama 3); with
    ``offered`` (:func:`offered_functions` of the request's tools), a reply with a call that is not one of them
    comes back whole as content."""
    if parser == "none":
        return Parsed(text)
    # a marked call (<tool_call>, <|python_tag|>) is a call the model meant: the name decides; bare JSON is also
    # what an ordinary answer may look like, so it must fit the offered function's schema too
    bare = False
    try:
        if parser == "hermes" or (parser == "auto" and "<tool_call>" in text):
            parsed = parse_hermes(text)
        elif parser in ("llama3", "auto"):
            parsed, bare = parse_llama3(text), PYTHON_TAG not in text
        else:
            raise ValueError(f"workflow.tool_parser is {parser!r}; choose one of {', '.join(PARSERS)}")
    except ValueError:
        raise
    except Exception as exc:  # never a server error: a parser bug leaves the text as content
        return Parsed(text, [], [f"{parser} parser failed: {type(exc).__name__}: {exc}"])
    if offered is not None and parsed.tool_calls:
        refused = [why for why in (_unoffered(c, offered, bare) for c in parsed.tool_calls) if why]
        if refused:
            return Parsed(text, [], [*parsed.errors, *refused])
    return parsed
