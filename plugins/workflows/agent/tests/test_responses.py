"""The Responses API with function tools and streaming, and tool_choice on the chat path, through the unmodified
openai client: items in and out, previous_response_id, token reuse across a tool turn, the events a streaming
client reads, and the requests the proxy refuses (with the field named)."""

from __future__ import annotations

import asyncio
import json
import sys

import openai
import pytest

from areal_core.testing import ScriptedInferenceEngine

ITEM = {"id": "q/1", "messages": [{"role": "user", "content": "What is 12 plus 30?"}]}
ADD = {"type": "function", "name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}
CHAT_ADD = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'

sys.modules["agent_responses_doubles"] = sys.modules[__name__]  # agents named "agent_responses_doubles:<name>"
SEEN: dict = {}


def client(base_url, api_key):
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)


def run(flow, engine, item=ITEM):
    return asyncio.run(flow.arun_episode(engine, item))


async def tool_loop(item, base_url, api_key):
    """Responses with a function tool: the call, its output sent back, the answer. ``item['chain']``: by
    previous_response_id, else the whole input each time (the stateless way)."""
    async with client(base_url, api_key) as c:
        first = await c.responses.create(model="policy", input=item["messages"][0]["content"], tools=[ADD],
                                         include=["message.output_text.logprobs"])
        calls = [o for o in first.output if o.type == "function_call"]
        outputs = [{"type": "function_call_output", "call_id": call.call_id,
                    "output": str(sum(json.loads(call.arguments).values()))} for call in calls]
        if item.get("chain"):
            second = await c.responses.create(model="policy", input=outputs, tools=[ADD],
                                              previous_response_id=first.id)
        else:
            history = [{"role": "user", "content": item["messages"][0]["content"]},
                       *[o.model_dump(exclude_none=True) for o in first.output], *outputs]
            second = await c.responses.create(model="policy", input=history, tools=[ADD])
        SEEN["first"], SEEN["second"] = first, second
    return float("42" in second.output_text)


@pytest.mark.parametrize("chain", [True, False], ids=["previous_response_id", "whole-input"])
def test_responses_tool_loop_reuses_the_engine_tokens(make_flow, say, tokenizer, chain):
    engine = ScriptedInferenceEngine([say(CALL), say("The answer is 42.")], version=3)
    (t,) = run(make_flow(agent="agent_responses_doubles:tool_loop"), engine, {**ITEM, "chain": chain})
    first, second = SEEN["first"], SEEN["second"]
    (call,) = first.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 12, "b": 30}
    assert first.status == "completed" and first.output_text == ""
    assert second.output_text == "The answer is 42." and t.reward == 1.0
    assert second.usage.output_tokens == len(engine.responses[1].output_ids)
    (r1, r2), (o1, o2) = engine.requests, engine.responses
    assert "<tools>" in tokenizer.decode(r1.input_ids) and '"name": "add"' in tokenizer.decode(r1.input_ids)
    # the second prompt continues the first prompt and the model's exact reply; only the tool turn is new
    assert r2.input_ids[:len(r1.input_ids) + len(o1.output_ids)] == r1.input_ids + o1.output_ids
    assert tokenizer.decode(r2.input_ids[len(r1.input_ids) + len(o1.output_ids):]) == \
        "\n<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert t.tokens == r2.input_ids + o2.output_ids
    assert [t.tokens[p] for p, m in enumerate(t.loss_mask) if m] == o1.output_ids + o2.output_ids
    assert t.info["calls"][1]["prefix"]["reused"]


