"""The rlvr workflow: bookkeeping against the scripted engine, and same seed => same trajectory
with the real embedded engine on a tiny model."""

from __future__ import annotations

import asyncio
import functools

import pytest

from areal_core.api import Context, call_reward
from areal_core.config.schema import RunConfig
from areal_core.testing import ScriptedInferenceEngine, WorkflowConformance, requires_plugin
from areal_rlvr.workflow import RLVRConfig, RLVRWorkflow

FEW_SHOT = {"id": "a/1", "prompt": "3+4=7\n10+5=15\n8+9=17\n6+19=", "answer": "25", "stop": ["\n"],
            "style": "few_shot"}
CHAT = {"id": "c/1", "messages": [{"role": "user", "content": "What is 6 plus 19?"}], "answer": "25"}


def starts_with_answer(prompt, completion, item):
    """A plain reward function: 1 when the completion starts with the answer."""
    return {"reward": float(completion.strip().startswith(item["answer"])), "seen_prompt": prompt}


@functools.lru_cache(maxsize=None)
def tokenizer(path):
    from areal_core.models import load_tokenizer

    return load_tokenizer(path)


def make_config(model_dir, group_size=3, seed=1, **sampling):
    config = RunConfig()
    config.model.path, config.model.dtype = str(model_dir), "float32"
    config.rollout.group_size, config.trainer.seed = group_size, seed
    config.rollout.sampling.max_new_tokens = 6
    config.rollout.sampling.stop = ["###"]
    for key, value in sampling.items():
        setattr(config.rollout.sampling, key, value)
    return config


def workflow(model_dir, reward=starts_with_answer, options=None, **kw):
    return RLVRWorkflow.create(Context(config=make_config(model_dir, **kw), options=options or RLVRConfig(),
                                       extras={"reward": reward}))


def test_a_group_per_prompt_with_the_engine_tokens_and_the_reward(tiny_model_dir):
    tok = tokenizer(str(tiny_model_dir))
    script = [tok("25\n", add_special_tokens=False)["input_ids"], tok("7\n", add_special_tokens=False)["input_ids"]]
    engine = ScriptedInferenceEngine(script, version=4)
    group = asyncio.run(workflow(tiny_model_dir).arun_episode(engine, FEW_SHOT))
    assert len(group) == 3 and len(engine.requests) == 3
    prompt_ids = tok(FEW_SHOT["prompt"], add_special_tokens=False)["input_ids"]
    for k, (trajectory, request, response) in enumerate(zip(group, engine.requests, engine.responses)):
        assert request.input_ids == prompt_ids  # the raw prompt, as written, no special tokens
        assert request.sampling.stop == ("###", "\n") and request.sampling.max_new_tokens == 6
        assert trajectory.tokens == prompt_ids + response.output_ids
        assert trajectory.loss_mask == [0] * len(prompt_ids) + [1] * len(response.output_ids)
        assert trajectory.logprobs == [0.0] * len(prompt_ids) + response.output_logprobs
        assert trajectory.versions == [-1] * len(prompt_ids) + [4] * len(response.output_ids)
        assert trajectory.info["completion"] == tok.decode(response.output_ids, skip_special_tokens=True)
        assert trajectory.info["reward_info"] == {"seen_prompt": FEW_SHOT["prompt"]}
    assert [t.reward for t in group] == [1.0, 0.0, 1.0]
    seeds = [r.sampling.seed for r in engine.requests]
    assert len(set(seeds)) == 3 and None not in seeds


def test_chat_template_applied_once_and_seeds_follow_the_run_seed(tiny_model_dir):
    tok = tokenizer(str(tiny_model_dir))
    text = tok.apply_chat_template(CHAT["messages"], tokenize=False, add_generation_prompt=True)
    assert text.count("<|im_start|>") == 2  # the user turn and the assistant opener, once each
    runs = {}
    for seed in (1, 1, 2):
        engine = ScriptedInferenceEngine([[5101, 5102]])
        group = asyncio.run(workflow(tiny_model_dir, seed=seed).arun_episode(engine, CHAT))
        assert engine.requests[0].input_ids == tok(text, add_special_tokens=False)["input_ids"]
        assert group[0].info["prompt"] == text
        runs.setdefault(seed, []).append([r.sampling.seed for r in engine.requests])
    assert runs[1][0] == runs[1][1] and runs[1][0] != runs[2][0]
    engine = ScriptedInferenceEngine([[5101]])
    asyncio.run(workflow(tiny_model_dir, options=RLVRConfig(seed_samples=False)).arun_episode(engine, CHAT))
    assert {r.sampling.seed for r in engine.requests} == {None}


