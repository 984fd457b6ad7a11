"""The proxy through the unmodified openai client (and httpx for raw streaming): chat, tools, streaming, n > 1,
logprobs, completions, responses, keys, isolated sessions, and the drift test (trained tokens = engine tokens)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import openai
import pytest

from areal_core.testing import ScriptedInferenceEngine

ITEM = {"id": "q/1", "messages": [{"role": "user", "content": "What is 12 plus 30?"}], "answer": "42"}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]

# Agents named in config as "agent_test_doubles:<name>" (this module, registered under that name).
sys.modules["agent_test_doubles"] = sys.modules[__name__]
SEEN: dict = {}  # what the agent doubles observed, for the assertions


def client(base_url, api_key, **kw):
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30, **kw)


def run(flow, engine, item=ITEM):
    return asyncio.run(flow.arun_episode(engine, item))


async def chat_once(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        SEEN["chat"] = await c.chat.completions.create(model="policy", messages=item["messages"])
        SEEN["models"] = await c.models.list()
    return 1.0


@pytest.mark.parametrize("proxy_loop", ["episodes", "thread"])
def test_chat_with_the_openai_client(make_flow, say, tokenizer, tiny_model_dir, proxy_loop):
    engine = ScriptedInferenceEngine([say("It is 42.")], version=5)
    flow = make_flow(agent="agent_test_doubles:chat_once", proxy_loop=proxy_loop)
    (t,) = run(flow, engine)
    assert flow.server.on_thread == (proxy_loop == "thread")
    if proxy_loop == "episodes":  # its loop has ended: the next loop's episodes get the proxy served there
        other = asyncio.new_event_loop()
        assert not flow.server.serving_on(other)
        other.close()
        (again,) = run(flow, ScriptedInferenceEngine([say("It is 42.")], version=6))
        assert again.versions[-1] == 6 and SEEN["chat"].choices[0].message.content == "It is 42."
    reply = SEEN["chat"]
    assert reply.choices[0].message.content == "It is 42." and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None
    request, response = engine.requests[0], engine.responses[0]
    prompt = tokenizer.apply_chat_template(ITEM["messages"], tokenize=False, add_generation_prompt=True)
    assert request.input_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(request.input_ids)
    assert reply.usage.completion_tokens == len(response.output_ids)
    assert [m.id for m in SEEN["models"].data] == [str(tiny_model_dir)]
    assert t.tokens == request.input_ids + response.output_ids and t.reward == 1.0
    assert t.loss_mask == [0] * len(request.input_ids) + [1] * len(response.output_ids)
    assert t.versions[len(request.input_ids):] == [5] * len(response.output_ids)
    assert t.logprobs[len(request.input_ids):] == response.output_logprobs


async def stream_both_ways(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        stream = await c.chat.completions.create(model="policy", messages=item["messages"], stream=True,
                                                 stream_options={"include_usage": True})
        SEEN["chunks"] = [chunk async for chunk in stream]
    async with httpx.AsyncClient(timeout=30) as h:
        async with h.stream("POST", f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                            json={"model": "policy", "messages": item["messages"], "stream": True}) as r:
            SEEN["status"], SEEN["content_type"] = r.status_code, r.headers["content-type"]
            SEEN["lines"] = [line async for line in r.aiter_lines() if line]
    return 0.5


def test_streaming_through_the_openai_client_and_httpx(make_flow, say):
    engine = ScriptedInferenceEngine([say("It is 42.")])
    (t1, t2) = run(make_flow(agent="agent_test_doubles:stream_both_ways", trajectory="per_call"), engine)
    chunks = SEEN["chunks"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "It is 42."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(engine.responses[0].output_ids)
    assert SEEN["status"] == 200 and SEEN["content_type"].startswith("text/event-stream")
    assert SEEN["lines"][-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in SEEN["lines"][:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "It is 42."
    assert t1.reward == t2.reward == 0.5  # per_call, discount 1: each call gets the episode's reward


async def three_choices(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        SEEN["n"] = await c.chat.completions.create(model="policy", messages=item["messages"], n=3, logprobs=True)
    return 1.0


def test_n_choices_with_logprobs(make_flow, say):
    engine = ScriptedInferenceEngine([say("one"), say("two"), say("three")], version=2)
    group = run(make_flow(agent="agent_test_doubles:three_choices"), engine)
    reply = SEEN["n"]
    assert sorted(c.message.content for c in reply.choices) == ["one", "three", "two"]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for c, response in zip(reply.choices, engine.responses):
        assert [x.logprob for x in c.logprobs.content] == pytest.approx(response.output_logprobs)
    assert len(engine.requests) == 3 and len({tuple(r.input_ids) for r in engine.requests}) == 1
    assert len(group) == 3  # three leaves: nothing continued any choice
    assert sorted(tuple(t.tokens[t.loss_mask.index(1):]) for t in group) == \
        sorted(tuple(r.output_ids) for r in engine.responses)


async def calculator(item, base_url, api_key):
    """Uses the add tool, sends its result, then answers: two model calls, one tool turn between."""
    async with client(base_url, api_key) as c:
        messages = list(item["messages"])
        first = await c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        SEEN["first"] = first
        message = first.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
        second = await c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        SEEN["second"] = second
    return float("42" in (second.choices[0].message.content or ""))


def test_tool_calls_hermes_format_and_the_tool_turn_is_masked(make_flow, say, tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    engine = ScriptedInferenceEngine([say(call), say("The answer is 42.")], version=1)
    group = run(make_flow(agent="agent_test_doubles:calculator"), engine)
    (t,) = group
    first = SEEN["first"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.tool_calls[0].function.name == "add"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"a": 12, "b": 30}
    assert SEEN["second"].choices[0].message.content == "The answer is 42." and t.reward == 1.0
    # the second prompt is the first prompt + the model's exact ids + only the tool turn, tokenized
    (r1, r2), (o1, o2) = engine.requests, engine.responses
    assert r2.input_ids[:len(r1.input_ids) + len(o1.output_ids)] == r1.input_ids + o1.output_ids
    tool_turn = tokenizer.decode(r2.input_ids[len(r1.input_ids) + len(o1.output_ids):])
    assert tool_turn == "\n<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert "<tools>" in tokenizer.decode(r1.input_ids)  # tools reach the template
    assert t.tokens == r2.input_ids + o2.output_ids
    trained = [p for p, m in enumerate(t.loss_mask) if m]
    first_out = range(len(r1.input_ids), len(r1.input_ids) + len(o1.output_ids))
    assert trained == [*first_out, *range(len(r2.input_ids), len(t.tokens))]
    assert t.info["calls"][1]["prefix"]["reused"] and t.info["calls"][1]["tool_calls"] == []
    assert t.info["calls"][0]["tool_calls"] == ["add"]


async def tool_then_stop(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        SEEN["garbled"] = await c.chat.completions.create(model="policy", messages=item["messages"], tools=TOOLS)
    return 0.0


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 12,, "b"}</tool_call>',  # not JSON
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "add", "arguments": {"a": 1',  # cut off by max_tokens
    '{"name": "add", "parameters": [1, 2]}',  # Llama 3 shape, parameters not an object
    '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>',  # a function the request did not offer
    '{"name": "Bob", "parameters": {"age": 3}}',  # ordinary JSON content, not a call of `add`
    '{"name": "add", "parameters": {"a": 1}}',  # bare JSON lacking add's required b: not taken for a call
])
def test_a_garbled_tool_call_comes_back_as_content(make_flow, say, text):
    engine = ScriptedInferenceEngine([say(text)])
    (t,) = run(make_flow(agent="agent_test_doubles:tool_then_stop"), engine)
    choice = SEEN["garbled"].choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == text
    assert sum(t.loss_mask) == len(engine.responses[0].output_ids)


async def key_checks(item, base_url, api_key):
    statuses = {}
    async with httpx.AsyncClient(timeout=30) as h:
        body = {"model": "policy", "messages": item["messages"]}
        statuses["none"] = (await h.post(f"{base_url}/chat/completions", json=body)).status_code
        statuses["wrong"] = (await h.post(f"{base_url}/chat/completions", json=body,
                                          headers={"Authorization": "Bearer sk-areal-guess"})).status_code
        statuses["models_none"] = (await h.get(f"{base_url}/models")).status_code
        statuses["reward_none"] = (await h.post(base_url.removesuffix("/v1") + "/rl/set_reward",
                                                json={"reward": 1.0})).status_code
        statuses["empty"] = (await h.post(f"{base_url}/chat/completions", json={**body, "messages": []},
                                          headers={"Authorization": f"Bearer {api_key}"})).status_code
    async with client(base_url, "sk-areal-guess") as c:
        try:
            await c.chat.completions.create(model="policy", messages=item["messages"])
        except openai.AuthenticationError as exc:
            statuses["openai"] = exc.status_code
    async with client(base_url, api_key) as c:
        await c.chat.completions.create(model="policy", messages=item["messages"])
    SEEN["keys"], SEEN["old_key"], SEEN["base_url"] = statuses, api_key, base_url
    return 1.0


def test_a_missing_wrong_or_ended_key_gets_401(make_flow, say):
    flow = make_flow(agent="agent_test_doubles:key_checks")
    engine = ScriptedInferenceEngine([say("ok")])

    async def episode_then_its_old_key():  # the proxy serves on the episodes' loop: ask while it runs
        group = await flow.arun_episode(engine, ITEM)
        async with httpx.AsyncClient(timeout=30) as h:
            after = await h.post(f"{SEEN['base_url']}/chat/completions", json={"model": "policy", "messages":
                                 ITEM["messages"]}, headers={"Authorization": f"Bearer {SEEN['old_key']}"})
        return group, after

    group, after = asyncio.run(episode_then_its_old_key())
    assert group is not None
    assert SEEN["keys"] == {"none": 401, "wrong": 401, "models_none": 401, "reward_none": 401, "empty": 400,
                            "openai": 401}
    assert len(engine.requests) == 1  # only the authorised call reached the engine
    assert after.status_code == 401 and "invalid API key" in after.json()["error"]["message"]  # the episode ended


async def echo_my_item(item, base_url, api_key):
    """Three turns quoting the item's own word; the sessions of two items run at the same time."""
    async with client(base_url, api_key) as c:
        messages = list(item["messages"])
        for turn in range(3):
            reply = await c.chat.completions.create(model="policy", messages=messages)
            await asyncio.sleep(0.01 * (turn + 1))  # interleave with the other session
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"{item['word']} again {turn}"}]
    return float(item["reward"])


