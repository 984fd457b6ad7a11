"""The multi_turn workflow: the loss mask covers exactly the model's tokens, token-in / token-out
across turns, discounted rewards, pluggable environments, same seed => same requests."""

from __future__ import annotations

import asyncio
import functools
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from areal_core.api import Context
from areal_core.config.schema import RunConfig
from areal_core.testing import ScriptedInferenceEngine, WorkflowConformance, scaled
from areal_multi_turn.workflow import MultiTurnConfig, MultiTurnWorkflow

CHAT = {"id": "c/1", "messages": [{"role": "user", "content": "What is 6 plus 19?"}], "answer": "25"}
RAW = {"id": "r/1", "prompt": "6+19=", "answer": "25", "stop": ["\n"]}
SCRIPT = [[5101, 5102, 5103], [5201, 5202], [5301, 5302, 5303, 5304]]


def by_output(outputs_right):
    """A reward scoring the k-th call as outputs_right[k]."""
    calls = []

    def reward(prompt, completion, item):
        calls.append(completion)
        return outputs_right[(len(calls) - 1) % len(outputs_right)]

    return reward


@functools.lru_cache(maxsize=None)
def tokenizer(path):
    from areal_core.models import load_tokenizer

    return load_tokenizer(path)


def make(model_dir, reward, group_size=1, seed=1, **options):
    config = RunConfig()
    config.model.path, config.model.dtype = str(model_dir), "float32"
    config.rollout.group_size, config.trainer.seed = group_size, seed
    return MultiTurnWorkflow.create(Context(config=config, options=MultiTurnConfig(**options),
                                            extras={"reward": reward}))


def engine_positions(trajectory, responses):
    """Where each engine output sits in the trajectory, found by walking it turn by turn."""
    positions, start = [], 0
    for response in responses:
        start = len(response.input_ids)
        positions += range(start, start + len(response.output_ids))
    return positions


def test_loss_mask_covers_exactly_the_model_tokens_and_turns_are_token_in_token_out(tiny_model_dir):
    tok = tokenizer(str(tiny_model_dir))
    engine = ScriptedInferenceEngine(SCRIPT, version=2)
    flow = make(tiny_model_dir, by_output([0.0, 0.0, 1.0]), max_turns=5, discount=0.5)
    (t,) = asyncio.run(flow.arun_episode(engine, CHAT))
    requests, responses = engine.requests, engine.responses
    assert len(requests) == 3  # right on the third turn: the episode ends there
    # each turn's prompt is exactly every token so far: prompt + model ids + reply ids
    for before, after, response in zip(requests, requests[1:], responses):
        reply = after.input_ids[len(before.input_ids) + len(response.output_ids):]
        assert after.input_ids[:len(before.input_ids)] == before.input_ids
        assert after.input_ids[len(before.input_ids):][:len(response.output_ids)] == response.output_ids
        assert tok.decode(reply) == "<|im_end|>\n<|im_start|>user\nThat is not right. Try again.<|im_end|>\n" \
                                    "<|im_start|>assistant\n"
    assert t.tokens == requests[-1].input_ids + responses[-1].output_ids
    model = engine_positions(t, responses)
    assert [p for p, m in enumerate(t.loss_mask) if m] == model
    assert [p for p, v in enumerate(t.versions) if v != -1] == model and {t.versions[p] for p in model} == {2}
    assert [t.logprobs[p] for p in model] == [lp for r in responses for lp in r.output_logprobs]
    assert all(t.logprobs[p] == 0.0 for p in range(len(t.tokens)) if p not in model)
    assert t.reward == pytest.approx(1.0 * 0.5 ** 2)
    assert t.info["num_turns"] == 3 and t.info["success"] and [x["reward"] for x in t.info["turns"]] == [0, 0, 1]


def test_max_turns_ends_an_unsuccessful_episode_with_the_last_reward(tiny_model_dir):
    engine = ScriptedInferenceEngine(SCRIPT)
    (t,) = asyncio.run(make(tiny_model_dir, by_output([0.0, 0.25]), max_turns=2, discount=0.9)
                       .arun_episode(engine, CHAT))
    assert len(engine.requests) == 2 and not t.info["success"]
    assert t.reward == pytest.approx(0.25 * 0.9)
    assert sum(t.loss_mask) == len(SCRIPT[0]) + len(SCRIPT[1])


