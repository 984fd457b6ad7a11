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
            "top_logprobs": lambda: c.chat.completions.create(model="policy", messages=item["messages"], logprobs=True,
                                                              top_logprobs=3),
            "named unknown": lambda: c.chat.completions.create(
                model="policy", messages=item["messages"], tools=[CHAT_ADD],
                tool_choice={"type": "function", "function": {"name": "mul"}}),
            "required, no tools": lambda: c.chat.completions.create(model="policy", messages=item["messages"],
                                                                    tool_choice="required"),
            "built-in tool": lambda: c.responses.create(model="policy", input="hi", tools=[{"type": "web_search"}]),
            "unknown previous": lambda: c.responses.create(model="policy", input="hi", previous_response_id="resp_x"),
            "reasoning item": lambda: c.responses.create(model="policy", input=[{"type": "reasoning", "summary": []}]),
            "image part": lambda: c.responses.create(model="policy", input=[{"role": "user", "content": [
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


class RefusingEngineDouble(ScriptedInferenceEngine):
    """TEST DOUBLE: the scripted engine, refusing a prompt over 200 tokens as a real engine's server does (its
    client raises ValueError for the server's 400)."""

    async def agenerate(self, request):
        if len(request.input_ids) > 200:
            raise ValueError(f"the embedded server refused POST /generate: the prompt has {len(request.input_ids)} "
                             f"tokens; max_seq_len is 200")
        return await super().agenerate(request)


async def refused_plainly(item, base_url, api_key):
    """Each request an engine or the proxy cannot serve is a 4xx naming the field; the same client then still
    gets its answer (the connection and the episode survive)."""
    import httpx

    messages = item["messages"]
    asks = {
        "max_tokens -5": dict(path="/chat/completions", json={"model": "policy", "messages": messages,
                                                                "max_tokens": -5}),
        "max_tokens 0": dict(path="/chat/completions", json={"model": "policy", "messages": messages,
                                                               "max_tokens": 0}),
        "temperature 3": dict(path="/chat/completions", json={"model": "policy", "messages": messages,
                                                                "temperature": 3}),
        "json_object": dict(path="/chat/completions", json={"model": "policy", "messages": messages,
                                                              "response_format": {"type": "json_object"}}),
        "image_url": dict(path="/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
        "input_audio": dict(path="/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
        "unknown model": dict(path="/chat/completions", json={"model": "gpt-4o", "messages": messages}),
        "too long": dict(path="/chat/completions", json={"model": "policy", "messages": [
            {"role": "user", "content": "word " * 400}]}),
        "prompt []": dict(path="/completions", json={"model": "policy", "prompt": []}),
        "prompt out of vocab": dict(path="/completions", json={"model": "policy", "prompt": [10 ** 9]}),
        "responses max_output_tokens": dict(path="/responses", json={"model": "policy", "input": "hi",
                                                                     "max_output_tokens": -1}),
    }
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"},
                                 timeout=60) as h:
        for name, ask in asks.items():
            answer = await h.post(ask["path"], json=ask["json"])
            SEEN[name] = (answer.status_code, answer.json()["error"]["message"])
        after = await h.post("/chat/completions", json={"model": "policy", "messages": messages})
        SEEN["after"] = after.status_code
    return 0.0


def test_refusals_are_4xx_naming_the_field_and_the_connection_survives(make_flow, say):
    engine = RefusingEngineDouble([say("fine")])
    run(make_flow(agent="agent_responses_doubles:refused_plainly", max_calls=32), engine)
    expect = {
        "max_tokens -5": (400, "max_tokens is -5; it must be at least 1"),
        "max_tokens 0": (400, "max_tokens is 0; it must be at least 1"),
        "temperature 3": (400, "temperature is 3.0; it must be between 0 and 2"),
        "json_object": (400, "response_format 'json_object' is not served"),
        "image_url": (400, "messages[0].content[1] is an image; the model takes text only"),
        "input_audio": (400, "messages[0].content[0] is audio; the model takes text only"),
        "unknown model": (404, "the model 'gpt-4o' is not served here"),
        "too long": (400, "the inference engine refused the request"),
        "prompt []": (400, "prompt is empty"),
        "prompt out of vocab": (400, "prompt[0] is the token id 1000000000, outside the model's vocabulary"),
        "responses max_output_tokens": (400, "max_tokens is -1; it must be at least 1"),
    }
    for name, (status, says) in expect.items():
        assert SEEN[name][0] == status and says in SEEN[name][1], (name, SEEN[name])
    assert "max_seq_len is 200" in SEEN["too long"][1]
    assert SEEN["after"] == 200
    assert len(engine.requests) == 1  # only the last call was generated (the double refuses before recording)


async def instructions_each_call(item, base_url, api_key):
    """As the Agents SDK calls: the same instructions on every request, chained by previous_response_id; then
    other instructions on a third."""
    async with client(base_url, api_key) as c:
        first = await c.responses.create(model="policy", instructions="Be brief.", input="What is 12 plus 30?")
        second = await c.responses.create(model="policy", instructions="Be brief.", input="And 1 plus 1?",
                                          previous_response_id=first.id)
        await c.responses.create(model="policy", instructions="Answer in French.", input="And 2 plus 2?",
                                 previous_response_id=second.id)
    return 1.0


def test_resent_instructions_replace_the_earlier_ones_and_the_prefix_is_reused(make_flow, say, tokenizer):
    engine = ScriptedInferenceEngine([say("42."), say("2."), say("4.")])
    trajectories = run(make_flow(agent="agent_responses_doubles:instructions_each_call"), engine)
    first, second, third = (tokenizer.decode(r.input_ids) for r in engine.requests)
    assert second.count("Be brief.") == 1  # not stacked: the earlier instructions are not carried over
    head = list(engine.requests[0].input_ids) + engine.responses[0].output_ids
    assert list(engine.requests[1].input_ids[:len(head)]) == head  # the same system turn: the first call's ids reused
    assert third.count("Be brief.") == 0 and third.count("Answer in French.") == 1  # replaced
    assert "What is 12 plus 30?" in third and "And 1 plus 1?" in third  # the stored conversation carried on
    assert len(trajectories) == 2  # the first two calls one chain; new instructions start a branch


LOOKUP_NEW = {"type": "function", "name": "lookup_NEW", "description": "look a word up",
              "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}


async def tools_change(item, base_url, api_key):
    """A handoff: the second call of the chain offers another tool."""
    async with client(base_url, api_key) as c:
        first = await c.responses.create(model="policy", input="What is 12 plus 30?", tools=[ADD])
        await c.responses.create(model="policy", input="Now look up 'cat'.", tools=[ADD, LOOKUP_NEW],
                                 previous_response_id=first.id)
    return 1.0


def test_a_change_of_tools_is_rendered_into_the_next_prompt(make_flow, say, tokenizer):
    engine = ScriptedInferenceEngine([say("42."), say("A cat is an animal.")])
    trajectories = run(make_flow(agent="agent_responses_doubles:tools_change"), engine)
    first, second = (tokenizer.decode(r.input_ids) for r in engine.requests)
    assert "lookup_NEW" not in first and second.count("lookup_NEW") == 1  # the engine sees the new tool
    assert "What is 12 plus 30?" in second and "42." in second  # with the conversation so far
    assert len(trajectories) == 2  # re-rendered: a branch of its own
