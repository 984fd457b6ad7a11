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
import itertools
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
    success_mean: float = field(default=0.5, metadata={
        "gt": 0.0, "lt": 1.0, "help": "the mean of the items' success rates (drawn from a Beta distribution)"})
    success_concentration: float = field(default=1.4, metadata={
        "gt": 0.0, "help": "the Beta's a + b: below 2 most items are nearly always or nearly never solved (whole "
                           "groups agree, and dynamic filtering drops them); above, most are in between"})


class SimDataset(Dataset):
    config_class = SimDatasetConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        options = self.context.options or SimDatasetConfig()
        self.size = options.size if self.split == "train" else max(1, options.size // 100)
        prompt = load_profile(options.profile).lengths.prompt
        self.prompt_len = max(1, round(prompt / options.token_scale))
        self.beta = (options.success_mean * options.success_concentration,
                     (1 - options.success_mean) * options.success_concentration)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[dict]:
        for i in range(self.size):
            rng = random.Random(stable_seed("sim-item", self.split, self.seed, i))
            yield {"id": f"{self.split}-{i}", "prompt_ids": [rng.randrange(1, 30000) for _ in range(self.prompt_len)],
                   "success": rng.betavariate(*self.beta)}


async def sim_reward(prompt: str, completion: str, item: dict) -> float:
    """1 with the item's success rate, seeded by (item, sample): ``completion`` carries the sample's index."""
    # the seed's digest is itself uniform in [0, 2**31): no generator needed (one per sample cost more than the
    # rest of the simulated reward)
    return float(stable_seed("sim-reward", item["id"], completion) / 2**31 < item["success"])


# request ids from a counter: unique in the process, and cheaper than the uuid4 a request draws by default (a
# system call for random bytes, millions of times a simulation)
_request_ids = itertools.count()


class SimWorkflow(Workflow):
    """``rollout.group_size`` samples of the item's prompt ids; no tokenizer, no text."""

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.reward = self.context.extras.get("reward", sim_reward)
        self.group_size = group_size_of(self.context.config)

    async def arun_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        prompt = list(item["prompt_ids"])
        sampling = sampling_params(self.context.config, item)  # frozen: the group's requests share it
        first = next(_request_ids)
        requests = [GenerationRequest(list(prompt), sampling, rid=f"sim-{first}-{k}") for k in range(self.group_size)]
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        # one after another: the simulated reward answers at once, and a task each would cost more than it
        results = [await call_reward(self.reward, "", str(k), item) for k in range(self.group_size)]
        n = len(prompt)
        return [Trajectory(tokens=[*prompt, *r.output_ids], loss_mask=[0] * n + [1] * len(r.output_ids),
                           logprobs=[0.0] * n + list(r.output_logprobs), versions=[-1] * n + list(r.output_versions),
                           reward=result.reward, info={"id": item["id"], "sample": k, "stop_reason": r.stop_reason})
                for k, (r, result) in enumerate(zip(responses, results))]
