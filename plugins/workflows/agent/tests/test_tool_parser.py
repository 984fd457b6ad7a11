"""Tool calls only for offered tools (issue 42, part 3): property tests over the Hermes and Llama 3 formats."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_agent.tools import offered_functions, parse_tool_calls

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
ARGS = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True),
                       st.one_of(st.integers(-1000, 1000), st.text(max_size=8), st.booleans()), max_size=4)


def tools(names, required=None):
    return [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {}, "required": list(required.get(n, [])) if required else []}}}
        for n in names]


def hermes(name, args):
    return f'Let me check.\n<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def llama3(name, args, tag):
    return ("<|python_tag|>" if tag else "") + json.dumps({"name": name, "parameters": args})


@settings(max_examples=200, deadline=None)
@given(offered=st.sets(NAMES, max_size=4), name=NAMES, args=ARGS, style=st.sampled_from(["hermes", "llama3", "tag"]))
def test_a_call_is_returned_only_for_an_offered_function_and_otherwise_the_reply_is_content(offered, name, args,
                                                                                              style):
    text = hermes(name, args) if style == "hermes" else llama3(name, args, style == "tag")
    parser = "hermes" if style == "hermes" else "auto"
    parsed = parse_tool_calls(text, parser, offered_functions(tools(offered)))
    assert all(c["function"]["name"] in offered for c in parsed.tool_calls)
    if name in offered:
        (call,) = parsed.tool_calls
        assert call["function"]["name"] == name and json.loads(call["function"]["arguments"]) == args
    else:
        assert parsed.tool_calls == [] and parsed.content == text
        assert any(f"calls {name!r}, which is not among the request's tools" in e for e in parsed.errors)


@settings(max_examples=200, deadline=None)
@given(args=ARGS, required=st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), max_size=3, unique=True),
       tag=st.booleans())
def test_bare_json_is_a_call_only_when_it_fits_the_schema_a_tagged_call_by_its_name(args, required, tag):
    offered = offered_functions(tools(["lookup"], {"lookup": required}))
    parsed = parse_tool_calls(llama3("lookup", args, tag), "auto", offered)
    fits = all(key in args for key in required)
    assert bool(parsed.tool_calls) == (fits or tag)  # <|python_tag|> marks a call the model meant


def test_the_reported_cases():
    offered = offered_functions(tools(["lookup"], {"lookup": ["query"]}))
    bob = '{"name": "Bob", "parameters": {"age": 3}}'
    assert parse_tool_calls(bob, "auto", offered).content == bob  # an answer that is JSON stays an answer
    rm = '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    parsed = parse_tool_calls(rm, "auto", offered)
    assert parsed.tool_calls == [] and parsed.content == rm and "'rm_rf'" in parsed.errors[0]
    assert parse_tool_calls(rm, "auto").tool_calls  # without the request's tools (no filter): as before