def test_end_of_turn_token_from_the_model_is_not_repeated(tiny_model_dir):
    tok = tokenizer(str(tiny_model_dir))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedInferenceEngine([[5101, im_end], [5201, im_end]])
    asyncio.run(make(tiny_model_dir, by_output([0.0, 1.0])).arun_episode(engine, CHAT))
    second = engine.requests[1].input_ids
    reply = second[len(engine.requests[0].input_ids) + 2:]
    assert tok.decode(reply).startswith("\n<|im_start|>user\n")  # the model's own <|im_end|> closed its turn


def test_raw_prompt_replies_and_stop_strings(tiny_model_dir):
    tok = tokenizer(str(tiny_model_dir))
    engine = ScriptedInferenceEngine(SCRIPT)
    asyncio.run(make(tiny_model_dir, by_output([0.0, 1.0]), raw_reply_format=" no.{message}\n",
                     feedback=" Again:").arun_episode(engine, RAW))
    first, second = engine.requests
    assert first.input_ids == tok("6+19=", add_special_tokens=False)["input_ids"]
    assert second.input_ids[len(first.input_ids) + 3:] == tok(" no. Again:\n", add_special_tokens=False)["input_ids"]
    assert first.sampling.stop == ("\n",)


def test_same_seed_same_requests_and_different_seeds_per_turn_and_sample(tiny_model_dir):
    def seeds(run_seed):
        engine = ScriptedInferenceEngine(SCRIPT)
        asyncio.run(make(tiny_model_dir, by_output([0.0]), group_size=2, seed=run_seed, max_turns=3)
                    .arun_episode(engine, CHAT))
        return sorted(r.sampling.seed for r in engine.requests)

    assert seeds(4) == seeds(4) and seeds(4) != seeds(5) and len(set(seeds(4))) == 6


class SeededEngineDouble(ScriptedInferenceEngine):
    """Test double: samples its output from the request's seed alone, as a seeded real engine does."""

    async def agenerate(self, request):
        import random

        from areal_core.api import GenerationResponse

        rng = random.Random(request.sampling.seed)
        out = [rng.randrange(5100, 5400) for _ in range(rng.randint(1, 4))]
        self.requests.append(request)
        response = GenerationResponse(request.rid, list(request.input_ids), out,
                                      [-rng.random() for _ in out], [0] * len(out), "stop")
        self.responses.append(response)
        return response


def test_same_seed_same_trajectories(tiny_model_dir):
    def episode(run_seed):
        # reward by the model's last token: some turns succeed, some do not, all decided by the seeds
        reward = lambda prompt, completion, item: float(len(completion) % 3 == 0)  # noqa: E731
        flow = make(tiny_model_dir, reward, group_size=3, seed=run_seed, max_turns=3, discount=0.5)
        return asyncio.run(flow.arun_episode(SeededEngineDouble(), CHAT))

    def fields(group):
        return [(t.tokens, t.loss_mask, t.logprobs, t.versions, t.reward, t.info["num_turns"]) for t in group]

    first, again, other = episode(7), episode(7), episode(8)
    assert fields(first) == fields(again)
    assert fields(first) != fields(other)
    assert len({tuple(t.tokens) for t in first}) == 3  # the samples of a group differ


class Countdown:
    """A custom environment class: done after `turns` replies, with a tool-style message."""

    def __init__(self, item, reward, turns=2):
        self.left = turns

    def step(self, completion, turn):
        self.left -= 1
        return {"reward": float(turn), "done": self.left == 0, "message": f"{self.left} left", "role": "user"}


def echo_environment(item, completion, turn):
    """A custom environment function."""
    return {"reward": 0.5, "done": turn == 2, "message": "again"}


