"""The contracts between the core and its plugins.

Each contract is a small abstract class (or, for rewards, a callable shape).
A plugin implements one and names the class in the entry-point group of its
kind; the conformance kit in :mod:`areal_core.testing` checks it.
Nothing here imports torch: tensors appear only in type hints.
"""

from areal_core.api.algorithm import Algorithm, Needs
from areal_core.api.batch import FIELDS, PackedBatch
from areal_core.api.component import Component, Context
from areal_core.api.dataset import SPLITS, Dataset, pass_order, stable_seed
from areal_core.api.inference import (
    GenerationRequest,
    GenerationResponse,
    InferenceEngine,
    SamplingParams,
    ServerProcess,
)
from areal_core.api.launcher import Launcher
from areal_core.api.reward import Reward, RewardResult, call_reward
from areal_core.api.train import TrainEngine
from areal_core.api.workflow import (Trajectory, Workflow, encode_prompt, group_size_of, run_seed_of,
                                     sampling_params)

__all__ = [
    "Algorithm", "Component", "Context", "FIELDS", "PackedBatch", "Dataset", "GenerationRequest", "GenerationResponse",
    "InferenceEngine", "Launcher", "Needs", "Reward", "RewardResult", "SPLITS", "SamplingParams", "ServerProcess",
    "TrainEngine", "Trajectory", "Workflow", "call_reward", "encode_prompt",
    "group_size_of", "pass_order", "run_seed_of", "sampling_params", "stable_seed",
]