@pytest.mark.parametrize("proxy_loop", ["episodes", "thread"])
def test_two_concurrent_sessions_never_mix(make_flow, say, tokenizer, proxy_loop):
    flow = make_flow(agent="agent_test_doubles:echo_my_item", group_size=2, proxy_loop=proxy_loop)
    engine = ScriptedInferenceEngine([say("a"), say("b"), say("c")])
    items = [{"id": f"w/{w}", "word": w, "reward": r, "messages": [{"role": "user", "content": f"say {w}"}]}
             for w, r in (("apple", 1.0), ("melon", 0.0))]

    async def both():
        return await asyncio.gather(*(flow.arun_episode(engine, item) for item in items))

    groups = asyncio.run(both())
    assert len(engine.requests) == 12  # 2 items x 2 samples x 3 calls, interleaved
    for item, group, other in zip(items, groups, reversed(items)):
        assert len(group) == 2 and len({t.info["session"] for t in group}) == 2
        for t in group:
            text = tokenizer.decode(t.tokens)
            assert text.count(item["word"]) == 3 and other["word"] not in text
            assert t.reward == item["reward"] and t.info["num_calls"] == 3
            assert all(c["prefix"]["reused"] for c in t.info["calls"][1:])
    assert len({t.info["session"] for g in groups for t in g}) == 4
    assert len(flow.sessions) == 0  # every session closed with its episode


