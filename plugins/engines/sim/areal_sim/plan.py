"""``areal plan``: the split between inference and training GPUs, and the staleness bound, chosen by simulation.

Given a run's config (its backends, batch, group size and algorithm), a GPU count and a profile, the planner
searches:

- the inference GPUs, in whole servers of the profile's tensor-parallel size (the profile's decode table holds
  for that layout); the rest train;
- the training GPUs' layout: tensor size t and pipeline size p (1, 2, 4, 8; t within a node of 8), the rest
  data-parallel. For a split, the layout is the fastest optimizer step by the profile's cost model
  (``TrainModel.step_s``: the compute, a pipeline's fill and drain, tensor parallelism's all-reduces over NVLink,
  the gradient all-reduce of each rank's share between nodes) among the layouts the validation accepts: the
  training side's time depends on the layout alone, so one simulation per split scores it. ``exhaustive=True``
  simulates every layout of every split instead;
- the staleness bound ``rollout.max_head_offpolicyness`` over ``--eta`` (default 0, 1, 2, 4, 8).

Each candidate is scored by a simulation (:func:`areal_sim.simulate.run_simulation`: the real controller and
trainer) run until its figure is steady (:class:`areal_sim.simulate.Steady`: the second-half rate has stopped
moving by more than ``tolerance``, at most ``steps`` steps), samples/s over the second half of its steps
(``steady_samples_per_s``). A fixed 5-6 steps ended inside the pipeline's filling, which is longest at a large eta
and a large inference share (``benchmarks/simulator.md``, the horizon table). For each eta the split is found by a ternary
search over the number of servers (throughput rises while generation is the bottleneck and falls once training is:
one peak), refined by scoring the neighbours of the best point, so a plan costs tens of simulations, not one per
split; ``exhaustive=True`` scores every split (what the tests compare the search with).

Before it is scored, every candidate's allocation, written for the config's own backends (``vllm:d24t2+fsdp:d16``),
is put to the same validation a real run gets (``areal_core.config.validate.validate_run``, the plugins'
``areal_validate_parallelism`` hooks included): a layout they refuse is never proposed, and the reasons are kept.

What is not searched, and why: the inference servers' own layout, fixed by the profile's measured decode table;
the train layout of a profile without ``train.layers``, ``hidden`` and ``tp_link_gbps`` (the CPU profile), whose
tensor and pipeline parallelism would be an ideal split of the compute and always win; whether a layout fits in
memory (the validation hooks judge placement, the profiles hold no memory model).
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from areal_sim.profile import ProfileError, load_profile
from areal_sim.simulate import SimulationError

DEFAULT_ETAS = (0, 1, 2, 4, 8)
# tensor and pipeline sizes searched: at most 8, so a tensor-parallel group stays within a node of 8 GPUs (its
# all-reduces run over NVLink)
SIZES = (1, 2, 4, 8)


@dataclass
class Candidate:
    servers: int
    eta: int
    inference_gpus: int
    train_gpus: int
    allocation: str  # for the config's own backends
    t: int = 1  # the training GPUs' tensor and pipeline sizes
    p: int = 1
    samples_per_s: float | None = None
    refused: str | None = None  # the validation's reasons, when it refused the layout
    report: dict | None = field(default=None, repr=False)


@dataclass
class Plan:
    best: Candidate
    runner_up: Candidate | None
    scored: list[Candidate]
    refused: list[Candidate]
    simulations: int

    def lines(self) -> list[str]:
        b = self.best
        out = [f"allocation: {b.allocation}    rollout.max_head_offpolicyness={b.eta}",
               f"  predicted {b.samples_per_s:.2f} samples/s ({b.inference_gpus} GPUs serving, {b.train_gpus} "
               f"training as d{b.train_gpus // (b.t * b.p)} x t{b.t} x p{b.p})"]
        if self.runner_up is not None:
            r = self.runner_up
            out.append(f"runner-up: {r.allocation}    rollout.max_head_offpolicyness={r.eta}: {r.samples_per_s:.2f} "
                       f"samples/s ({r.samples_per_s / self.best.samples_per_s:.0%} of the best)")
        if self.refused:
            reasons = sorted({c.refused for c in self.refused if c.refused})
            out.append(f"refused by the plugins' validation: {len(self.refused)} layout(s), e.g. {reasons[0]}")
        out.append(f"{self.simulations} simulations")
        return out


def _allocation(raw: dict, servers: int, tp: int, train_gpus: int, t: int = 1, p: int = 1) -> str:
    from areal_sim.simulate import _layout

    infer = (raw.get("rollout") or {}).get("backend", "local")
    train = (raw.get("actor") or {}).get("backend", "fsdp")
    return f"{infer}:d{servers}" + (f"t{tp}" if tp > 1 else "") + f"+{train}:" + _layout(train_gpus, t, p)


class Planner:
    """Scores candidates by simulation (memoised) after the validation hooks accept their layout."""

    def __init__(self, config_path: str | None, overrides: list[str], *, gpus: int, profile: str,
                 steps: int = 60, tolerance: float = 0.02, token_scale: int = 100,
                 simulate: Callable[[list[str]], dict] | None = None) -> None:
        from areal_core.config.load import read_raw
        from areal_core.problems import ProblemsError

        try:
            self.profile = load_profile(profile)
        except ProfileError as exc:
            raise SimulationError(str(exc)) from None
        self.config_path, self.overrides = config_path, list(overrides)
        self.raw, problems = read_raw(config_path, self.overrides)
        if problems:
            raise ProblemsError(problems, config_path or "the overrides")
        self.gpus, self.profile_name, self.steps, self.tolerance = gpus, profile, steps, tolerance
        self.token_scale = token_scale
        self.tp = self.profile.inference.tp
        if gpus < self.tp + 1:
            raise SimulationError(f"--gpus {gpus}: a plan needs at least one inference server ({self.tp} GPU(s) for "
                                  f"{self.profile.name}) and one training GPU")
        self.max_servers = (gpus - 1) // self.tp
        self._simulate = simulate or self._run
        self._scores: dict[tuple[int, int, int, int], Candidate] = {}
        self._picked: dict[tuple[int, int], tuple[int, int]] = {}  # (servers, eta) -> the cost model's (t, p)
        self._refusals: dict[tuple[str, int], str | None] = {}  # (allocation, eta) -> the validation's reasons
        self.simulations = 0
        # modelled tokens an optimizer step trains: what the cost model ranks the train layouts by
        rollout, actor = self.raw.get("rollout") or {}, self.raw.get("actor") or {}
        cap = min(self.profile.lengths.cap, int((rollout.get("sampling") or {}).get("max_new_tokens",
                                                                                     self.profile.lengths.cap)))
        mean = min(self.profile.lengths.mean(), cap)
        self.step_tokens = (int(rollout.get("batch_size", 8)) * int(rollout.get("group_size", 8))
                            * (self.profile.lengths.prompt + mean) / max(int(actor.get("ppo_minibatches", 1)), 1))

    def candidate(self, servers: int, eta: int, t: int = 1, p: int = 1) -> Candidate:
        inference = servers * self.tp
        return Candidate(servers, eta, inference, self.gpus - inference,
                         _allocation(self.raw, servers, self.tp, self.gpus - inference, t, p), t, p)

    def layouts(self, train_gpus: int) -> list[tuple[int, int]]:
        """The (t, p) the plan considers for ``train_gpus``: only (1, 1) when the profile does not model them."""
        if not self.profile.train.models_tp:
            return [(1, 1)]
        return [(t, p) for t in SIZES for p in SIZES if train_gpus % (t * p) == 0]

    def step_s(self, train_gpus: int, t: int, p: int) -> float:
        return self.profile.train.step_s(self.step_tokens, train_gpus // (t * p), t, p)

    def layout(self, servers: int, eta: int) -> tuple[int, int]:
        """The train layout for a split: the fastest step by the cost model among those the validation accepts
        (the refused are kept, so the plan reports them)."""
        key = (servers, eta)
        if key not in self._picked:
            train_gpus = self.gpus - servers * self.tp
            self._picked[key] = (1, 1)  # when every layout is refused: scored as refused
            # fastest first (fewer ranks per replica on a tie); validated in that order until one is accepted
            for _, _, t, p in sorted((self.step_s(train_gpus, t, p), t * p, t, p)
                                     for t, p in self.layouts(train_gpus)):
                c = self.candidate(servers, eta, t, p)
                c.refused = self._refused(c)
                if c.refused is None:
                    self._picked[key] = (t, p)
                    break
                self._scores.setdefault((servers, eta, t, p), c)
        return self._picked[key]

    def refusal(self, c: Candidate) -> str | None:
        """What the plugins' validation says against ``c``'s allocation in the config's own backends, if anything
        about placement (problems unrelated to the layout, such as a model path this machine lacks, are not the
        planner's to judge)."""
        from areal_core.config.validate import validate_run

        run = validate_run(self.config_path, [*self.overrides, f"allocation={c.allocation}",
                                              f"rollout.max_head_offpolicyness={c.eta}"])
        placement = [p for p in run.problems if (p.key or "").startswith("allocation") or "parallel" in p.code
                     or p.code.startswith("core.allocation") or p.code.startswith("core.no-")]
        return "; ".join(f"[{p.code}] {p.message}" for p in placement) or None

    def _refused(self, c: Candidate) -> str | None:
        """:meth:`refusal`, once per allocation and eta."""
        key = (c.allocation, c.eta)
        if key not in self._refusals:
            self._refusals[key] = self.refusal(c)
        return self._refusals[key]

    def score(self, servers: int, eta: int, t: int | None = None, p: int | None = None) -> Candidate:
        """The split scored by simulation, with the train layout (t, p) given or the cost model's pick."""
        if t is None or p is None:
            t, p = self.layout(servers, eta)
        key = (servers, eta, t, p)
        if key not in self._scores:
            c = self.candidate(servers, eta, t, p)
            c.refused = self._refused(c)
            if c.refused is None:
                c.report = self._simulate([*self.overrides, f"sim.gpus={self.gpus}",
                                           f"sim.inference_gpus={c.inference_gpus}", f"sim.profile={self.profile_name}",
                                           f"sim.token_scale={self.token_scale}", f"rollout.max_head_offpolicyness={eta}",
                                           f"trainer.total_steps={self.steps}", f"sim.train_t={t}", f"sim.train_p={p}",
                                           f"sim.steady_tolerance={self.tolerance}"])
                c.samples_per_s = c.report["steady_samples_per_s"]
                self.simulations += 1
            self._scores[key] = c
        return self._scores[key]

    def value(self, servers: int, eta: int) -> float:
        c = self.score(servers, eta)
        return c.samples_per_s if c.samples_per_s is not None else -math.inf

    def _run(self, overrides: list[str]) -> dict:
        from areal_sim.simulate import run_simulation

        with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
            return run_simulation(self.config_path, overrides, folder)

    def accepted(self, servers: int, eta: int) -> bool:
        """Whether some train layout of this split passes the plugins' validation (validated, not simulated)."""
        t, p = self.layout(servers, eta)
        return self._refused(self.candidate(servers, eta, t, p)) is None

    def search(self, eta: int) -> None:
        """Ternary search for ``eta`` over the server counts the plugins' validation accepts (a launcher that gives
        servers and train ranks whole nodes accepts a few splits only; searching the refused ones as -inf would
        break the search's one-peak premise), then the neighbours of the best."""
        counts = [s for s in range(1, self.max_servers + 1) if self.accepted(s, eta)]
        if not counts:
            return
        lo, hi = 0, len(counts) - 1
        while hi - lo > 2:
            a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            if self.value(counts[a], eta) < self.value(counts[b], eta):
                lo = a + 1
            else:
                hi = b - 1
        best = max(range(lo, hi + 1), key=lambda i: self.value(counts[i], eta))
        for i in (best - 2, best - 1, best + 1, best + 2):  # a plateau can hide the peak from the thirds
            if 0 <= i < len(counts):
                self.value(counts[i], eta)

    def plan(self, etas: tuple[int, ...] = DEFAULT_ETAS, exhaustive: bool = False) -> Plan:
        for eta in etas:
            if exhaustive:
                for s in range(1, self.max_servers + 1):
                    for t, p in self.layouts(self.gpus - s * self.tp):
                        self.score(s, eta, t, p)
            else:
                self.search(eta)
        scored = sorted((c for c in self._scores.values() if c.samples_per_s is not None),
                        key=lambda c: -c.samples_per_s)
        refused = [c for c in self._scores.values() if c.refused is not None]
        if not scored:
            raise SimulationError(f"no layout of {self.gpus} GPUs passed the plugins' validation: "
                                  f"{refused[0].refused if refused else 'none was tried'}")
        best = scored[0]
        runner = next((c for c in scored[1:] if (c.servers, c.eta, c.t, c.p) != (best.servers, best.eta, best.t, best.p)),
                      None)
        return Plan(best, runner, scored, refused, self.simulations)
