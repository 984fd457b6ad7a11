"""Online mode: an agent deployed elsewhere opens a session with its client key, calls the model, ends the session
and sends its reward later; the next episode trains it. Sessions older than the engines' version are dropped."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from areal_core.testing import ScriptedInferenceEngine, scaled

KEY = "client-key-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "Say hello."}]


def auth(key):
    return {"Authorization": f"Bearer {key}"}


async def attached(flow, episode):
    limit = scaled(30)
    deadline = time.monotonic() + limit
    while flow.hub.engine is None:
        assert time.monotonic() < deadline and not episode.done(), \
            f"waited {limit:.0f} s for the episode to attach its engine"
        await asyncio.sleep(0.01)


async def open_session(base_url, key=KEY, item=None):
    async with httpx.AsyncClient(timeout=30) as h:
        return await h.post(base_url.removesuffix("/v1") + "/rl/sessions", headers=auth(key),
                            json={"item": item} if item else None)


def test_an_online_session_trains_when_its_late_reward_arrives(make_flow, say):
    flow = make_flow(online=True, online_keys=[KEY], online_wait_s=scaled(20))
    engine = ScriptedInferenceEngine([say("hello"), say("hello again")], version=3)
    base_url = flow.base_url

    async def main():
        assert (await open_session(base_url)).status_code == 503  # no episode yet: no engine to serve it
        episode = asyncio.create_task(flow.arun_episode(engine, {"id": "slot-1"}))
        await attached(flow, episode)
        assert (await open_session(base_url, key="not-a-client-key")).status_code == 401
        opened = (await open_session(base_url, item={"task": "greet"})).json()
        async with openai.AsyncOpenAI(base_url=base_url, api_key=opened["api_key"], max_retries=0) as client:
            messages = list(MESSAGES)
            for _ in range(2):
                reply = await client.chat.completions.create(model="policy", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Once more."}]
            await client.post("/rl/end_session", body={}, cast_to=object)
            # ended, but no reward yet: not a finished session, so the episode waits on (its reward below shows
            # that the episode trained this session, with the reward that came later)
            assert flow.hub.counts["finished"] == 0 and not episode.done()
            with pytest.raises(openai.AuthenticationError):  # an ended session generates no more
                await client.chat.completions.create(model="policy", messages=MESSAGES)
            await client.post("/rl/set_reward", body={"reward": 0.5}, cast_to=object)
        return await asyncio.wait_for(episode, scaled(10)), opened

    (t,), opened = asyncio.run(main())
    assert t.reward == 0.5 and t.info["online"] and t.info["session"] == opened["session_id"]
    assert t.info["client_item"] == {"task": "greet"} and t.info["num_calls"] == 2
    assert t.tokens == engine.requests[-1].input_ids + engine.responses[-1].output_ids
    assert [t.tokens[p] for p, m in enumerate(t.loss_mask) if m] == [i for r in engine.responses for i in r.output_ids]
    assert flow.hub.counts["trained"] == 1


def test_stale_or_unrewarded_online_sessions_are_dropped(make_flow, say, caplog):
    flow = make_flow(online=True, online_keys=[KEY], online_wait_s=0.3, online_reward_timeout_s=0.2)
    engine = ScriptedInferenceEngine([say("hi")], version=0)
    base_url = flow.base_url

    async def session(reward):
        opened = (await open_session(base_url)).json()
        async with openai.AsyncOpenAI(base_url=base_url, api_key=opened["api_key"], max_retries=0) as client:
            await client.chat.completions.create(model="policy", messages=MESSAGES)
            await client.post("/rl/end_session", body={"reward": reward} if reward is not None else {},
                              cast_to=object)

    async def main():
        first = asyncio.create_task(flow.arun_episode(engine, {"id": "slot-1"}))
        await attached(flow, first)
        assert await first is None  # nothing finished within online_wait_s: the item is rejected
        await session(1.0)  # sampled at version 0 ...
        await session(None)  # ... and one whose reward never comes
        engine.set_version(1)  # ... then the weights move on
        return await flow.arun_episode(engine, {"id": "slot-2"})

    assert asyncio.run(main()) is None
    assert flow.hub.counts["dropped_stale"] == 1 and flow.hub.counts["dropped_no_reward"] == 1
    assert "oldest token is version 0, the engines serve 1" in caplog.text
