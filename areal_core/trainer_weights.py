"""The trainer's weight hand-over: new weights from the train engine to the inference engines.

This part owns one thing: getting the weights of each new version to the
inference engines (``rollout.weight_sync``: a safetensors folder on disk, or
tensors in memory), whether the trainer waits for them to load or goes on
beside the load (eta > 0), and the hand-over of restored weights at resume.
Every train rank takes part (the export is collective); rank 0, which owns
the rollout controller, hands them over.

It also feeds the integrity gate (``rollout.weight_check``,
:mod:`areal_core.weight_check`): rank 0 digests what it sends, which the
controller matches against each engine's digest of what it holds, and at
probe updates every rank scores the parity probe the engines sampled.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from areal_core.pending import PendingCall
from areal_core.rollout import RolloutController
from areal_core.threads import serial_torch
from areal_core.weight_check import SentDigests, WeightCheckError, compare_probe, digest_weights, probe_due
from areal_core.weight_delta import MAX_DELTA_SHARE, WeightDelta, make_delta

WEIGHT_BUCKET_BYTES = 256 * 1024**2  # rollout.weight_sync=tensors: the most bytes gathered at once
# A weight export beside training, then the engines' update: each waits 600 s at most on its own
BACKGROUND_SYNC_TIMEOUT_S = 1200.0


def check_weight_sync(cfg: Any, actor: Any, engines: list[Any]) -> None:
    """``rollout.weight_sync: tensors`` needs a train engine that exports them and engines that take them."""
    if cfg.rollout.weight_sync != "tensors":
        return
    refusing = [f"actor.backend {cfg.actor.backend!r} does not declare 'export_tensors'"] \
        if "export_tensors" not in actor.capabilities else []
    if engines and "update_weights_from_tensors" not in engines[0].capabilities:  # one backend for all
        refusing.append(f"rollout.backend {cfg.rollout.backend!r} does not declare "
                        "'update_weights_from_tensors'")
    if refusing:
        raise ValueError(f"rollout.weight_sync: 'tensors' cannot be used: {'; '.join(refusing)}. "
                         "Fix: rollout.weight_sync=disk (the default)")


def weight_check_line(cfg: Any, engines: list[Any]) -> str:
    """What the integrity gate (``rollout.weight_check``) will check in this run, for the log."""
    r = cfg.rollout
    if r.weight_check == "off":
        return "weight check: off (rollout.weight_check=off): nothing checks that the engines serve the weights sent"
    probe = (f"the parity probe at the first update and every {r.weight_probe_every}th"
             if r.weight_probe_every else "no parity probe (rollout.weight_probe_every=0)")
    if engines and "weight_digest" in engines[0].capabilities:  # one backend for all
        digests = f"digests of every tensor ({r.weight_check}) after every update"
    else:
        digests = (f"no digests: rollout.backend {r.backend!r} does not declare 'weight_digest' (docs/engines.md, "
                   "the integrity gate)")
    return f"weight check: {digests}; {probe}"


class WeightHandOver:
    def __init__(self, cfg: Any, actor: Any, run_dir: Path, rank: int, world_size: int,
                 broadcast: Callable[[Any], Any] | None = None) -> None:
        self.cfg, self.actor, self.run_dir = cfg, actor, Path(run_dir)
        self.rank, self.world_size = rank, world_size
        self.broadcast = broadcast or (lambda obj: obj)  # rank 0's object to every rank (the parity probe)
        self.controller: RolloutController | None = None  # rank 0's, once it is built
        self._pending: PendingCall | None = None  # a weight update the engines are still applying (eta > 0)
        self.updates = 0  # hand-overs in this process: the parity probe runs at the first and every N-th
        self.digest_s = 0.0  # rank 0's time to digest the last weights it sent
        self.probe_s = 0.0  # the last parity probe's scoring on this rank
        self._base: tuple[int, dict] | None = None  # rollout.weight_delta: the version last sent and its tensors
        self.delta_s = 0.0  # rank 0's time to make the last delta
        self._digester: ThreadPoolExecutor | None = None  # rank 0: digests what it sends beside the hand-over

    def sync(self, version: int, wait: bool | None = None) -> float:
        """Hand the new weights to the inference engines (collective); rank 0 returns the seconds paused.

        ``rollout.weight_sync: disk`` writes a safetensors folder per version and
        the engines load it; ``tensors`` gathers full tensors in buckets
        (``export_tensors``) into rank 0's memory, then the engines take them in
        memory. Generation pauses only for the hand-over, not for the gather.

        At eta > 0 the trainer does not wait for the engines to load: it goes
        on to its next batch while they do (admission follows the version the
        engines hold, so staleness stays bounded), and waits for this update
        only before the next one, an evaluation or a checkpoint. The seconds
        returned are then those of the previous update's pause. At eta = 0 the
        next batch needs the new weights anyway, so the call waits (as it
        does with ``wait=True``: the hand-over of restored weights at resume).

        With tensors at eta > 0 in a one-process trainer whose engine declares
        ``export_beside_training``, the export itself also leaves this thread:
        the engine holds the weights from the ``export_tensors`` call, a
        background thread reads them and hands them over while this one
        trains on, and the engine's next optimizer step waits for the read to
        end. ``time/weight_sync_s`` is then only the hand-off.

        The integrity gate (``rollout.weight_check``): rank 0 digests what it
        sends for the controller to match against each engine's digests (before
        generation resumes, or beside it with ``rollout.weight_check_holds:
        training``, the hand-out then waiting for the verdict; :meth:`finish`
        waits for it too and raises its failure), and
        at probe updates (the first, then every ``weight_probe_every``-th) the
        call waits, whatever eta, and every rank scores the engines' parity
        probe before generation resumes (:meth:`_probe`). With tensors and
        ``rollout.weight_delta: auto``, engines that hold the previous version
        get only what changed (:meth:`_delta`).
        """
        paused_s = self.finish()
        self.updates += 1
        check = self.cfg.rollout.weight_check
        # The parity probe is judged before generation resumes: a probe update is always waited for
        probe = check != "off" and probe_due(self.updates, self.cfg.rollout.weight_probe_every)
        wait = (self.cfg.rollout.max_head_offpolicyness == 0 or probe) if wait is None else (wait or probe)
        beside = not wait and self.world_size == 1 and "export_beside_training" in self.actor.capabilities
        if self.cfg.rollout.weight_sync == "tensors":
            into = self._destination(version)
            buckets = self.actor.export_tensors(WEIGHT_BUCKET_BYTES, **({"into": into} if into is not None else {}))
            if beside:
                # The export itself goes on beside the next batch's training, on a thread of its own: on a CPU
                # it is a full pass over the weights that another core can do. The engine holds its next
                # optimizer step until the export has read them.
                def export_and_send() -> float:
                    serial_torch()  # see areal_core.threads: a helper thread's torch ops run on one thread
                    named = [pair for bucket in buckets for pair in bucket]
                    if into is not None:
                        into.complete()
                    sent = self._digests_beside(version, named)
                    return self.controller.update_weights_from_tensors(
                        named, version, wait=False, sent=sent, delta=self._delta(named, version)).result()

                self._pending = PendingCall.on_thread(
                    export_and_send, BACKGROUND_SYNC_TIMEOUT_S,
                    f"a background call to hand the weights of version {version} to the inference engines")
                return paused_s
            named = [pair for bucket in buckets for pair in bucket]
            if into is not None:
                into.complete()
            if self.rank == 0:
                # export_tensors hands out copies (its contract), so the next optimizer step cannot change what the
                # engines are still reading at eta > 0
                sent = self._digests_beside(version, named)
                pending = self.controller.update_weights_from_tensors(named, version, wait=wait, sent=sent,
                                                                      probe=probe, delta=self._delta(named, version))
        else:
            weights = self.run_dir / "weights" / f"v{version:06d}"
            self.actor.export_to_disk(str(weights))  # collective: every rank takes part in the gather
            if self.rank == 0:
                sent = self._digests_beside(version, str(weights))
                pending = self.controller.update_weights_from_disk(str(weights), version, wait=wait, sent=sent,
                                                                   probe=probe)
                _prune_weights(self.run_dir / "weights", keep=2)  # the two newest: the one loading now is kept
        if probe:
            self._probe(version)  # collective: every rank scores the probe
        if self.rank != 0:
            return 0.0
        if wait:
            return pending
        self._pending = pending
        return paused_s

    def _destination(self, version: int) -> Any:
        """Rank 0: where the routed engines let the export of ``version`` write straight away
        (``InferenceEngine.export_destination``: the local engine's /dev/shm stage slot), when every one gives the
        same and the train engine declares ``export_into``; else None. Not with ``rollout.elastic``: a server
        joining is handed the kept tensors of the version before, which must not lie in a slot being exported
        into."""
        if self.rank != 0 or self.controller is None or "export_into" not in self.actor.capabilities or \
                self.cfg.rollout.elastic.enabled:
            return None
        offers = [offer(version) if (offer := getattr(engine, "export_destination", None)) else None
                  for engine in self.controller.engines]  # duck-typed engines without the hook offer nothing
        return offers[0] if offers and offers[0] is not None and all(o is offers[0] for o in offers) else None

    def _delta(self, named: list, version: int) -> WeightDelta | None:
        """``rollout.weight_delta: auto``: the change from the version sent last, when every routed engine takes
        deltas (rank 0; each engine gets it only if it holds that version, else the full tensors). Keeps these
        tensors (copies: export_tensors' contract) as the next base."""
        engines = self.controller.engines
        if self.cfg.rollout.weight_delta != "auto" or not engines or \
                not all("update_weights_from_delta" in e.capabilities for e in engines):
            self._base = None
            return None
        base, self._base = self._base, (version, dict(named))
        if base is None:
            return None
        began = time.monotonic()
        delta = make_delta(base[1], named, base[0], version)
        self.delta_s = time.monotonic() - began
        return delta if delta.nbytes <= MAX_DELTA_SHARE * delta.full_nbytes else None

    def _digests_beside(self, version: int, weights: str | list) -> Future | SentDigests | None:
        """:meth:`_digests` on a thread of its own, while the engines load (the controller waits for it before it
        compares); None when the check is off. On a virtual clock (the simulator) on this thread: a thread the
        clock does not know of would let the loop jump past its work."""
        if self.cfg.rollout.weight_check == "off":
            return None
        if getattr(getattr(self.controller, "clock", None), "virtual", False):
            return self._digests(version, weights)
        if self._digester is None:
            self._digester = ThreadPoolExecutor(1, thread_name_prefix="areal-digest", initializer=serial_torch)
        return self._digester.submit(self._digests, version, weights)

    def _digests(self, version: int, weights: str | list) -> SentDigests | None:
        """Rank 0's digests of what it sends (``rollout.weight_check``: a folder's path or (name, tensor) pairs), or
        None when the check is off. The routed engines' backend says how (``InferenceEngine.sent_digests``: the
        trainer's names and hash, or what its servers will report in their own layout)."""
        mode = self.cfg.rollout.weight_check
        if mode == "off":
            return None
        # the run's clock: on the simulator's virtual clock this work takes no modelled time, and a wall-clock
        # figure among simulated metrics would make the same config simulate to different numbers
        now = getattr(getattr(self.controller, "clock", None), "now", time.monotonic)
        began = now()
        engines = self.controller.engines if self.controller is not None else []
        digest = getattr(engines[0], "sent_digests", None) if engines else None
        digests = digest(weights, mode) if digest is not None else digest_weights(weights, mode)
        self.digest_s = now() - began
        return SentDigests(version, mode, digests, self.digest_s)

    def _probe(self, version: int) -> None:
        """Score the parity probe the engines sampled after loading ``version`` (generation is held meanwhile)
        with the train engine's ``forward_logprobs`` on every rank; rank 0 compares per token and resumes
        generation, the servers whose logprobs differ out of routing (the run stops naming them, or elastic,
        they are reloaded)."""
        from areal_core.api.workflow import Trajectory
        from areal_core.config.dtype import resolve_dtype
        from areal_core.rollout.batch import EpisodeGroup, pack_groups
        from areal_core.train_batches import POLICY_VERSION_KEY, as_list

        failed: dict[str, WeightCheckError] = {}
        try:
            answers = None
            if self.rank == 0:
                answers = {name: (list(r.input_ids), list(r.output_ids), list(r.output_logprobs))
                           for name, r in self.controller.probe_results.items() if r.output_ids}
            answers = self.broadcast(answers)
            if not answers:
                return
            began = time.monotonic()
            trajectories = [Trajectory(tokens=p + o, loss_mask=[0] * len(p) + [1] * len(o),
                                       logprobs=[0.0] * len(p) + lp, versions=[-1] * len(p) + [version] * len(o),
                                       reward=0.0) for p, o, lp in answers.values()]
            packed = pack_groups([EpisodeGroup(0, None, version, trajectories, 0.0, 0.0)])
            packed[POLICY_VERSION_KEY] = version
            scored = as_list(self.actor.forward_logprobs(packed, 1.0)["logprobs"])
            self.probe_s = time.monotonic() - began
            dtype = resolve_dtype(self.cfg.model.dtype)
            for (name, (prompt, out, engine_lp)), start in zip(answers.items(), packed.cu_seqlens):
                mine = [float(x) for x in scored[start + len(prompt):start + len(prompt) + len(out)]]
                differences = compare_probe(out, engine_lp, mine, dtype)
                if differences:
                    failed[name] = WeightCheckError(name, version, f"the parity probe: {len(out)} tokens sampled at "
                                                    "temperature 1 from a fixed prompt, scored by the trainer",
                                                    differences)
        finally:
            if self.rank == 0:
                self.controller.release(failed)

    def hand_over_restored(self) -> None:
        """Resume: the engines started from the base model; send them the restored weights (collective) before
        the first episode is admitted, and check they serve that version, so every stamped version is true."""
        version = self.actor.version
        began = time.monotonic()
        self.sync(version, wait=True)
        if self.rank != 0:
            return
        serving = {getattr(e, "address", f"engine {i}"): e.version for i, e in enumerate(self.controller.engines)}
        if self.controller.version != version or any(v != version for v in serving.values()):
            raise RuntimeError(f"resume: handed the restored weights of version {version} to the inference engines, "
                               f"but the controller is at version {self.controller.version} and the engines "
                               f"report {serving}")
        print(f"resume: the inference engines serve the restored weights (version {version}, handed over in "
              f"{time.monotonic() - began:.1f} s)", flush=True)

    def finish(self) -> float:
        """Wait for the weight update still running on the engines (rank 0, eta > 0), and for its digest check
        when that runs beside generation (``rollout.weight_check_holds: training``; its failure is raised here):
        the seconds generation was paused for it."""
        pending, self._pending = self._pending, None
        paused_s = 0.0 if pending is None else pending.result()
        if self.controller is not None:
            self.controller.settle_weight_check()
        return paused_s


def _prune_weights(folder: Path, keep: int) -> None:
    versions = sorted(p for p in folder.glob("v*") if p.is_dir())
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