async def three_turns(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        messages = list(item["messages"])
        for turn in range(3):
            reply = await c.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"And then? ({turn})"}]
    SEEN["messages"] = messages[:-1]
    return 1.0


def test_drift_three_turns_train_exactly_the_engine_tokens(make_flow, tokenizer):
    """The engine samples a tokenization of its text that re-tokenizing would not give (one token per letter);
    the trained trajectory holds exactly the sampled ids, turn after turn."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def letters(text):
        return [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]] + [end]

    outputs = [letters("hello world"), letters("hello there"), letters("world hello")]
    assert all(o[:-1] != tokenizer(tokenizer.decode(o[:-1]), add_special_tokens=False)["input_ids"]
               for o in outputs)  # a re-tokenizing proxy would drift on each of them
    engine = ScriptedInferenceEngine(outputs, version=7)
    (t,) = run(make_flow(agent="agent_test_doubles:three_turns"), engine)
    requests, responses = engine.requests, engine.responses
    for before, after, response in zip(requests, requests[1:], responses):
        assert after.input_ids[:len(before.input_ids) + len(response.output_ids)] == \
            before.input_ids + response.output_ids
    assert t.tokens == requests[-1].input_ids + responses[-1].output_ids
    trained = [t.tokens[p] for p, m in enumerate(t.loss_mask) if m]
    assert trained == [i for r in responses for i in r.output_ids]  # token for token
    assert [t.logprobs[p] for p, m in enumerate(t.loss_mask) if m] == [x for r in responses for x in
                                                                      r.output_logprobs]
    assert {t.versions[p] for p, m in enumerate(t.loss_mask) if m} == {7}
    assert all(t.versions[p] == -1 and t.logprobs[p] == 0.0 for p, m in enumerate(t.loss_mask) if not m)
    # the template renders the same text here, yet re-tokenizing it gives other ids: the drift avoided
    text = tokenizer.decode(t.tokens)
    assert tokenizer.apply_chat_template(SEEN["messages"], tokenize=False) == text + "\n"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != t.tokens
    assert [c["prefix"]["reused"] for c in t.info["calls"]] == [False, True, True]


async def edits_history(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        first = await c.chat.completions.create(model="policy", messages=item["messages"])
        edited = [*item["messages"], {"role": "assistant", "content": first.choices[0].message.content + "!"},
                  {"role": "user", "content": "go on"}]
        await c.chat.completions.create(model="policy", messages=edited)
        await c.post("/rl/set_reward", body={"reward": 0.25}, cast_to=object)
    return None


def test_an_edited_history_is_tokenized_whole_and_says_why(make_flow, say):
    engine = ScriptedInferenceEngine([say("fine"), say("ok")])
    group = run(make_flow(agent="agent_test_doubles:edits_history"), engine)
    assert len(group) == 2  # two chains: the second call did not continue the first
    second = next(t for t in group if t.info["calls"][0]["prefix"]["reused"] is False and
                  t.info["calls"][0]["call_id"] != group[0].info["calls"][0]["call_id"])
    assert "do not extend" in second.info["calls"][0]["prefix"]["reason"]
    assert all(t.reward == 0.25 for t in group)  # from /rl/set_reward


async def completions_agent(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        first = await c.completions.create(model="policy", prompt="12+30=", max_tokens=8, logprobs=1)
        prompt = "12+30=" + first.choices[0].text + "\nCheck:"
        SEEN["completion"] = first
        SEEN["second"] = await c.completions.create(model="policy", prompt=prompt, max_tokens=8)
        SEEN["response"] = await c.responses.create(model="policy", input="Say hi")
        stream = await c.completions.create(model="policy", prompt="Hello", max_tokens=8, stream=True)
        SEEN["streamed"] = "".join([chunk.choices[0].text async for chunk in stream])
    return 1.0


def test_completions_reuse_tokens_and_responses_answer(make_flow, tokenizer):
    outputs = [[i for ch in "42" for i in tokenizer(ch, add_special_tokens=False)["input_ids"]],
               tokenizer(" ok", add_special_tokens=False)["input_ids"], tokenizer("hi", add_special_tokens=False)
               ["input_ids"]]
    engine = ScriptedInferenceEngine(outputs)
    group = run(make_flow(agent="agent_test_doubles:completions_agent"), engine)
    assert SEEN["completion"].choices[0].text == "42"
    assert SEEN["completion"].choices[0].logprobs.token_logprobs == pytest.approx(engine.responses[0].output_logprobs)
    r1, r2 = engine.requests[:2]
    assert r2.input_ids[:len(r1.input_ids) + 2] == r1.input_ids + outputs[0]
    assert SEEN["response"].output_text == "hi"
    assert SEEN["streamed"] == tokenizer.decode(engine.responses[3].output_ids)
    # the completions chain, the response call, the streamed completion
    assert len(group) == 3 and group[0].info["num_calls"] == 2


async def slow_tokens(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        await c.chat.completions.create(model="policy", messages=item["messages"], max_tokens=2, stop=["!"])
    return 1.0


def test_max_tokens_and_stop_reach_the_engine_capped_by_the_run(make_flow, say):
    engine = ScriptedInferenceEngine([say("a b c d")])
    (t,) = run(make_flow(agent="agent_test_doubles:slow_tokens", max_new_tokens=16), engine)
    sampling = engine.requests[0].sampling
    assert sampling.max_new_tokens == 2 and "!" in sampling.stop and t.info["calls"][0]["stop_reason"] == "length"


def test_template_drift_on_a_tool_call_is_reported_and_the_model_tokens_kept(make_flow, say, tokenizer):
    """The model writes its tool call compactly, keys in its own order; the template would re-serialise it. The
    second call keeps the model's ids and its info shows where the template would have differed."""
    call = '<tool_call>{"arguments":{"b":30,"a":12},"name":"add"}</tool_call>'
    engine = ScriptedInferenceEngine([say(call), say("The answer is 42.")])
    (t,) = run(make_flow(agent="agent_test_doubles:calculator"), engine)
    (r1, r2), o1 = engine.requests, engine.responses[0]
    assert r2.input_ids[:len(r1.input_ids) + len(o1.output_ids)] == r1.input_ids + o1.output_ids
    drift = t.info["calls"][1]["template_drift"]
    assert call[:20] in drift["kept"] and '{"name": "add", "arguments": {"b": 30' in drift["template"]
    assert "template_drift" not in t.info["calls"][0] and t.reward == 1.0


