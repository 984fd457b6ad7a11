"""The asynchronous rollout side: staleness admission, interruptible
generation, the controller the trainer drives, elastic server topology, and
padding-free batches."""

from areal_core.rollout.batch import EpisodeGroup, pack_groups
from areal_core.rollout.controller import (PendingCall, RolloutController, RolloutError, StallError,
                                           has_reward_variance)
from areal_core.rollout.elastic import ElasticConfig, EnginePool, HealthMonitor, NoEngineError, Topology
from areal_core.rollout.interruptible import InterruptibleEngine
from areal_core.rollout.staleness import StalenessManager

__all__ = [
    "ElasticConfig", "EnginePool", "EpisodeGroup", "HealthMonitor", "InterruptibleEngine", "NoEngineError",
    "Topology", "PendingCall", "RolloutController", "RolloutError", "StallError",
    "StalenessManager", "has_reward_variance", "pack_groups",
]