def test_environment_from_config_class_or_function(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "my_envs", sys.modules[__name__])  # this module, under an importable name
    engine = ScriptedInferenceEngine(SCRIPT)
    (t,) = asyncio.run(make(tiny_model_dir, None, environment="my_envs:Countdown", environment_options={"turns": 3},
                            max_turns=5).arun_episode(engine, CHAT))
    assert len(engine.requests) == 3 and t.reward == 3.0
    assert "2 left" in tokenizer(str(tiny_model_dir)).decode(engine.requests[1].input_ids)
    engine = ScriptedInferenceEngine(SCRIPT)
    (t,) = asyncio.run(make(tiny_model_dir, None, environment="my_envs:echo_environment", max_turns=5)
                       .arun_episode(engine, CHAT))
    assert len(engine.requests) == 2 and t.reward == 0.5


async def async_environment(item, completion, turn):
    """A custom environment function that awaits (a tool call, say)."""
    await asyncio.sleep(0)
    return {"reward": 0.25 * turn, "done": turn == 3, "message": f"tool says {turn}", "role": "user"}


class SlowTool:
    """A custom environment whose sync step blocks (a slow tool or verifier) until the event loop has run
    meanwhile: :attr:`loop_ran` is set by a task on the loop; :attr:`saw_the_loop` notes, per step, whether it
    was set within the step's wait (never, when the step blocks the loop itself)."""

    loop_ran = threading.Event()
    saw_the_loop: list[bool] = []

    def __init__(self, item, reward):
        pass

    def step(self, completion, turn):
        SlowTool.loop_ran.clear()
        SlowTool.saw_the_loop.append(SlowTool.loop_ran.wait(scaled(10)))
        return {"reward": 1.0, "done": turn == 2, "message": "still working"}


def test_async_environment_function_is_awaited(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "my_envs", sys.modules[__name__])
    engine = ScriptedInferenceEngine(SCRIPT)
    (t,) = asyncio.run(make(tiny_model_dir, None, environment="my_envs:async_environment", max_turns=5)
                       .arun_episode(engine, CHAT))
    assert len(engine.requests) == 3 and t.reward == 0.75 and t.info["success"]
    assert "tool says 2" in tokenizer(str(tiny_model_dir)).decode(engine.requests[2].input_ids)


def test_a_sync_environment_step_does_not_stall_the_event_loop(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "my_envs", sys.modules[__name__])
    flow = make(tiny_model_dir, None, environment="my_envs:SlowTool", max_turns=2)

    async def episode_beside_a_ticker():
        async def ticker():  # marks every turn of the loop while the episode runs
            while True:
                await asyncio.sleep(0.005)
                SlowTool.loop_ran.set()

        task = asyncio.create_task(ticker())
        (t,) = await flow.arun_episode(ScriptedInferenceEngine(SCRIPT), CHAT)
        task.cancel()
        return t

    SlowTool.saw_the_loop.clear()
    t = asyncio.run(episode_beside_a_ticker())
    assert t.reward == 1.0
    # each of the two steps waited for the loop to run: a step that blocked the loop waited in vain
    assert SlowTool.saw_the_loop == [True, True], (
        f"the loop did not run while the environment's step blocked ({SlowTool.saw_the_loop})")


def test_bad_environment_references_are_named(tiny_model_dir):
    with pytest.raises(ValueError, match="workflow.environment is 'nope'; write it as 'package.module:Name'"):
        make(tiny_model_dir, None, environment="nope")
    with pytest.raises(ValueError, match="module 'no_such_module_xyz' cannot be imported"):
        make(tiny_model_dir, None, environment="no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="context.extras\\['reward'\\] is missing"):
        make(tiny_model_dir, None)


class TestMultiTurnConformance(WorkflowConformance):
    component_name = "multi_turn"
    items = [CHAT, RAW]

    def make(self, cls):
        from areal_core.testing import tiny_model

        folder = Path(tempfile.gettempdir()) / "areal-multi-turn-conformance-model"
        if not (folder / "config.json").exists():
            tiny_model(folder, seed=0)
        config = RunConfig()
        config.model.path, config.rollout.group_size = str(folder), 2
        return cls.create(Context(config=config, options=MultiTurnConfig(max_turns=3),
                                  extras={"reward": by_output([0.0, 0.0, 1.0])}))
