"""The RL loop, run by every train rank: ``python -m areal_core.trainer RUN_DIR [--resume]``.

One step::

    batch <- controller.prepare_batch(data)       rank 0; generation never stops for it
    proximal / reference logprobs, values         only when the algorithm asks
    advantages <- algorithm; stats <- actor.train_batch(batch, algorithm.loss)
                                                  actor.ppo_minibatches x ppo_epochs optimizer steps, one version
    critic.train_values(batch, algorithm.value_loss)  only with a critic (needs.values)
    version + 1; export weights; controller.update_weights(...)  (disk or tensors: rollout.weight_sync)
                                                  the only pause: interrupt, swap, resume
    checkpoint, metrics                           while generation goes on

Rank 0 owns the rollout controller, the metrics and the checkpoints; the
batch reaches the other ranks by broadcast, and each train engine takes its
share. A checkpoint holds the model and optimizer (written by the train
engine; a critic's in ``critic`` beside the actor's), the controller's
counters and done items, the RNG states and the step, so ``--resume``
continues with no sample trained twice or skipped; the restored weights reach
the inference engines (which restart from the base model) before the first
episode is admitted.

The weight hand-over lives in :mod:`areal_core.trainer_weights`, evaluation
on validation items in :mod:`areal_core.trainer_eval`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from areal_core.allocator import retain_freed_memory
from areal_core.api import Context, PackedBatch
from areal_core.checkpoint import (
    CONTROLLER_FILE, CheckpointDamagedError, CheckpointSpaceError, CheckpointStore, load_json, reporting_full_disk,
    rng_file, rng_state, save_json_atomic, set_rng_state,
)
from areal_core.clock import REAL_CLOCK, Clock
from areal_core.config.validate import ValidatedRun, minibatch_problem, validate_run
from areal_core.processes.nodes import rollout_node_env, same_node_as_trainer
from areal_core.completions import COMPLETIONS_FILE, EVAL_SAMPLES_FILE
from areal_core.metrics import WARNINGS_FILE, MetricsLogger, histogram, summarize, truncate_jsonl
from areal_core.problems import ProblemsError, format_problems
from areal_core.rollout import RolloutController, RolloutError, StallError, has_reward_variance, pack_groups
from areal_core.rollout.elastic import EVENTS_FILE, LAUNCHER_DISCOVERY_ENV
from areal_core.train_batches import MINIBATCH_KEY, POLICY_VERSION_KEY, as_list, assign_minibatches
from areal_core.trainer_eval import Evaluation, eval_metrics  # noqa: F401 (eval_metrics: imported from here)
from areal_core.trainer_weights import WeightHandOver, check_weight_sync, weight_check_line


def build(run: ValidatedRun, section: str, **extras: Any) -> Any:
    """Instantiate the selected component of ``section`` (functions, e.g. rewards, are used as they are)."""
    cls = run.components[section]
    if not isinstance(cls, type):
        return cls
    # A train engine gets its slice of the allocation (its d / t / ... ranks and device), as servers do.
    placement = run.placement("actor") if section == "actor" else None
    return cls.create(Context(config=run.config, options=run.options.get(section), placement=placement,
                              extras=extras))


def data_stream(dataset: Any, epochs: int) -> Iterator[Any]:
    """The dataset repeated ``epochs`` times (0: without end), in a fixed order."""
    for epoch in itertools.count() if epochs == 0 else range(epochs):
        yield from dataset


class FilteredOutError(RuntimeError):
    """Dynamic filtering dropped ``rollout.max_filtered_in_a_row`` groups in a row: no learning signal."""


class Trainer:
    def __init__(self, run: ValidatedRun, run_dir: Path, rank: int = 0, world_size: int = 1,
                 clock: Clock = REAL_CLOCK) -> None:
        self.run, self.cfg, self.run_dir = run, run.config, Path(run_dir)
        self._decode: Any = None  # token ids -> text for completions.jsonl: the workflow's tokenizer (rank 0)
        # The step's timings and the controller's loop run on it; the simulator passes a virtual one, which the
        # engines also get (extras["clock"]) to spend modelled time on.
        self.clock = clock
        self.algorithm = build(run, "algorithm")
        self.rank, self.world_size = rank, world_size
        self.actor = build(run, "actor", role="actor", clock=clock)
        # A frozen copy of the initial policy, only when the algorithm asks for reference logprobs.
        self.reference = build(run, "actor", role="reference", clock=clock) \
            if self.algorithm.needs.reference_logprobs else None
        # A value model (the initial weights with a value head), only when the algorithm asks for values.
        self.critic = build(run, "actor", role="critic", clock=clock) if self.algorithm.needs.values else None
        self._check_minibatches()
        self.controller: RolloutController | None = None
        self.store = CheckpointStore(self.run_dir / "checkpoints")
        self.step = 0
        self._step_samples: list[dict] = []  # the last step's completions.jsonl records, for MetricsLogger.log_samples
        self._filtered_in_a_row = 0  # groups dynamic filtering dropped since the last one it kept
        self.weights = WeightHandOver(self.cfg, self.actor, self.run_dir, rank, world_size, self._broadcast)
        self.evaluation: Evaluation | None = None  # rank 0's, built with the rollout side

    def _should_accept(self, group: Any) -> bool:
        """Dynamic filtering (``rollout.dynamic_filtering``) and the algorithm's own (e.g. dapo's dynamic
        sampling): both drop a group, and both count toward ``rollout.max_filtered_in_a_row``."""
        r = self.cfg.rollout
        dropped_by = None
        if r.dynamic_filtering and not has_reward_variance(group):
            dropped_by = "dynamic filtering (rollout.dynamic_filtering)"
        elif not self.algorithm.should_accept(group):
            dropped_by = f"the algorithm's filter ({self.cfg.algorithm.name})"
        if dropped_by is None:
            self._filtered_in_a_row = 0
            return True
        self._filtered_in_a_row += 1
        if r.max_filtered_in_a_row and self._filtered_in_a_row >= r.max_filtered_in_a_row:
            raise FilteredOutError(
                f"{dropped_by} dropped {self._filtered_in_a_row} groups in a row (last rewards: "
                f"{sorted(set(group.rewards))}): the task gives this model no learning signal. Fix: an easier (or "
                "harder) task or prompt, a larger rollout.group_size, or turn the filter off "
                "(rollout.dynamic_filtering=false, or the algorithm's own switch, e.g. "
                "algorithm.dynamic_sampling=false); rollout.max_filtered_in_a_row=0 waits forever")
        return False

    # -------------------------------------------------------------- setup (rank 0)
    def _rollout_side(self) -> None:
        reward = build(self.run, "reward")
        workflow = build(self.run, "workflow", reward=reward)
        tokenizer = getattr(workflow, "tokenizer", None)
        if callable(getattr(tokenizer, "decode", None)):
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        placement = self.run.placement("rollout")

        def engine_at(index: int, address: str | None) -> Any:
            return self.run.components["rollout"].create(Context(
                config=self.cfg, options=self.run.options.get("rollout"), placement=placement,
                extras={"server_index": index, "address": address, "same_node": same_node_as_trainer(index),
                        "exchange_dir": str(self.run_dir / "weights"), "clock": self.clock}))

        engines = [engine_at(i, os.environ.get(f"AREAL_ROLLOUT_{i}_ADDRESS")) for i in range(placement.parallel.d)]
        self._check_weight_sync(engines)
        for i, engine in enumerate(engines):
            node = os.environ.get(rollout_node_env(i))
            print(f"weights for inference server {i} ({getattr(engine, 'address', 'in process')}"
                  f"{f', node {node}' if node else ''}): "
                  f"{engine.weight_transport(self.cfg.rollout.weight_sync)}", flush=True)
        print(weight_check_line(self.cfg, engines), flush=True)
        r = self.cfg.rollout
        joined = itertools.count(placement.parallel.d)  # servers added while the run is live (rollout.elastic)
        self.controller = RolloutController(
            engines, workflow, batch_size=r.batch_size, max_head_offpolicyness=r.max_head_offpolicyness,
            max_concurrent_rollouts=r.max_concurrent_rollouts, request_timeout_s=r.request_timeout_s,
            should_accept=self._should_accept, elastic=r.elastic, pacing=r.pacing,
            engine_factory=lambda address: engine_at(next(joined), address),
            on_topology_event=self._record_topology_event,
            launcher_discovery_file=os.environ.get(LAUNCHER_DISCOVERY_ENV) or None, clock=self.clock,
            weight_check_holds=r.weight_check_holds)
        self.weights.controller = self.controller
        self._last_generated = (0, self.clock.now())
        self.dataset = build(self.run, "dataset")
        self.data = data_stream(self.dataset, self.cfg.trainer.epochs)
        self._eval_setup(reward)

    def _record_topology_event(self, kind: str, server: str, why: str) -> None:
        """A server left or joined routing: one row of ``events.jsonl``, which the launcher shows on the terminal."""
        row = {"time": time.time(), "step": self.step, "event": kind, "server": server, "why": why}
        with open(self.run_dir / EVENTS_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")

    # -------------------------------------------------------------- evaluation (rank 0)
    def _eval_setup(self, reward: Any) -> None:
        """The validation items and a workflow that samples ``eval.samples`` per item at ``eval.temperature``."""
        self.evaluation = Evaluation(self.run, reward, lambda: build(self.run, "dataset", split="validation"))
        self.evaluation.samples_file = self.run_dir / EVAL_SAMPLES_FILE

    # -------------------------------------------------------------- checkpoints
    def _restore(self) -> None:
        """Continue from the newest checkpoint that verifies against its manifest (rank 0 checks, every rank
        loads it); a newer one that does not is named and passed over. None that verifies: the run stops
        with :class:`CheckpointDamagedError` on every rank, having loaded nothing."""
        found: Any = None
        if self.rank == 0:
            try:
                found = self.store.resumable()
            except CheckpointDamagedError as exc:
                found = exc
        found = self._broadcast(found)
        if isinstance(found, CheckpointDamagedError):
            raise found
        latest, passed = found
        if latest is None:
            if self.rank == 0:
                print(f"resume: no complete checkpoint under {self.store.root}; starting from step 0", flush=True)
            return
        if self.rank == 0:
            for note in passed:
                print(f"resume: {note}; passing over it", flush=True)
        meta = self.store.load_meta(latest)
        self.actor.load(str(latest / "actor"))
        if self.critic is not None:
            self.critic.load(str(latest / "critic"))
        self.step = meta["step"]
        if self.rank == 0:
            self.controller.load_state_dict(load_json(latest / CONTROLLER_FILE))
            print(f"resume: continuing after step {self.step} from {latest} (verified against its manifest)",
                  flush=True)
        set_rng_state(load_json(latest / rng_file(self.rank)))

    def _write_rank_files(self, folder: Path, controller_state: dict | None) -> None:
        self.actor.save(str(folder / "actor"))  # collective for distributed engines
        if self.critic is not None:
            self.critic.save(str(folder / "critic"))
        save_json_atomic(rng_state(), folder / rng_file(self.rank))
        if controller_state is not None:
            save_json_atomic(controller_state, folder / CONTROLLER_FILE)

    def _save(self) -> None:
        """Rank 0 owns the atomic folder; the other ranks write into it before it is renamed.

        A disk too full for the checkpoint (refused before anything is written, or found full during the
        write) ends the trainer with the store's message, not a traceback: the partial folder is gone and
        ``latest`` unchanged, so the run continues with ``--resume`` once there is room.
        """
        if self.rank == 0:
            state = self.controller.state_dict()

            def write(folder: Path) -> None:
                self._broadcast(folder)
                self._write_rank_files(folder, state)
                self._barrier()

            try:
                self.store.save(self.step, write, {"version": self.actor.version})
            except CheckpointSpaceError as exc:
                if not exc.began:
                    self._broadcast(exc)  # the other ranks wait for a folder: they stop with the same words
                raise
            self.store.prune(keep=2)
        else:
            folder = self._broadcast(None)
            if isinstance(folder, CheckpointSpaceError):  # rank 0 found no room and wrote nothing
                raise folder
            with reporting_full_disk(folder, f"the checkpoint of step {self.step} (rank {self.rank}'s share)",
                                     outcome="The partial checkpoint never counts as one; `latest` is unchanged. "):
                self._write_rank_files(folder, None)
            self._barrier()

    # -------------------------------------------------------------- the loop
    def fit(self, resume: bool = False) -> None:
        self.actor.initialize()
        if self.reference is not None:
            self.reference.initialize()
        if self.critic is not None:
            self.critic.initialize()
        if self.rank == 0:
            self._rollout_side()
        if resume:
            self._restore()
        else:
            seed_everything(self.cfg.trainer.seed + self.rank)
        if self.rank == 0:
            truncate_jsonl(self.run_dir / "samples.jsonl", self.step + 1)
            truncate_jsonl(self.run_dir / COMPLETIONS_FILE, self.step + 1)
            truncate_jsonl(self.run_dir / EVAL_SAMPLES_FILE, self.step + 1)
        total = self.cfg.trainer.total_steps
        # Steps are logged 1-based; everything after the resumed step is dropped and redone.
        logger = MetricsLogger.for_run(self.run_dir, resume_step=self.step + 1, progress=False,
                                       loggers=self.cfg.metrics.loggers, config=self.run.resolved_dict(),
                                       start_timeout_s=self.cfg.metrics.logger_start_timeout_s,
                                       warnings_path=self.run_dir / WARNINGS_FILE) \
            if self.rank == 0 else None  # the launcher draws the progress bar from metrics.jsonl
        try:
            if self.controller is not None:
                self.controller.start()
            if self.actor.version > 0:
                self.weights.hand_over_restored()
            evaluation = self.evaluation if self.evaluation is not None and self.evaluation.items else None
            if evaluation is not None and self.step == 0 and self.cfg.eval.before:
                evaluation.start(self.controller, 0)  # the initial policy, before any rollout is admitted
                logger.log(0, evaluation.collect(wait=True))
            last_save, checkpoint_s = time.monotonic(), 0.0
            while self.step < total:
                metrics = self.train_step()
                self.step += 1
                metrics["time/checkpoint_s"] = checkpoint_s  # the previous step's save
                every, every_s = self.cfg.trainer.save_every, self.cfg.trainer.save_every_s
                due = (every and self.step % every == 0) or (every_s and time.monotonic() - last_save >= every_s)
                eval_due = bool(self.cfg.eval.every) and self.step % self.cfg.eval.every == 0
                if due or self.step == total or (eval_due and evaluation is not None):
                    # Evaluations and checkpoints see the engines at this step's weights.
                    metrics["time/generation_paused_s"] = metrics.get("time/generation_paused_s", 0.0) + \
                        self.weights.finish()
                if evaluation is not None:
                    beside = evaluation.collect(wait=False)  # an evaluation that ran beside training
                    if self.step == total:  # the final policy: nothing else needs the engines now
                        self.controller.stop_rollouts()
                        beside.update(evaluation.collect(wait=True))
                        if beside and logger is not None:
                            # an earlier step's evaluation, finished only now: a row of its own, or the final
                            # evaluation's keys would overwrite it in this step's row
                            logger.log(self.step, beside)
                        evaluation.start(self.controller, self.step)
                        metrics.update(evaluation.collect(wait=True))
                    else:
                        metrics.update(beside)
                        if eval_due:
                            evaluation.start(self.controller, self.step)
                if logger is not None:  # before the save: a step in a checkpoint always has its metrics
                    logger.log(self.step, metrics)
                    samples, self._step_samples = self._step_samples, []
                    logger.log_samples(self.step, samples)
                checkpoint_s = 0.0
                if due or self.step == total:
                    began = time.monotonic()
                    self._save()
                    last_save = time.monotonic()
                    checkpoint_s = last_save - began
        finally:
            if self.controller is not None:
                self.controller.close()
            if logger is not None:
                logger.close()
            self.actor.close()
            if self.reference is not None:
                self.reference.close()
            if self.critic is not None:
                self.critic.close()

    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def train_step(self) -> dict[str, float]:
        now = self.clock.now
        began = now()
        version = self.actor.version  # what this batch is trained at: the hand-out decides by it, not by the
        # version the engines serve, which lags by one while a non-blocking update loads (eta > 0)
        groups = self.controller.prepare_batch(self.data, timeout=self.cfg.rollout.request_timeout_s,
                                               version=version) if self.rank == 0 else None
        waited = now() - began
        packed = self._broadcast(self._pack(groups, version) if groups is not None else None)
        needs = self.algorithm.needs
        # Logprobs under the distribution the engines sampled from (greedy: the raw one).
        temperature = self.cfg.rollout.sampling.temperature or 1.0
        if needs.proximal_logprobs:
            packed["prox_logprobs"] = self.actor.forward_logprobs(packed, temperature)["logprobs"]
        if needs.reference_logprobs:
            packed["ref_logprobs"] = self.reference.forward_logprobs(packed, temperature)["logprobs"]
        if needs.values:
            packed["values"] = self.critic.forward_values(packed)["values"]
        packed = PackedBatch.of(self.algorithm.compute_advantages(packed)).validate(
            f"the batch after algorithm {self.cfg.algorithm.name!r} computed its advantages")
        train_began = now()
        epochs = self.cfg.actor.ppo_epochs
        update = {"epochs": epochs} if epochs > 1 else {}  # engines that predate epochs keep working at 1
        stats = self.actor.train_batch(packed, self.algorithm.loss, temperature=temperature, **update)
        self._check_optimizer_steps("actor", stats)
        critic_stats = self.critic.train_values(packed, self.algorithm.value_loss, **update) if needs.values else {}
        if needs.values:
            self._check_optimizer_steps("critic", critic_stats)
        train_s = now() - train_began
        new_version = self.actor.version
        metrics: dict[str, float] = {f"train/{k}": float(v) for k, v in stats.items() if _is_number(v)}
        metrics.update({f"critic/{k}": float(v) for k, v in critic_stats.items() if _is_number(v)})
        sync_began = now()
        paused_s = self.weights.sync(new_version)
        if self.rank == 0:
            metrics["time/weight_sync_s"] = now() - sync_began
            metrics["time/generation_paused_s"] = paused_s
            if self.cfg.rollout.weight_check != "off":  # the integrity gate: the trainer's digest, the engines'
                metrics["time/weight_digest_s"] = self.weights.digest_s
                metrics["time/weight_digest_engines_s"] = self.controller.fleet.digest_s
            if self.cfg.rollout.weight_sync == "tensors":  # the last update's bytes, as deltas and full weights
                fleet = self.controller.fleet
                metrics["weight_sync/delta_bytes"] = float(fleet.delta_bytes)
                metrics["weight_sync/full_bytes"] = float(fleet.full_bytes)
                metrics["time/weight_delta_s"] = self.weights.delta_s
            metrics.update(self._rollout_metrics(groups, packed, version, waited, train_s))
            self._record_samples(groups, version)
            self._record_completions(groups, version)
            metrics["time/step_s"] = now() - began  # from asking for the batch to handing the weights over
        return metrics

    def _pack(self, groups: list, version: int) -> PackedBatch:
        """The padding-free batch, stamped with the version it is trained at (``policy_version``) and, with
        ``actor.ppo_minibatches`` > 1, each sequence's mini-batch (groups whole, balanced by tokens)."""
        packed = pack_groups(groups)
        packed[POLICY_VERSION_KEY] = version
        k = self.cfg.actor.ppo_minibatches
        if k > 1:
            packed[MINIBATCH_KEY] = assign_minibatches(packed["seq_lens"], packed["group_index"], k)
        return packed.validate("the rollout controller's batch")

    def _check_minibatches(self) -> None:
        """Several optimizer steps per batch need a train engine that takes them (``areal check``'s own test)."""
        problem = minibatch_problem(self.cfg.actor, self.actor.capabilities)
        if problem is not None:
            raise ValueError(f"{problem.message}. Fix: {problem.hint}")

    def _check_optimizer_steps(self, role: str, stats: dict) -> None:
        """An engine that ignores mini-batches or epochs would silently train one step: refuse to go on."""
        expected = self.cfg.actor.ppo_minibatches * self.cfg.actor.ppo_epochs
        if expected > 1 and stats.get("n_optimizer_steps") != expected:
            raise RuntimeError(
                f"actor.ppo_minibatches={self.cfg.actor.ppo_minibatches} x actor.ppo_epochs="
                f"{self.cfg.actor.ppo_epochs} asks for {expected} optimizer steps per batch, but the {role} engine "
                f"({self.cfg.actor.backend!r}) reported n_optimizer_steps={stats.get('n_optimizer_steps')}: it does "
                f"not take mini-batches (areal_core.train_batches.update_plan). Fix: actor.ppo_minibatches=1 "
                f"actor.ppo_epochs=1, or a train engine that does")

    def _check_weight_sync(self, engines: list[Any]) -> None:
        """Refuse ``rollout.weight_sync: tensors`` that the engines cannot do (before anything starts)."""
        check_weight_sync(self.cfg, self.actor, engines)

    def _rollout_metrics(self, groups, packed, version: int, waited: float, train_s: float) -> dict[str, float]:
        # the columns may be tensors by now (the engines and the algorithm keep what they convert)
        lags = _token_lags(packed, version)
        m: dict[str, float] = {}
        m.update(summarize(as_list(packed["rewards"]), "reward"))
        trajectories = [t for g in groups for t in g.trajectories]
        # what this step trained, whichever engine: `areal plot --x samples` / `--x tokens` sum them
        m["train/samples"] = float(len(trajectories))
        m["train/tokens"] = float(len(packed["input_ids"]))
        # the tokens each trajectory trained on (its completion; every turn's, in a multi-turn episode)
        m.update(summarize([sum(t.loss_mask) for t in trajectories], "length"))
        reasons = [t.info.get("stop_reason") for t in trajectories if isinstance(t.info, dict)]
        if reasons and all(r is not None for r in reasons):  # workflows that report it (rlvr does)
            m["length/truncated_frac"] = sum(r == "length" for r in reasons) / len(reasons)
        m.update(summarize([version - g.start_version for g in groups], "staleness/episode_lag"))
        m.update(summarize([g.finished_at - g.admitted_at for g in groups], "rollout/episode_latency_s"))
        if lags.size:
            m["staleness/token_lag_max"] = float(lags.max())
            m["staleness/token_lag_mean"] = float(lags.mean())
            m.update({f"staleness/tokens_at_lag_{lag}": float(n) for lag, n in histogram(lags).items()})
        stats = self.controller.stats()
        m.update({f"rollout/{k}": float(v) for k, v in stats.items()})
        for transport, n in Counter(e.weight_transport(self.cfg.rollout.weight_sync)
                                    for e in self.controller.engines).items():
            m[f"weight_sync/servers_{transport}"] = float(n)
        m["time/wait_batch_s"] = waited
        m["time/train_s"] = train_s
        m["throughput/train_tokens_per_s"] = len(packed["input_ids"]) / train_s if train_s > 0 else 0.0
        tokens, since = stats["generated_tokens"], self.clock.now()
        before, before_t = self._last_generated
        m["throughput/gen_tokens_per_s"] = (tokens - before) / (since - before_t) if since > before_t else 0.0
        self._last_generated = (tokens, since)
        return m

    def _record_completions(self, groups, version: int) -> None:
        """The step's samples as text in completions.jsonl (``metrics.completions_every``), decoded with the
        workflow's tokenizer (the one that encoded its prompts); a workflow without one (a ``tokenizer``
        attribute with ``decode``) gives records with their counts and no text."""
        from areal_core.completions import append_records, completion_records, due

        step, cfg = self.step + 1, self.cfg.metrics
        if not due(step, cfg.completions_every):
            return
        records = completion_records(groups, step, version, self._decode, cfg.completions_per_step)
        append_records(self.run_dir, records)
        self._step_samples = records  # to the trackers that show them, after the step's metrics

    def _record_samples(self, groups, version: int) -> None:
        """One JSON line per step naming the data items it trained on (what resume is checked against)."""
        import json

        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step + 1, "version": version,
                                "items": [g.seq for g in groups]}) + "\n")