def test_llama3_tool_calls_through_the_proxy(make_flow, say):
    engine = ScriptedInferenceEngine([say('<|python_tag|>{"name": "add", "parameters": {"a": 12, "b": 30}}'),
                                      say("42")])
    (t,) = run(make_flow(agent="agent_test_doubles:calculator", tool_parser="llama3"), engine)
    first = SEEN["first"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls[0].function.name == "add"
    assert t.reward == 1.0 and t.info["num_calls"] == 2


async def rewards_per_call(item, base_url, api_key):
    async with client(base_url, api_key) as c:
        messages = list(item["messages"])
        for turn in range(3):
            reply = await c.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
            if turn == 0:
                await c.post("/rl/set_reward", body={"reward": 0.5, "call_id": reply.id}, cast_to=object)
        try:
            await c.post("/rl/set_reward", body={"reward": 1.0, "call_id": "chatcmpl-unknown"}, cast_to=object)
        except openai.NotFoundError:
            SEEN["unknown_call"] = 404
    return 2.0


@pytest.mark.parametrize("mode, expected", [("per_call", [0.5 + 2.0 * 0.25, 2.0 * 0.5, 2.0]),
                                            ("concat", [2.0 * 0.25 + 0.5])])
def test_per_call_rewards_and_per_turn_discount(make_flow, say, mode, expected):
    engine = ScriptedInferenceEngine([say("a"), say("b"), say("c")])
    group = run(make_flow(agent="agent_test_doubles:rewards_per_call", trajectory=mode, discount=0.5), engine)
    assert [t.reward for t in group] == pytest.approx(expected) and SEEN["unknown_call"] == 404


def test_responses_go_out_without_waiting_for_delayed_acks(make_flow):
    """Each response leaves at once (TCP_NODELAY): without it every call paid ~40 ms for the client's delayed ACK."""
    base = make_flow(agent_command=["true"]).base_url.removesuffix("/v1")
    times = []
    with httpx.Client(timeout=30) as h:
        for _ in range(15):
            began = time.perf_counter()
            assert h.get(f"{base}/health").status_code == 200
            times.append(time.perf_counter() - began)
    assert min(times) < 0.03, times  # with the delay, every call takes 40 ms or more, however idle the machine


async def forger(item, base_url, api_key):
    """An agent that claims full marks whatever the model said, by return value and by /rl/set_reward."""
    async with client(base_url, api_key) as c:
        await c.chat.completions.create(model="policy", messages=item["messages"])
        async with httpx.AsyncClient(timeout=30) as h:
            await h.post(base_url.removesuffix("/v1") + "/rl/set_reward", json={"reward": 1.0},
                         headers={"Authorization": f"Bearer {api_key}"})
    return 1.0


def says_42(prompt, completion, item):
    """The run's reward (a plain function, as `reward.name: function` gives): the item's answer in the reply."""
    return {"reward": float(item["answer"] in completion), "checked": completion[:20]}


@pytest.mark.parametrize("reply, expected", [("It is 41.", 0.0), ("It is 42.", 1.0)])
def test_with_reward_from_run_the_agent_cannot_forge_its_reward(make_flow, say, reply, expected):
    engine = ScriptedInferenceEngine([say(reply)])
    (t,) = run(make_flow(agent="agent_test_doubles:forger", reward=says_42, reward_from="run"), engine)
    assert t.reward == expected  # the run's reward on the reply, not the agent's claim
    assert t.info["agent_reward"] == 1.0 and t.info["reward_from"] == "run"  # the claim is logged
    assert t.info["reward_info"] == {"checked": reply}
    (t,) = run(make_flow(agent="agent_test_doubles:forger"), ScriptedInferenceEngine([say(reply)]))
    assert t.reward == 1.0  # the default trusts the agent, as before


def test_reward_from_run_needs_the_runs_reward_and_no_online_mode(make_flow):
    with pytest.raises(ValueError, match="workflow.reward_from is 'run' but the workflow was given no reward"):
        make_flow(agent="agent_test_doubles:forger", reward_from="run")
    from areal_agent.config import AgentConfig, config_problems

    problems = config_problems(AgentConfig(online=True, online_keys=["k" * 16], reward_from="run"))
    assert [p[0] for p in problems] == ["workflow.reward_from"]
