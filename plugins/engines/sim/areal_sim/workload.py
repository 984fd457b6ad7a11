"""A simulated workload: items, episodes and rewards shaped like a reasoning task, with no text anywhere.

``dataset.name: sim`` yields items whose prompt is ``lengths.prompt`` modelled
tokens (``prompt / token_scale`` token ids, at least one) and a success rate
drawn per item, so groups of samples disagree as real ones do and dynamic
filtering has something to drop. ``workflow.name: sim`` samples
``rollout.group_size`` responses per item through the engine it is handed (the
rollout controller's, with admission, interruption and versions), token in and
token out as the ``rlvr`` workflow does, and asks the run's reward for each;
``reward.name: sim`` scores a sample 1 with the item's success rate, seeded by
(item, sample) so a re-run scores alike.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, Iterator

from areal_core.api import (
    Dataset, GenerationRequest, InferenceEngine, Trajectory, Workflow, call_reward, group_size_of, sampling_params,
    stable_seed,
)

from areal_sim.profile import load_profile


@dataclass
class SimDatasetConfig:
    """Keys of ``dataset`` when ``dataset.name: sim``."""

    size: int = field(default=100_000, metadata={"ge": 1, "help": "items in the train split"})
    profile: str = field(default="qwen2.5-7b-h800", metadata={
        "help": "the latency profile whose lengths.prompt sets the prompt length"})
    token_scale: int = field(default=1, metadata={"ge": 1, "help": "modelled tokens per token id (as rollout's)"})


class SimDataset(Dataset):
    config_class = SimDatasetConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        options = self.context.options or SimDatasetConfig()
        self.size = options.size if self.split == "train" else max(1, options.size // 100)
        prompt = load_profile(options.profile).lengths.prompt
        self.prompt_len = max(1, round(prompt / options.token_scale))

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[dict]:
        for i in range(self.size):
            rng = random.Random(stable_seed("sim-item", self.split, self.seed, i))
            yield {"id": f"{self.split}-{i}", "prompt_ids": [rng.randrange(1, 30000) for _ in range(self.prompt_len)],
                   "success": rng.betavariate(0.7, 0.7)}


async def sim_reward(prompt: str, completion: str, item: dict) -> float:
    """1 with the item's success rate, seeded by (item, sample): ``completion`` carries the sample's index."""
    return float(random.Random(stable_seed("sim-reward", item["id"], completion)).random() < item["success"])


class SimWorkflow(Workflow):
    """``rollout.group_size`` samples of the item's prompt ids; no tokenizer, no text."""

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.reward = self.context.extras.get("reward", sim_reward)
        self.group_size = group_size_of(self.context.config)

    async def arun_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        prompt = list(item["prompt_ids"])
        requests = [GenerationRequest(list(prompt), sampling_params(self.context.config, item))
                    for _ in range(self.group_size)]
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        # one after another: the simulated reward answers at once, and a task each would cost more than it
        results = [await call_reward(self.reward, "", str(k), item) for k in range(self.group_size)]
        n = len(prompt)
        return [Trajectory(tokens=[*prompt, *r.output_ids], loss_mask=[0] * n + [1] * len(r.output_ids),
                           logprobs=[0.0] * n + list(r.output_logprobs), versions=[-1] * n + list(r.output_versions),
                           reward=result.reward, info={"id": item["id"], "sample": k, "stop_reason": r.stop_reason})
                for k, (r, result) in enumerate(zip(responses, results))]
