"""Test doubles for a whole RL run through the real launcher and trainer, shared by the core's tests and
the engine plugins' end-to-end tests.

:func:`installed` registers them as a fake distribution (entry points
included, :func:`areal_core.testing.distributions.install_fake_distribution`)
and writes :data:`CONFIG`; the trainer subprocess resolves them by name as it
would real plugins. The train engine double "learns" a counter, writes real
files on save / export and sleeps ``step_s`` per step so a test can kill it
mid-run; the inference double is
:class:`areal_core.testing.latency_engine.LatencyEngineDouble` with weights
from disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from areal_core import hookimpl
from areal_core.api import Algorithm, Dataset, Needs, TrainEngine, call_reward
from areal_core.parallelism import BackendSupport
from areal_core.testing.latency_engine import GroupWorkflowDouble, LatencyEngineDouble, items


@dataclass
class CounterEngineConfig:
    step_s: float = 0.0


class CounterTrainEngineDouble(TrainEngine):
    """Built with role "critic", its values are a learnable line V(t) = a + b * x_t (SGD), x_t the token's
    position over the batch's largest."""

    # export_tensors hands out a copy made at the call, so the next step cannot change what is being read
    capabilities = frozenset({"save_load", "export_disk", "export_tensors", "export_beside_training", "critic"})
    config_class = CounterEngineConfig

    def initialize(self):
        self.state = {"version": 0, "tokens_seen": 0}
        self.lags: list[list[int]] = []  # per step: version at training minus each loss token's version
        if self.context.extras.get("role") == "critic":
            self.state.update(a=0.0, b=0.0, value_steps=0)

    def _values(self, batch):
        import torch

        a = torch.tensor(self.state["a"], requires_grad=True)
        b = torch.tensor(self.state["b"], requires_grad=True)
        x = torch.as_tensor(batch["position_ids"], dtype=torch.float32)
        values = a + b * x / x.max().clamp(min=1.0)
        starts = torch.as_tensor(batch["cu_seqlens"][:-1])
        return values.index_fill(0, starts, 0.0), (a, b)  # aligned like logprobs: 0 at each first token

    def forward_values(self, batch):
        return {"values": self._values(batch)[0].tolist()}

    def train_values(self, batch, loss_fn):
        import torch

        values, params = self._values(batch)
        mb = {k: torch.as_tensor(v) if isinstance(v, list) else v for k, v in batch.items()}
        mb["loss_mask"] = mb["loss_mask"].bool()
        loss, stats = loss_fn(values, mb)
        loss.backward()
        self.state["a"] -= 0.5 * float(params[0].grad)
        self.state["b"] -= 0.5 * float(params[1].grad)
        self.state["value_steps"] += 1
        return {"loss": float(loss), **stats}

    @property
    def version(self):
        return self.state["version"]

    def forward_logprobs(self, batch, temperature=1.0):
        return {"logprobs": [-1.0] * len(batch["input_ids"])}

    def train_batch(self, batch, loss_fn, temperature=1.0):
        self.lags.append([self.version - v for v, m in zip(batch["versions"], batch["loss_mask"]) if m])
        record_to = os.environ.get("AREAL_TEST_LAGS_FILE")  # the lags seen by the consumer, across processes
        if record_to:
            with open(record_to, "a") as f:
                f.write(json.dumps({"version": self.version, "lags": self.lags[-1]}) + "\n")
        loss, stats = loss_fn(None, None, batch)
        # "N:FILE": the step that trains version N waits until FILE exists, so a test can keep the run going until
        # something it waits for has happened (a server rejoining), however fast or loaded the machine is
        hold = os.environ.get("AREAL_TEST_HOLD_AT_VERSION")
        if hold and self.version == int(hold.split(":", 1)[0]):
            from areal_core.testing.waits import wait_until

            release = Path(hold.split(":", 1)[1])
            wait_until(release.exists, 600, f"{release} to exist (AREAL_TEST_HOLD_AT_VERSION={hold})", 0.05)
        time.sleep(self.context.options.step_s)
        self.state["version"] += 1
        self.state["tokens_seen"] += len(batch["input_ids"])
        return {"loss": loss, **stats}

    def save(self, path, *, with_optimizer=True):
        Path(path).mkdir(parents=True, exist_ok=True)
        Path(path, "state.json").write_text(json.dumps(self.state))
        pad_mb = float(os.environ.get("AREAL_TEST_CHECKPOINT_PAD_MB", 0))  # an optimizer's worth of bytes
        device = os.environ.get("AREAL_TEST_CHECKPOINT_PAD_DEVICE")  # /dev/full: its writes fail with ENOSPC
        if pad_mb and device:
            Path(path, "optimizer.pt").symlink_to(device)
            Path(path, "optimizer.pt").write_bytes(bytes(int(pad_mb * 2**20)))
        elif pad_mb:
            import torch

            torch.save(torch.zeros(int(pad_mb * 2**18)), Path(path, "optimizer.pt"))

    def load(self, path, *, with_optimizer=True):
        self.state = json.loads(Path(path, "state.json").read_text())
        if "value_steps" in self.state:
            print(f"critic double: loaded after {self.state['value_steps']} value steps", flush=True)

    def export_to_disk(self, path):
        """Writes the version; with a real model configured, also its unchanged safetensors (a real
        inference engine then reloads real weights at every step)."""
        if os.environ.get("RANK", "0") != "0":  # every rank is called; rank 0 writes, as real engines do
            return
        Path(path).mkdir(parents=True, exist_ok=True)
        Path(path, "weights.json").write_text(json.dumps({"version": self.state["version"]}))
        model = self.context.config.model.path
        if model:
            from areal_core.models import resolve_model_path  # a folder, or a hub id's snapshot in the cache

            model = resolve_model_path(model)
            for name in ("model.safetensors", "config.json"):
                shutil.copy(Path(model, name), Path(path, name))


    def export_tensors(self, bucket_bytes):
        """The version; with a real model configured, its unchanged weights instead (a real engine loads them)."""
        import torch

        model = self.context.config.model.path
        if model:
            from safetensors.torch import load_file

            if os.environ.get("RANK", "0") != "0":
                return iter([[]])
            from areal_core.models import resolve_model_path

            return iter([list(load_file(str(resolve_model_path(model) / "model.safetensors")).items())])
        return iter([[("version", torch.tensor(self.state["version"]))]])