def test_missing_reward_or_prompt_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match=r"needs the run's reward in context.extras\['reward'\]"):
        RLVRWorkflow.create(Context(config=make_config(tiny_model_dir), options=RLVRConfig()))
    with pytest.raises(ValueError, match="item 'x' has neither 'prompt' nor 'messages'"):
        asyncio.run(workflow(tiny_model_dir).arun_episode(ScriptedInferenceEngine(), {"id": "x", "answer": "1"}))


class TestRLVRConformance(WorkflowConformance):
    component_name = "rlvr"
    items = [FEW_SHOT, CHAT]

    def make(self, cls):
        import tempfile
        from pathlib import Path

        from areal_core.testing import tiny_model

        folder = Path(tempfile.gettempdir()) / "areal-rlvr-conformance-model"
        if not (folder / "config.json").exists():
            tiny_model(folder, seed=0)
        return cls.create(Context(config=make_config(folder), options=RLVRConfig(),
                                  extras={"reward": starts_with_answer}))


# The real embedded engine is another plugin's: found by its entry point, as `areal run` finds it.
needs_local_engine = requires_plugin("areal.engines.inference", "local")


def local_engine_class():
    from areal_core.api import InferenceEngine
    from areal_core.registry import resolve

    return resolve("inference_engine", "local", InferenceEngine)


@pytest.fixture(scope="module")
def local_server(tiny_model_dir, tmp_path_factory):
    """The real embedded engine serving the tiny model, started with the launcher's own recipe."""
    from areal_core.processes import ProcessSpec, Supervisor, free_port

    local_engine = local_engine_class()
    root = tmp_path_factory.mktemp("rlvr-local")
    config = make_config(tiny_model_dir)
    config.output_dir, config.experiment, config.trial = str(root / "runs"), "e", "t"
    port = free_port()
    options = local_engine.config_class(max_batch=8)
    recipe = local_engine.server_process(Context(config=config, options=options), 0, port)
    supervisor = Supervisor(root / "logs", term_timeout_s=5)
    process = supervisor.start(ProcessSpec("rollout-0", recipe.argv, threads=1))
    try:
        supervisor.wait_ready(process, recipe.ready, 120, recipe.what)
        yield config, port
    finally:
        supervisor.stop_all()


@needs_local_engine
def test_same_seed_same_trajectory_with_the_real_local_engine(tiny_model_dir, local_server):
    config, port = local_server

    async def episode(seed):
        engine = local_engine_class().create(Context(config=config, extras={"address": f"127.0.0.1:{port}"}))
        await engine.start()
        try:
            flow = workflow(tiny_model_dir, seed=seed, group_size=4, max_new_tokens=8, temperature=1.0)
            return await flow.arun_episode(engine, CHAT)
        finally:
            await engine.aclose()

    first, again, other = (asyncio.run(episode(s)) for s in (11, 11, 12))
    assert [t.tokens for t in first] == [t.tokens for t in again]
    assert [lp for t in first for lp in t.logprobs] == pytest.approx([lp for t in again for lp in t.logprobs], abs=1e-5)
    assert [t.tokens for t in first] != [t.tokens for t in other]
    assert len({tuple(t.tokens) for t in first}) > 1  # the 4 samples of a group differ from each other
    for t in first:
        n_out = sum(t.loss_mask)
        assert n_out > 0 and t.versions[-n_out:] == [0] * n_out and all(lp <= 0 for lp in t.logprobs[-n_out:])
        assert t.info["completion"] == tokenizer(str(tiny_model_dir)).decode(t.tokens[-n_out:],
                                                                             skip_special_tokens=True)
