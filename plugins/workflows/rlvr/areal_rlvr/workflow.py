"""The ``rlvr`` workflow: one prompt, ``rollout.group_size`` samples, a verifiable reward each.

Token-in / token-out: the prompt is tokenized once (a chat through the
tokenizer's template, a raw prompt as written); the engine's output ids,
logprobs and per-token versions are kept as returned, and the output is
decoded only to hand the reward its text.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from areal_core.api import (
    GenerationRequest,
    InferenceEngine,
    Trajectory,
    Workflow,
    call_reward,
    encode_prompt,
    group_size_of,
    run_seed_of,
    sampling_params,
    stable_seed,
)
from areal_core.config.schema import spec


@dataclass
class RLVRConfig:
    """Keys of ``workflow`` when ``workflow.name: rlvr``."""

    seed_samples: bool = spec(True, help="seed sample k of an item from (trainer.seed, item id, k), so a "
                                         "re-run samples the same tokens on an engine with the 'seed' capability")


class RLVRWorkflow(Workflow):
    """Single-turn episodes; needs ``context.extras["reward"]`` (the run's reward) and the run's tokenizer."""

    config_class = RLVRConfig

    def __init__(self, context: Any = None, tokenizer: Any = None) -> None:
        super().__init__(context)
        self.options = self.context.options if self.context.options is not None else RLVRConfig()
        if "reward" not in self.context.extras:
            raise ValueError(f"the {type(self).__name__} needs the run's reward in context.extras['reward']; "
                             f"the trainer passes it (build(run, 'workflow', reward=...))")
        self.reward = self.context.extras["reward"]
        self.group_size, self.run_seed = group_size_of(self.context.config), run_seed_of(self.context.config)
        if tokenizer is None:
            from areal_core.models import load_tokenizer

            tokenizer = load_tokenizer(self.context.config)
        self.tokenizer = tokenizer

    def sample_seed(self, item: dict, *parts: int) -> int | None:
        return stable_seed(self.run_seed, str(item["id"]), *parts) if self.options.seed_samples else None

    async def arun_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        prompt_ids, prompt_text = encode_prompt(self.tokenizer, item)
        config = self.context.config
        requests = [GenerationRequest(list(prompt_ids), sampling_params(config, item, self.sample_seed(item, k)),
                                      metadata={"item_id": item.get("id"), "sample": k})
                    for k in range(self.group_size)]
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in responses]
        results = await asyncio.gather(*(call_reward(self.reward, prompt_text, text, item) for text in texts))
        n = len(prompt_ids)
        return [
            Trajectory(
                tokens=[*prompt_ids, *r.output_ids],
                loss_mask=[0] * n + [1] * len(r.output_ids),
                logprobs=[0.0] * n + list(r.output_logprobs),
                versions=[-1] * n + list(r.output_versions),
                reward=result.reward,
                info={"id": item.get("id"), "sample": k, "prompt": prompt_text, "completion": text,
                      "stop_reason": r.stop_reason, "reward_info": result.info},
            )
            for k, (r, text, result) in enumerate(zip(responses, texts, results))
        ]