class DiskLatencyEngineDouble(LatencyEngineDouble):
    """The latency engine double, built from a context, loading its version from exported weights (a folder or
    tensors)."""

    capabilities = frozenset({"pause", "update_weights_from_disk", "update_weights_from_tensors"})

    @classmethod
    def create(cls, context):
        return cls(seed=context.extras.get("server_index", 0), max_token_latency_s=0.001)

    async def update_weights_from_tensors(self, named_tensors, version):
        exported = int(dict(named_tensors)["version"])
        await self._load(exported, version, "tensors")
        self.updates[-1] = ("tensors", version)

    async def update_weights_from_disk(self, path, version):
        await self._load(json.loads(Path(path, "weights.json").read_text())["version"], version, path)

    async def _load(self, exported, version, source):
        if exported != version:
            raise RuntimeError(f"weights from {source} are version {exported}, expected {version}")
        # A server that takes a while to load (tests of the trainer not waiting for it at eta > 0): a fixed time,
        # plus one drawn per server and version below AREAL_TEST_WEIGHT_LOAD_JITTER_S.
        load_s = float(os.environ.get("AREAL_TEST_WEIGHT_LOAD_S", "0"))
        if "AREAL_TEST_WEIGHT_LOAD_JITTER_S" in os.environ:
            draw = random.Random(f"{os.environ.get('AREAL_TEST_SEED', '0')}:{self.seed}:{version}")
            load_s += draw.random() * float(os.environ["AREAL_TEST_WEIGHT_LOAD_JITTER_S"])
        await asyncio.sleep(load_s)
        await super().update_weights_from_disk(source, version)


