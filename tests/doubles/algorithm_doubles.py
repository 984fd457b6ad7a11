"""Algorithm test doubles on plain Python lists (no torch) for the conformance
kit's own tests: one good, the rest each breaking one rule. Installed as a
fake distribution by ``tests/test_conformance_kit.py``; never shipped."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from areal_core.api import Algorithm


@dataclass
class ToyAlgorithmDoubleConfig:
    eps_clip: float = field(default=0.2, metadata={"help": "clip range of the ratio"})


class ToyAlgorithmDouble(Algorithm):
    """Group-mean baseline advantages and a clipped policy-gradient loss, on lists."""

    config_class = ToyAlgorithmDoubleConfig

    def compute_advantages(self, batch):
        cu, rewards, mask = batch["cu_seqlens"], batch["rewards"], batch["loss_mask"]
        baseline = sum(rewards) / len(rewards)
        advantages = []
        for s in range(len(cu) - 1):
            advantages += [(rewards[s] - baseline) * m for m in mask[cu[s]:cu[s + 1]]]
        batch["advantages"] = advantages
        return batch

    def loss(self, logprobs, entropy, batch):
        eps = self.context.options.eps_clip
        total, ratios = 0.0, []
        for lp, old, adv, m in zip(logprobs, batch["logprobs"], batch["advantages"], batch["loss_mask"]):
            ratio = math.exp(lp - old)
            ratios.append(ratio)
            total -= m * min(ratio * adv, max(min(ratio, 1 + eps), 1 - eps) * adv)
        return total / max(1, sum(batch["loss_mask"])), {"ratio_mean": sum(ratios) / len(ratios)}


class PerSequenceAdvantageAlgorithmDouble(ToyAlgorithmDouble):
    """Broken: one advantage per sequence, not per token."""

    def compute_advantages(self, batch):
        baseline = sum(batch["rewards"]) / len(batch["rewards"])
        batch["advantages"] = [r - baseline for r in batch["rewards"]]
        return batch


class LossWithoutStatsAlgorithmDouble(ToyAlgorithmDouble):
    """Broken: returns the bare loss, no stats."""

    def loss(self, logprobs, entropy, batch):
        return super().loss(logprobs, entropy, batch)[0]


class DictNeedsAlgorithmDouble(ToyAlgorithmDouble):
    """Broken: says what it needs with a dict instead of Needs."""

    @property
    def needs(self):
        return {"reference_logprobs": True}
