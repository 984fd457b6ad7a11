"""The simulated train engine: the real train-engine contract, the profile's time instead of a model.

It is the actor of a simulated run: the real trainer loop hands it batches
(packed by the real code, advantages from the real algorithm), and it runs the
algorithm's real loss on each optimizer step's sub-batch (behaviour logprobs
standing in for the model's, so every ratio is 1), then spends what the profile
says a step of that many tokens costs on the modelled layout:

- ``forward_logprobs``: ``train.forward_share`` of a training step's compute per token (a quarter by default:
  2 of a recomputed forward + backward's 8 x params FLOPs per token) on the actor's layout
  (``TrainModel.forward_s``);
- ``train_batch``: per optimizer step (``actor.ppo_minibatches`` x ``ppo_epochs``), ``TrainModel.step_s`` of the
  step's tokens on the actor's d x t x p layout: the compute split over every rank, a pipeline's fill and drain,
  tensor parallelism's all-reduces over NVLink (profiles with ``train.layers``, ``hidden`` and ``tp_link_gbps``;
  without them t and p are an ideal split of the compute), ``train.s_per_step``, and the gradient all-reduce
  over the d replicas;
- handing the weights out (``export_tensors`` / ``export_to_disk``): ``weights.export_s``, which the trainer
  waits for. Except where the real fsdp engine exports beside training (``export_beside_training``: one train
  rank, eta > 0, weights as tensors; a profile of roles sharing a CPU and ``contended``): there a thread of its
  own reads the weights while the trainer trains on and the server generates, three busy threads on two cores.
  The export's time then comes out of both: half of it is added to the next optimizer step, half to the
  server's next weight update (``sim.stall_s`` among the exported tensors). No thread is run for it, so the
  lockstep clock keeps the run reproducible.

A profile of roles that share one CPU (its ``cpu`` section) scales these by the threads each role gets
(``SimTrainConfig.threads``).

Tokens count ``token_scale`` times over, as in the simulated inference engine
(each returned token stands for that many). Time passes through the clock the
trainer hands its engines (``extras["clock"]``): a virtual one in ``areal
simulate``, the wall clock (divided by ``time_scale``) otherwise. Weights are a
version number: exports write it, and the inference engines charge the
profile's transfer time for the bytes a real model would move.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from areal_core.api import TrainEngine
from areal_core.clock import REAL_CLOCK

from areal_sim.profile import load_profile


@dataclass
class SimTrainConfig:
    """Keys of ``actor`` when ``actor.backend: sim_train``."""

    profile: str = field(default="qwen2.5-7b-h800", metadata={
        "help": "a shipped latency profile (areal_sim/profiles) or the path of a profile YAML"})
    token_scale: int = field(default=1, metadata={
        "ge": 1, "help": "modelled tokens per token in a batch (the same as rollout.token_scale)"})
    threads: int = field(default=0, metadata={
        "ge": 0, "help": "threads of each train rank, for a profile of roles that share a CPU (its cpu section); "
                         "0 = one (areal simulate sets it from the local launcher's thread plan)"})
    contended: bool = field(default=False, metadata={
        "help": "the other role runs at once on the same CPU: times scale by the profile's cpu.contention "
                "(areal simulate sets it at eta > 0)"})
    time_scale: float = field(default=1.0, metadata={
        "gt": 0.0, "help": "modelled seconds per wall-clock second on a real clock (a virtual clock ignores it)"})


class SimTrainEngine(TrainEngine):
    capabilities = frozenset({"save_load", "export_disk", "export_tensors", "minibatches", "reference"})
    config_class = SimTrainConfig

    def initialize(self) -> None:
        options = self.context.options or SimTrainConfig()
        self.profile = load_profile(options.profile).on_threads(1, max(options.threads, 1), options.contended)
        self.scale, self.time_scale = options.token_scale, options.time_scale
        self.clock = self.context.extras.get("clock") or REAL_CLOCK
        parallel = getattr(self.context.placement, "parallel", None)
        self.d = int(getattr(parallel, "d", 1) or 1)
        self.t = int(getattr(parallel, "t", 1) or 1)
        self.p = int(getattr(parallel, "p", 1) or 1)
        self.gpus = self.d * self.t * self.p
        # the real engine's export beside training, modelled (see the module docstring)
        self.beside = (self.profile.cpu is not None and options.contended and self.gpus == 1)
        self._owed_s = 0.0  # the export's share still to add to the next optimizer step
        self._version = 0
        self.busy_s = 0.0  # modelled seconds of work (the simulator's utilisation figure)
        self.tokens = 0  # modelled tokens trained

    @property
    def version(self) -> int:
        return self._version

    def _spend(self, modelled_s: float) -> None:
        self.busy_s += modelled_s
        self.clock.sleep(modelled_s if self.clock.virtual else modelled_s / self.time_scale)

    def _computed(self, batch: dict) -> int:
        """Modelled tokens the engine computes for ``batch``: all of them, or with ``train.shared_prompts`` each
        group's prompt once (the prompt is the sequence's tokens before its first trained one)."""
        from areal_core.train_batches import as_list

        total = len(batch["input_ids"])
        if not (self.profile.train.shared_prompts and "group_index" in batch and "seq_lens" in batch):
            return total * self.scale
        mask, offset, seen = as_list(batch["loss_mask"]), 0, set()
        for n, group in zip(as_list(batch["seq_lens"]), as_list(batch["group_index"])):
            if group in seen:
                try:
                    total -= mask.index(1, offset, offset + n) - offset
                except ValueError:  # nothing trained in it: all prompt
                    total -= n
            seen.add(group)
            offset += n
        return total * self.scale

    def forward_logprobs(self, batch: dict, temperature: float = 1.0) -> dict:
        tokens = self._computed(batch)
        self._spend(self.profile.train.forward_s(tokens, self.d, self.t, self.p))
        return {"logprobs": list(batch["logprobs"])}

    def train_batch(self, batch: dict, loss_fn: Any, temperature: float = 1.0, epochs: int = 1) -> dict:
        import torch

        from areal_core.train_batches import as_list, merge_update_stats, to_tensor, update_batches

        steps = []
        for j, part in enumerate(update_batches(batch, epochs)):
            logprobs = torch.as_tensor(part["logprobs"], dtype=torch.float32).requires_grad_()
            entropy = torch.zeros_like(logprobs)
            # the columns as tensors, as every train engine hands its micro-batches to the loss
            mb = {k: to_tensor(k, v) for k, v in part.items()}
            loss, stats = loss_fn(logprobs, entropy, {**mb, "update_step": j})
            loss.backward()  # the algorithm's real loss and its gradient, on the stand-in logprobs
            tokens = self._computed(part)
            owed, self._owed_s = self._owed_s, 0.0
            self._spend(self.profile.train.step_s(tokens, self.d, self.t, self.p) + owed
                        # the controller's share, per sample generated for this batch (once over the epochs)
                        + len(as_list(part.get("seq_lens", ()))) / epochs * self.profile.train.side_s_per_sample)
            self.tokens += tokens
            steps.append({"loss": float(loss.detach()), **{k: float(v) for k, v in stats.items()},
                          "grad_norm": float(logprobs.grad.norm()) if logprobs.grad is not None else 0.0})
        self._version += 1
        return merge_update_stats(steps, epochs)

    # -------------------------------------------------------------- weights: a version number
    def _state(self) -> dict:
        return {"version": self._version, "tokens": self.tokens, "busy_s": self.busy_s,
                "profile": self.profile.name}

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        Path(path).mkdir(parents=True, exist_ok=True)
        tmp = Path(path, "sim_state.json.tmp")
        tmp.write_text(json.dumps(self._state()))
        tmp.replace(Path(path, "sim_state.json"))

    def load(self, path: str, *, with_optimizer: bool = True) -> None:
        state = json.loads(Path(path, "sim_state.json").read_text())
        self._version, self.tokens, self.busy_s = state["version"], state["tokens"], state["busy_s"]

    def export_to_disk(self, path: str) -> None:
        self._spend(self.profile.weights.export_s)
        self.save(path)

    def export_tensors(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        import torch

        stall_s = 0.0
        if self.beside:
            self._owed_s += self.profile.weights.export_s / 2
            stall_s = self.profile.weights.export_s / 2
        else:
            self._spend(self.profile.weights.export_s)
        return iter([[("sim.version", torch.tensor(self._version)),
                      ("sim.stall_s", torch.tensor(stall_s, dtype=torch.float64))]])

    def close(self) -> None:
        pass