class RewardingWorkflowDouble(GroupWorkflowDouble):
    """Group workflow double whose rewards come from the run's reward component."""

    @classmethod
    def create(cls, context):
        workflow = cls(group_size=context.config.rollout.group_size)
        workflow.reward = context.extras["reward"]
        return workflow

    async def arun_episode(self, engine, item):
        trajectories = await super().arun_episode(engine, item)
        results = await asyncio.gather(*(call_reward(self.reward, "", str(t.tokens[-1]), item) for t in trajectories))
        for t, r in zip(trajectories, results):
            t.reward = r.reward
        return trajectories


def mod3_reward_double(prompt, completion, item):
    return float(int(completion) % 3 == 0)


class ItemsDatasetDouble(Dataset):
    def __iter__(self):
        n = int(os.environ.get("AREAL_TEST_ITEMS", "200"))
        if self.split == "validation":  # ids of their own, never in the train split
            return iter({**item, "id": 100_000 + item["id"]} for item in items(n, seed=self.seed + 1))
        return iter(items(n, seed=self.context.config.trainer.seed))

    def __len__(self):
        return int(os.environ.get("AREAL_TEST_ITEMS", "200"))


class MeanRewardAlgorithmDouble(Algorithm):
    def compute_advantages(self, batch):
        per_seq = batch["rewards"]
        mean = sum(per_seq) / len(per_seq)
        batch["advantages"] = [per_seq[i] - mean for i, n in enumerate(batch["seq_lens"]) for _ in range(n)]
        return batch

    def loss(self, logprobs, entropy, batch):
        return 0.0, {"advantage_abs_mean": sum(map(abs, batch["advantages"])) / len(batch["advantages"])}


class PolicyGradientAlgorithmDouble(MeanRewardAlgorithmDouble):
    """REINFORCE with a batch-mean baseline on tensors, for runs with a real train engine."""

    def loss(self, logprobs, entropy, batch):
        mask = batch["loss_mask"].bool()
        loss = -(batch["advantages"][mask] * logprobs[mask]).mean()
        return loss, {"entropy": float(entropy[mask].mean())}


class RecordingPolicyGradientAlgorithmDouble(PolicyGradientAlgorithmDouble):
    """Appends every batch it is given (tokens, behaviour logprobs, versions) to AREAL_TEST_BATCHES_FILE."""

    def compute_advantages(self, batch):
        keys = ("input_ids", "cu_seqlens", "loss_mask", "logprobs", "versions")
        with open(os.environ["AREAL_TEST_BATCHES_FILE"], "a") as f:
            f.write(json.dumps({k: list(batch[k]) for k in keys}) + "\n")
        return super().compute_advantages(batch)


class ValueAlgorithmDouble(MeanRewardAlgorithmDouble):
    """Asks for a critic: advantages = reward - V on loss tokens, value loss = mean squared error to the reward."""

    @property
    def needs(self):
        return Needs(values=True)

    def compute_advantages(self, batch):
        if "values" not in batch:
            raise KeyError("ValueAlgorithmDouble: the trainer did not add 'values'")
        returns = [batch["rewards"][i] for i, n in enumerate(batch["seq_lens"]) for _ in range(n)]
        batch["returns"] = returns
        batch["advantages"] = [(r - v) * m for r, v, m in zip(returns, batch["values"], batch["loss_mask"])]
        return batch

    def value_loss(self, values, batch):
        mask = batch["loss_mask"]
        loss = (((values - batch["returns"]) ** 2) * mask).sum() / mask.sum()
        return loss, {"value_mean": float(values[mask].mean())}


@hookimpl
def areal_declare_backends():
    return [
        BackendSupport("rl_train_double", "train", dims="d", devices=("cpu",)),
        BackendSupport("rl_infer_double", "inference", dims="d", devices=("cpu",)),
    ]


