"""Test doubles for one component of every kind, so a whole run config can
validate without real engines. Installed as a fake distribution by
``tests/conftest.py::double_stack``; never shipped."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from areal_core import hookimpl
from areal_core.api import (
    Algorithm, Dataset, GenerationResponse, InferenceEngine, Launcher, TrainEngine, Workflow,
)
from areal_core.parallelism import BackendSupport


class TrainEngineDouble(TrainEngine):
    def forward_logprobs(self, batch, temperature=1.0):
        return {"logprobs": [0.0 for _ in batch["input_ids"]]}

    def train_batch(self, batch, loss_fn, temperature=1.0):
        return {"loss": 0.0}

    @property
    def version(self):
        return 0


class InferenceEngineDouble(InferenceEngine):
    async def agenerate(self, request):
        return GenerationResponse(request.rid, request.input_ids, [1], [-0.5], [0], "length")

    @property
    def version(self):
        return 0


@dataclass
class AlgorithmDoubleConfig:
    # keys of the double's own, read by no code: tests check they reach the component through the config
    eps_clip: float = field(default=0.2, metadata={"help": "a float key of the double's own"})
    group_norm: bool = field(default=True, metadata={"help": "a bool key of the double's own"})


class AlgorithmDouble(Algorithm):
    config_class = AlgorithmDoubleConfig

    def compute_advantages(self, batch):
        return batch

    def loss(self, logprobs, entropy, batch):
        return 0.0, {}


class WorkflowDouble(Workflow):
    async def arun_episode(self, engine, item):
        return None


def reward_double(prompt, completion, item):
    return 1.0


class DatasetDouble(Dataset):
    def __iter__(self):
        yield {"prompt": "1+1=", "answer": "2"}


class LauncherDouble(Launcher):
    """Records what it was asked to launch in the run folder, returns 0."""

    def launch(self, run, run_dir, *, resume=False):
        Path(run_dir, "launched.json").write_text(json.dumps({"allocation": str(run.allocation), "resume": resume}))
        return 0


@hookimpl
def areal_declare_backends():
    return [
        BackendSupport("train_double", "train", dims="dt", devices=("gpu", "cpu")),
        BackendSupport("infer_double", "inference", dims="d", devices=("cpu",)),
    ]
