"""Train engine test doubles for the conformance kit's own tests.

``BigramTrainEngineDouble`` is a bigram table trained with SGD on packed
batches: a real optimizer step in a few microseconds. The others each break
one rule. Imports torch (only when the kit resolves one of them). Installed
as a fake distribution by ``tests/test_conformance_kit.py``; never shipped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_core.api import TrainEngine


@dataclass
class BigramTrainEngineDoubleConfig:
    vocab_size: int = field(default=32, metadata={"help": "tokens of the bigram table"})
    lr: float = field(default=0.5, metadata={"help": "step size of each update"})


class BigramTrainEngineDouble(TrainEngine):
    config_class = BigramTrainEngineDoubleConfig
    capabilities = frozenset({"save_load", "export_tensors", "export_beside_training", "export_into", "minibatches"})

    def initialize(self) -> None:
        self.weights_read = threading.Lock()  # held by an export until its last bucket is read
        options = self.context.options or BigramTrainEngineDoubleConfig()
        generator = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(0.1 * torch.randn(options.vocab_size, options.vocab_size,
                                                          generator=generator))
        self.optimizer = torch.optim.SGD([self.table], lr=options.lr)
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def _logprobs(self, batch, temperature=1.0):
        ids = torch.as_tensor(batch["input_ids"])  # [T]
        starts = torch.as_tensor(batch["cu_seqlens"])[:-1]  # [B]
        logp = torch.log_softmax(self.table[ids[:-1]] / temperature, dim=-1)  # [T-1, V]
        logprobs = torch.zeros(len(ids))
        entropy = torch.zeros(len(ids))
        logprobs = logprobs.index_put((torch.arange(1, len(ids)),), logp.gather(1, ids[1:, None])[:, 0])
        entropy = entropy.index_put((torch.arange(1, len(ids)),), -(logp.exp() * logp).sum(-1))
        # The first token of each sequence has no predecessor in it: logprob 0.
        return logprobs.index_fill(0, starts, 0.0), entropy.index_fill(0, starts, 0.0)

    def forward_logprobs(self, batch, temperature=1.0):
        with torch.no_grad():
            logprobs, entropy = self._logprobs(batch, temperature)
        return {"logprobs": logprobs, "entropy": entropy}

    def train_batch(self, batch, loss_fn, temperature=1.0, epochs=1):
        from areal_core.train_batches import merge_update_stats, update_batches

        steps = [self.one_step(part, loss_fn, j) for j, part in enumerate(update_batches(batch, epochs))]
        self._version += 1
        return merge_update_stats(steps, epochs)

    def one_step(self, batch, loss_fn, update_step):
        logprobs, entropy = self._logprobs(batch)
        loss, stats = loss_fn(logprobs, entropy, {**batch, "update_step": update_step})
        self.optimizer.zero_grad()
        loss.backward()
        self.step()
        return {"loss": float(loss), **{k: float(v) for k, v in stats.items()}}

    def step(self) -> None:
        with self.weights_read:
            self.optimizer.step()

    def save(self, path, *, with_optimizer=True):
        Path(path).mkdir(parents=True, exist_ok=True)
        state = {"table": self.table.detach().clone(), "version": self._version}
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        torch.save(state, Path(path) / "state.pt")

    def load(self, path, *, with_optimizer=True):
        state = torch.load(Path(path) / "state.pt")
        with torch.no_grad():
            self.table.copy_(state["table"])
        if with_optimizer and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self._version = state["version"]

    def export_tensors(self, bucket_bytes, into=None):
        self.weights_read.acquire()  # at the call, before any bucket is read
        return self._rows(into)

    def _rows(self, into=None):
        try:  # one row per bucket: the export is read in several steps
            for i, row in enumerate(self.table.detach()):
                name = f"table.{i}"
                target = into(name, tuple(row.shape), row.dtype) if into is not None else None
                yield [(name, target.copy_(row) if target is not None else row.clone())]
        finally:
            self.weights_read.release()


class NoStepTrainEngineDouble(BigramTrainEngineDouble):
    """Broken: computes gradients but never steps the optimizer."""

    capabilities = frozenset({"save_load", "export_tensors"})

    def step(self) -> None:
        return None


class ForgetfulLoadTrainEngineDouble(BigramTrainEngineDouble):
    """Broken: load() returns without restoring anything."""

    def load(self, path, *, with_optimizer=True):
        return None


class ViewExportTrainEngineDouble(BigramTrainEngineDouble):
    """Broken: export_tensors hands out a view of the parameter, which the next step changes."""

    capabilities = frozenset({"save_load", "export_tensors"})

    def export_tensors(self, bucket_bytes):
        yield [("table", self.table.detach())]


class IntoIgnoredTrainEngineDouble(BigramTrainEngineDouble):
    """Broken: declares export_into but hands out tensors of its own whatever ``into`` gives."""

    def export_tensors(self, bucket_bytes, into=None):
        return super().export_tensors(bucket_bytes)


class RacyExportTrainEngineDouble(BigramTrainEngineDouble):
    """Broken: declares export_beside_training, but its optimizer step does not wait for an export being read."""

    def step(self) -> None:
        self.optimizer.step()


class OneStepMinibatchTrainEngineDouble(BigramTrainEngineDouble):
    """Broken: declares minibatches but trains the whole batch in one optimizer step."""

    def train_batch(self, batch, loss_fn, temperature=1.0, epochs=1):
        stats = self.one_step(batch, loss_fn, 0)
        self._version += 1
        return {**stats, "n_optimizer_steps": 1.0}