_HERE = __name__  # areal_core.testing.rl_doubles
ENTRY_POINTS = {
    "areal": {"rl-doubles": _HERE},
    "areal.engines.train": {"rl_train_double": f"{_HERE}:CounterTrainEngineDouble"},
    "areal.engines.inference": {"rl_infer_double": f"{_HERE}:DiskLatencyEngineDouble"},
    "areal.algorithms": {"rl_algo_double": f"{_HERE}:MeanRewardAlgorithmDouble",
                         "rl_pg_double": f"{_HERE}:PolicyGradientAlgorithmDouble",
                         "rl_recording_pg_double": f"{_HERE}:RecordingPolicyGradientAlgorithmDouble",
                         "rl_value_double": f"{_HERE}:ValueAlgorithmDouble"},
    "areal.workflows": {"rl_workflow_double": f"{_HERE}:RewardingWorkflowDouble"},
    "areal.rewards": {"mod3_double": f"{_HERE}:mod3_reward_double"},
    "areal.datasets": {"items_double": f"{_HERE}:ItemsDatasetDouble"},
}

CONFIG = """\
allocation: rl_infer_double:d2@cpu+rl_train_double:cpu
actor: {backend: rl_train_double}
rollout: {backend: rl_infer_double, group_size: 2, batch_size: 3, max_head_offpolicyness: 0,
          weight_probe_every: 0}  # the doubles' logprobs are no model's: the parity probe would fail
algorithm: {name: rl_algo_double}
workflow: {name: rl_workflow_double}
reward: {name: mod3_double}
dataset: {name: items_double}
trainer: {total_steps: 6}
eval: {size: 0}
"""


@contextmanager
def installed(folder: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The doubles installed as the distribution ``areal-test-rl-doubles`` under ``folder`` for the length of
    the block: yields (:data:`CONFIG` written to ``folder/run.yaml``, the environment in which an ``areal run``
    subprocess finds them)."""
    from areal_core.testing.distributions import install_fake_distribution

    with install_fake_distribution(folder / "site", "areal-test-rl-doubles", "0.0.1", ENTRY_POINTS, {}) as site:
        config = folder / "run.yaml"
        config.write_text(CONFIG)
        # no empty entry: Python reads one as the current folder, which a user's PYTHONPATH does not give
        paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        yield config, {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def areal_command(command: str, folder: Path, overrides: list[str], timeout_s: float = 120) -> Any:
    """``areal COMMAND`` (``check``, ``run``) of :data:`CONFIG` with the doubles installed, output under
    ``folder/runs``, trial ``refused``, then ``overrides``: for tests that a refusal is the same through both.
    Returns the finished process (stdout and stderr together in ``stdout``); waits at most ``timeout_s``
    (:func:`~areal_core.testing.scaled`)."""
    import subprocess
    import sys

    from areal_core.testing.waits import scaled

    areal = str(Path(sys.executable).with_name("areal"))
    with installed(folder) as (config, env):
        return subprocess.run([areal, command, str(config), f"output_dir={folder / 'runs'}", "trial=refused",
                               *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=scaled(timeout_s))


def areal_run(folder: Path, trial: str, overrides: list[str], timeout_s: float = 600) -> tuple[Any, Path]:
    """``areal run`` of :data:`CONFIG` with the doubles installed (:func:`installed`), output under
    ``folder/runs``, then ``overrides`` (``key=value``: the real engines or algorithm a test puts in place of
    the doubles). Returns the finished process (stdout and stderr together in ``stdout``) and the run's folder.
    Waits at most ``timeout_s`` (:func:`~areal_core.testing.scaled`)."""
    import subprocess
    import sys

    from areal_core.testing.waits import scaled

    areal = str(Path(sys.executable).with_name("areal"))
    with installed(folder) as (config, env):
        proc = subprocess.run([areal, "run", str(config), f"output_dir={folder / 'runs'}", f"trial={trial}",
                               *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=scaled(timeout_s))
    return proc, folder / "runs" / "areal" / trial
