"""The evaluation mode with the rlvr workflow: pass@k over validation items, greedy, run beside training.

The trainer hands the rollout controller a second rlvr workflow built with
``rollout.group_size = eval.samples`` and ``temperature = eval.temperature``
(``areal_core.trainer.Trainer._eval_setup``); here the same is done by hand
against an engine double whose validation requests are held until training
has taken its batches, so the test fails if evaluation blocked training.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

from areal_core.api import Context
from areal_core.config.schema import RunConfig
from areal_core.rollout import RolloutController
from areal_core.testing import ScriptedInferenceEngine, scaled, wait_until
from areal_core.trainer import eval_metrics
from areal_rlvr.workflow import RLVRConfig, RLVRWorkflow

HOLD_S = scaled(30.0)  # the longest a held validation request waits for the test to release it


class HeldValidationEngineDouble(ScriptedInferenceEngine):
    """Test double: a scripted engine that holds every request for a validation item until released."""

    def __init__(self, script) -> None:
        super().__init__(script)
        self.release = threading.Event()
        self.held = 0

    async def agenerate(self, request):
        if str(request.metadata.get("item_id", "")).startswith("val/"):
            self.held += 1
            waited = 0.0
            while not self.release.is_set():
                if waited > HOLD_S:
                    raise TimeoutError(f"held validation request {request.metadata} for {HOLD_S:.0f} s; "
                                       f"the test never released it")
                await asyncio.sleep(0.01)
                waited += 0.01
        return await super().agenerate(request)


def answer_is_first_token(prompt, completion, item):
    """1 when the completion starts with the item's answer."""
    return float(completion.strip().startswith(item["answer"]))


def test_pass_at_k_evaluation_runs_while_training_takes_batches(tiny_model_dir):
    from areal_core.models import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    right, wrong = (tok(text, add_special_tokens=False)["input_ids"] for text in ("7\n", "9\n"))
    # The engine replays wrong, wrong, right, ... : a group of 3 has one right answer somewhere.
    engine = HeldValidationEngineDouble([wrong, wrong, right])
    config = RunConfig()
    config.model.path, config.model.dtype = str(tiny_model_dir), "float32"
    config.rollout.group_size, config.rollout.sampling.temperature = 2, 1.0
    train_flow = RLVRWorkflow.create(Context(config=config, options=RLVRConfig(),
                                             extras={"reward": answer_is_first_token}))
    # What the trainer builds for eval.samples = 3, eval.temperature = 0 (greedy).
    eval_config = replace(config, rollout=replace(config.rollout, group_size=3, sampling=replace(
        config.rollout.sampling, temperature=0.0)))
    eval_flow = RLVRWorkflow.create(Context(config=eval_config, options=RLVRConfig(),
                                            extras={"reward": answer_is_first_token}))
    train_items = [{"id": f"train/{k}", "prompt": f"{k}+1=", "answer": "7"} for k in range(40)]
    validation = [{"id": f"val/{k}", "prompt": f"{k}+2=", "answer": "7"} for k in range(4)]

    with RolloutController([engine], train_flow, batch_size=2, max_head_offpolicyness=0) as ctrl:
        pending = ctrl.evaluate(eval_flow, validation)
        data = iter(train_items)
        batches = []
        for step in range(3):  # three trainer steps, each a batch then a new policy version
            batches.append(ctrl.prepare_batch(data, timeout=scaled(30)))
            engine.set_version(step + 1)
            ctrl.set_version(step + 1)
        # every validation sample waits, training went on
        wait_until(lambda: engine.held == 4 * 3, 30, "every validation sample to reach the engine")
        assert not pending.done()
        engine.release.set()
        results = pending.result(timeout=scaled(30))

    assert [len(b) for b in batches] == [2, 2, 2] and all(len(g.trajectories) == 2 for b in batches for g in b)
    assert all(len(group) == 3 for group in results)  # eval.samples per validation item
    evaluated = [r for r in engine.requests if str(r.metadata["item_id"]).startswith("val/")]
    trained = [r for r in engine.requests if str(r.metadata["item_id"]).startswith("train/")]
    assert {r.sampling.temperature for r in evaluated} == {0.0} and {r.sampling.temperature for r in trained} == {1.0}
    metrics = eval_metrics(results, validation, success=1.0, step=0, seconds=0.0)
    rewards = [[t.reward for t in group] for group in results]
    # pass@3: an item counts when one of its three samples is right
    assert metrics["eval/accuracy"] == sum(any(r == 1.0 for r in g) for g in rewards) / 4
    assert metrics["eval/reward_mean"] == sum(map(sum, rewards)) / 12