def _token_lags(packed: Any, version: int) -> Any:
    """``version`` minus the version of every token the policy produced, as a numpy array (the columns are lists or
    tensors of a whole batch: at hundreds of thousands of tokens a step, Python loops over them were a tenth of a
    simulated step's cost)."""
    import numpy

    def array(column: Any) -> Any:
        if hasattr(column, "detach"):
            column = column.detach().cpu().numpy()
        return numpy.asarray(column)

    versions, mask = array(packed["versions"]), array(packed["loss_mask"]).astype(bool)
    return version - versions[mask].astype(numpy.int64)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (the last two when installed)."""
    import random

    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass


def _is_number(value: Any) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_core.trainer", description="one train rank of an areal run")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    config_path = args.run_dir / "config.yaml"
    try:
        run = validate_run(str(config_path), [])
    except ProblemsError as exc:
        print(exc, file=sys.stderr)
        return 2
    if run.problems:
        print(format_problems(run.problems, str(config_path)), file=sys.stderr)
        return 2
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    print(f"areal trainer rank {rank}: {retain_freed_memory()}", file=sys.stderr, flush=True)
    if world > 1:
        import datetime

        import torch.distributed as dist

        import torch

        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        # Every collective of this group waits at most trainer.collective_timeout_s for the other ranks: a hung
        # rank (stopped, deadlocked) ends the run then, from the ranks still running, instead of holding it.
        timeout = datetime.timedelta(seconds=run.config.trainer.collective_timeout_s)
        dist.init_process_group(backend, timeout=timeout)
    # The launcher stops a run with SIGTERM (then SIGKILL after its grace period). Python's default for SIGTERM
    # ends the process at once, skipping every finally block and finalizer, so the weights staged in /dev/shm
    # (hundreds of MB) would outlive the run. As SystemExit they are cleaned up like at a normal exit.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    trainer = Trainer(run, args.run_dir, rank, world)
    try:
        trainer.fit(resume=args.resume)
    except (CheckpointSpaceError, CheckpointDamagedError) as exc:
        # A full disk or a damaged checkpoint is the user's to fix: the message names it and the way on.
        print(f"areal: the run stopped at step {trainer.step}: {exc}", file=sys.stderr)
        return 1
    except (StallError, RolloutError) as exc:
        # The data gave out or gave no signal: the user's to fix, so the message, not a traceback.
        # A workflow that crashed for any other reason keeps its traceback for the plugin's author.
        stalled = _server_timeout(exc)  # an episode whose server stopped answering: named below, not a traceback
        if isinstance(exc, RolloutError) and not isinstance(exc.__cause__, FilteredOutError) and stalled is None:
            raise
        print(f"areal: the run stopped at step {trainer.step}: {stalled or exc.__cause__ or exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 (only a server's timeout is answered here; the rest is raised)
        stalled = _server_timeout(exc)
        if stalled is not None:  # a server that stopped answering: the message says which, what and the fix
            print(f"areal: the run stopped at step {trainer.step}: {stalled}", file=sys.stderr)
            return 1
        if not isinstance(exc, RuntimeError) or world == 1 or not _collective_timed_out(exc):
            raise
        # A rank that stopped answering: the traceback only says that a receive timed out; say what and whom.
        others = ", ".join(f"actor-rank{r}" for r in range(world) if r != rank)
        print(f"areal trainer rank {rank}: waited trainer.collective_timeout_s = "
              f"{run.config.trainer.collective_timeout_s:g} s at step {trainer.step} for the other train rank(s) "
              f"({others}) in a collective, and gave up: one of them is hung or lost (its log shows where it "
              f"stopped). Fix: see their logs; if a step can legitimately keep a rank away longer, raise "
              f"trainer.collective_timeout_s. ({str(exc).strip().splitlines()[-1][:300]})", file=sys.stderr)
        return 1
    if world > 1:  # leave together, then end without the finalization that aborted finished ranks (areal_core.exits)
        import torch.distributed as dist

        from areal_core.exits import exit_now

        dist.barrier()
        exit_now(0)
    return 0


def _server_timeout(exc: BaseException) -> BaseException | None:
    """The :class:`~areal_core.api.inference.ServerTimeout` in ``exc``'s causes and contexts (an episode's, a
    weight update's), or None."""
    from areal_core.api.inference import ServerTimeout

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ServerTimeout):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _collective_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is torch.distributed's timeout of a collective (gloo: "Timed out waiting
    ... for recv operation"; nccl: "Watchdog caught collective operation timeout")."""
    while exc is not None:
        text = str(exc)
        if "Timed out waiting" in text or "collective operation timeout" in text:
            return True
        exc = exc.__cause__
    return False


def _distributed() -> bool:
    """Whether this process joined a torch.distributed group (imported and initialized: never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def run_main(argv: list[str] | None = None) -> None:
    """:func:`main`, ended as :func:`areal_core.exits.exit_now` ends a rank of a distributed group on every way
    out, a failure included: a rank that stopped with a message (a full checkpoint disk, a collective timeout) and
    then went through the interpreter's finalization was seen killed by SIGABRT ("terminate called without an
    active exception", the suite under `nice`), which the launcher reports as a crash instead of the message."""
    import traceback

    from areal_core.exits import exit_now

    try:
        code = main(argv)
    except SystemExit as exc:  # SIGTERM (_exit_on_sigterm), or a sys.exit deeper down
        if not _distributed():
            raise
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
        exit_now(code)
    except BaseException:
        if not _distributed():
            raise
        traceback.print_exc()  # what the interpreter would print, before ending without its finalization
        exit_now(1)
    if _distributed():
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    run_main()
