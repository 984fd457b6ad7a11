"""Agent episodes through the real rollout controller: weight updates interrupt agent calls mid-generation, the
staleness bound holds, a hung agent never holds up a batch, and every trained token is one the engine sampled."""

from __future__ import annotations

import asyncio
import sys
import time

import openai

from areal_core.api import GenerationResponse
from areal_core.rollout import RolloutController
from areal_core.testing import scaled, wait_until
from areal_core.testing.latency_engine import LatencyEngineDouble

sys.modules["agent_controller_doubles"] = sys.modules[__name__]


async def three_turn_agent(item, base_url, api_key):
    """Three model calls; item 1 hangs instead (a stuck tool: still running when the test ends)."""
    if item["hang"]:
        await asyncio.sleep(3600)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as client:
        messages = [{"role": "user", "content": f"task {item['id']}"}]
        for turn in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4 + turn)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"continue {turn}"}]
    return float(item["id"] % 2)


def test_agent_episodes_train_through_the_controller_under_the_staleness_bound(make_flow):
    flow = make_flow(agent="agent_controller_doubles:three_turn_agent", agent_timeout_s=20.0, max_new_tokens=8)
    engine = LatencyEngineDouble(seed=1, max_token_latency_s=0.03)
    ctrl = RolloutController([engine], flow, batch_size=2, max_head_offpolicyness=1).start()
    data = iter([{"id": i, "hang": i == 1} for i in range(40)])
    seen = set()
    try:
        for _ in range(4):
            batch = ctrl.prepare_batch(data, timeout=scaled(120))
            for group in batch:
                assert ctrl.version - group.start_version <= 1  # the staleness bound, for agent traffic too
                seen.add(group.item["id"])
                (t,) = group.trajectories
                trained = [p for p, m in enumerate(t.loss_mask) if m]
                assert len(trained) == 4 + 5 + 6 and t.info["num_calls"] == 3
                versions = [t.versions[p] for p in trained]
                assert versions == sorted(versions) and min(versions) >= group.start_version
                assert all(t.versions[p] == -1 for p, m in enumerate(t.loss_mask) if not m)
                assert t.reward == float(group.item["id"] % 2)
            ctrl.update_weights_from_disk(f"/ckpt/v{ctrl.version + 1}", ctrl.version + 1)
    finally:
        ctrl.close()
    assert 1 not in seen and len(seen) == 8  # the hung agent's episode never held a batch up: they filled around it
    assert len(engine.updates) == 4


class SteadyEngineDouble(LatencyEngineDouble):
    """Test double: one token every 50 ms (id 100 + position), so a test knows what has been sampled when. With
    ``hold_after`` = n, the first call that has sampled n tokens (and has more to sample) waits there until the
    engine is paused (at most ``scaled(30)`` s): a pause that comes then lands in the middle of that call."""

    def __init__(self, hold_after: int | None = None):
        super().__init__()
        self.emitted = 0
        self.hold_after = hold_after

    async def _held(self, sampled: int, wanted: int) -> None:
        if self.hold_after is None or sampled != self.hold_after or sampled >= wanted:
            return
        self.hold_after = None  # the first such call only
        deadline = time.monotonic() + scaled(30)
        while not self._paused and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def agenerate(self, request):
        out = []
        self._active += 1
        try:
            while len(out) < request.sampling.max_new_tokens:
                await self._held(len(out), request.sampling.max_new_tokens)
                await asyncio.sleep(0.05)
                if self._paused:
                    self.aborts += 1
                    return GenerationResponse(request.rid, request.input_ids, out, [-0.5 - self._version] * len(out),
                                              [self._version] * len(out), "abort")
                out.append(100 + len(request.input_ids) + len(out))
                self.emitted += 1
            return GenerationResponse(request.rid, request.input_ids, out, [-0.5 - self._version] * len(out),
                                      [self._version] * len(out), "length")
        finally:
            self._active -= 1


def test_a_weight_update_mid_call_continues_the_agent_call_under_the_new_version(make_flow):
    """The update lands while the agent's first call is generating: the call returns one reply whose tokens
    carry both versions, and the trajectory keeps each token's version and behaviour logprob."""
    flow = make_flow(agent="agent_controller_doubles:three_turn_agent", agent_timeout_s=scaled(30.0))
    engine = SteadyEngineDouble(hold_after=2)  # the first call waits after two of its four tokens for the pause
    ctrl = RolloutController([engine], flow, batch_size=1, max_head_offpolicyness=1).start()
    try:
        ctrl.submit({"id": 7, "hang": False})
        wait_until(lambda: engine.emitted >= 2, 30, "the agent's first call to sample two tokens", 0.002)
        ctrl.update_weights_from_disk("/ckpt/v1", 1)
        (group,) = ctrl.wait(1, timeout=scaled(60))
    finally:
        ctrl.close()
    (t,) = group.trajectories
    first_call = [t.versions[p] for p, m in enumerate(t.loss_mask) if m][:4]
    assert engine.aborts == 1 and first_call[:2] == [0, 0] and first_call[-1] == 1, first_call
    assert [t.logprobs[p] for p, m in enumerate(t.loss_mask) if m][:4] == [-0.5 - v for v in first_call]