async def stream_text_and_call(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        events = [e async for e in await c.responses.create(model="policy", input="Hi", stream=True,
                                                             include=["message.output_text.logprobs"])]
        SEEN["text_events"] = events
        async with c.responses.stream(model="policy", input="Add 12 and 30", tools=[ADD]) as stream:
            SEEN["call_events"] = [e async for e in stream]
            SEEN["call_final"] = await stream.get_final_response()
    return 1.0


def test_responses_stream_through_the_openai_client(make_flow, say):
    engine = ScriptedInferenceEngine([say("Hello there"), say(CALL)])
    run(make_flow(agent="agent_responses_doubles:stream_text_and_call"), engine)
    events = SEEN["text_events"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    done = events[-1].response
    assert done.output_text == "Hello there" and done.usage.output_tokens == len(engine.responses[0].output_ids)
    logprobs = events[5].logprobs
    assert [x.logprob for x in logprobs] == pytest.approx(engine.responses[0].output_logprobs)
    kinds = [e.type for e in SEEN["call_events"]]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (call,) = SEEN["call_final"].output
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 12, "b": 30}


async def forced_tools(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        SEEN["required"] = await c.chat.completions.create(model="policy", messages=item["messages"],
                                                           tools=[CHAT_ADD], tool_choice="required")
        SEEN["named"] = await c.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Add 1 and 2"}], tools=[CHAT_ADD],
            tool_choice={"type": "function", "function": {"name": "add"}})
        SEEN["garbled"] = await c.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Add"}], tools=[CHAT_ADD], tool_choice="required")
    return 1.0


def test_tool_choice_required_or_named_begins_the_call_and_does_not_train_the_opening(make_flow, say, tokenizer):
    engine = ScriptedInferenceEngine([say('add", "arguments": {"a": 12, "b": 30}}</tool_call>'),
                                      say('{"a": 1, "b": 2}}</tool_call>'), say("I will not")])
    group = run(make_flow(agent="agent_responses_doubles:forced_tools"), engine)
    required, named, garbled = (SEEN[k].choices[0] for k in ("required", "named", "garbled"))
    assert required.finish_reason == "tool_calls" and required.message.tool_calls[0].function.name == "add"
    assert json.loads(required.message.tool_calls[0].function.arguments) == {"a": 12, "b": 30}
    assert json.loads(named.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    # an opening the model did not complete into a call comes back as content, the opening included
    assert garbled.message.tool_calls is None and garbled.message.content == '<tool_call>\n{"name": "I will not'
    r1, r2, _ = engine.requests
    assert tokenizer.decode(r1.input_ids).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')
    assert tokenizer.decode(r2.input_ids).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "add", '
                                                   '"arguments": ')
    for t, request, response in zip(group, engine.requests, engine.responses):  # the opening is prompt
        assert t.tokens == request.input_ids + response.output_ids
        assert t.loss_mask == [0] * len(request.input_ids) + [1] * len(response.output_ids)


async def refused(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        asks = {
            "top_logprobs": lambda: c.chat.completions.create(model="p", messages=item["messages"], logprobs=True,
                                                              top_logprobs=3),
            "named unknown": lambda: c.chat.completions.create(
                model="p", messages=item["messages"], tools=[CHAT_ADD],
                tool_choice={"type": "function", "function": {"name": "mul"}}),
            "required, no tools": lambda: c.chat.completions.create(model="p", messages=item["messages"],
                                                                    tool_choice="required"),
            "built-in tool": lambda: c.responses.create(model="p", input="hi", tools=[{"type": "web_search"}]),
            "unknown previous": lambda: c.responses.create(model="p", input="hi", previous_response_id="resp_x"),
            "reasoning item": lambda: c.responses.create(model="p", input=[{"type": "reasoning", "summary": []}]),
            "image part": lambda: c.responses.create(model="p", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://x"}]}]),
        }
        for name, ask in asks.items():
            try:
                await ask()
            except openai.BadRequestError as exc:
                SEEN[name] = exc.body["message"] if isinstance(exc.body, dict) else str(exc)
            else:
                SEEN[name] = None
    return 0.0


def test_what_the_proxy_cannot_serve_is_refused_naming_the_field(make_flow, say):
    engine = ScriptedInferenceEngine([say("never")])
    run(make_flow(agent="agent_responses_doubles:refused", max_calls=16), engine)
    assert "top_logprobs is 3" in SEEN["top_logprobs"] and "sampled token's logprob only" in SEEN["top_logprobs"]
    assert "'mul', which is not among the request's tools (add)" in SEEN["named unknown"]
    assert "tool_choice is 'required' but the request sends no tools" in SEEN["required, no tools"]
    assert "tools[0] is of type 'web_search'" in SEEN["built-in tool"]
    assert "previous_response_id 'resp_x' is not a response of this session" in SEEN["unknown previous"]
    assert "input[0] is an item of type 'reasoning'" in SEEN["reasoning item"]
    assert "content part of type 'input_image' is not served" in SEEN["image part"]
    assert engine.requests == []  # nothing reached the engine
