"""The asynchronous rollout side: staleness admission, interruptible
generation, the controller the trainer drives, and padding-free batches."""

from areal_core.rollout.batch import EpisodeGroup, pack_groups
from areal_core.rollout.controller import RolloutController, RolloutError, StallError, has_reward_variance
from areal_core.rollout.interruptible import InterruptibleEngine
from areal_core.rollout.staleness import StalenessManager

__all__ = [
    "EpisodeGroup", "InterruptibleEngine", "RolloutController", "RolloutError", "StallError",
    "StalenessManager", "has_reward_variance", "pack_groups",
]
