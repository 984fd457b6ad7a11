"""``areal plan``: the split between inference and training GPUs, and the staleness bound, chosen by simulation.

Given a run's config (its backends, batch, group size and algorithm), a GPU count and a profile, the planner
searches:

- the inference GPUs, in whole servers of the profile's tensor-parallel size (the profile's decode table holds
  for that layout); the rest train, data-parallel;
- the staleness bound ``rollout.max_head_offpolicyness`` over ``--eta`` (default 0, 1, 2, 4, 8).

Each candidate is scored by a short simulation (:func:`areal_sim.simulate.run_simulation`: the real controller
and trainer), samples/s over the second half of its steps (``steady_samples_per_s``). For each eta the split is found by a ternary
search over the number of servers (throughput rises while generation is the bottleneck and falls once training is:
one peak), refined by scoring the neighbours of the best point, so a plan costs tens of simulations, not one per
split; ``exhaustive=True`` scores every split (what the tests compare the search with).

Before it is scored, every candidate's allocation, written for the config's own backends (``vllm:d24t2+fsdp:d16``),
is put to the same validation a real run gets (``areal_core.config.validate.validate_run``, the plugins'
``areal_validate_parallelism`` hooks included): a layout they refuse is never proposed, and the reasons are kept.

What is not searched, and why: tensor and pipeline parallelism of the train engine, whose costs the profiles do
not model (the simulated train engine takes them as an ideal split of the compute, which would always favour them);
the inference servers' own layout, fixed by the profile's measured decode table.
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


@dataclass
class Candidate:
    servers: int
    eta: int
    inference_gpus: int
    train_gpus: int
    allocation: str  # for the config's own backends
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
        out = [f"allocation: {self.best.allocation}    rollout.max_head_offpolicyness={self.best.eta}",
               f"  predicted {self.best.samples_per_s:.2f} samples/s ({self.best.inference_gpus} GPUs serving, "
               f"{self.best.train_gpus} training)"]
        if self.runner_up is not None:
            r = self.runner_up
            out.append(f"runner-up: {r.allocation}    rollout.max_head_offpolicyness={r.eta}: {r.samples_per_s:.2f} "
                       f"samples/s ({r.samples_per_s / self.best.samples_per_s:.0%} of the best)")
        if self.refused:
            reasons = sorted({c.refused for c in self.refused if c.refused})
            out.append(f"refused by the plugins' validation: {len(self.refused)} layout(s), e.g. {reasons[0]}")
        out.append(f"{self.simulations} simulations")
        return out


def _allocation(raw: dict, servers: int, tp: int, train_gpus: int) -> str:
    infer = (raw.get("rollout") or {}).get("backend", "local")
    train = (raw.get("actor") or {}).get("backend", "fsdp")
    return f"{infer}:d{servers}" + (f"t{tp}" if tp > 1 else "") + f"+{train}:d{train_gpus}"


class Planner:
    """Scores candidates by simulation (memoised) after the validation hooks accept their layout."""

    def __init__(self, config_path: str | None, overrides: list[str], *, gpus: int, profile: str,
                 steps: int = 6, token_scale: int = 100,
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
        self.gpus, self.profile_name, self.steps = gpus, profile, steps
        self.token_scale = token_scale
        self.tp = self.profile.inference.tp
        if gpus < self.tp + 1:
            raise SimulationError(f"--gpus {gpus}: a plan needs at least one inference server ({self.tp} GPU(s) for "
                                  f"{self.profile.name}) and one training GPU")
        self.max_servers = (gpus - 1) // self.tp
        self._simulate = simulate or self._run
        self._scores: dict[tuple[int, int], Candidate] = {}
        self.simulations = 0

    def candidate(self, servers: int, eta: int) -> Candidate:
        inference = servers * self.tp
        return Candidate(servers, eta, inference, self.gpus - inference,
                         _allocation(self.raw, servers, self.tp, self.gpus - inference))

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

    def score(self, servers: int, eta: int) -> Candidate:
        key = (servers, eta)
        if key not in self._scores:
            c = self.candidate(servers, eta)
            c.refused = self.refusal(c)
            if c.refused is None:
                c.report = self._simulate([*self.overrides, f"sim.gpus={self.gpus}",
                                           f"sim.inference_gpus={c.inference_gpus}", f"sim.profile={self.profile_name}",
                                           f"sim.token_scale={self.token_scale}", f"rollout.max_head_offpolicyness={eta}",
                                           f"trainer.total_steps={self.steps}"])
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

    def search(self, eta: int) -> None:
        """Ternary search over the servers for ``eta``, then the neighbours of the best."""
        lo, hi = 1, self.max_servers
        while hi - lo > 2:
            a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            if self.value(a, eta) < self.value(b, eta):
                lo = a + 1
            else:
                hi = b - 1
        best = max(range(lo, hi + 1), key=lambda s: self.value(s, eta))
        for s in (best - 2, best - 1, best + 1, best + 2):  # a plateau can hide the peak from the thirds
            if 1 <= s <= self.max_servers:
                self.value(s, eta)

    def plan(self, etas: tuple[int, ...] = DEFAULT_ETAS, exhaustive: bool = False) -> Plan:
        for eta in etas:
            if exhaustive:
                for s in range(1, self.max_servers + 1):
                    self.value(s, eta)
            else:
                self.search(eta)
        scored = sorted((c for c in self._scores.values() if c.samples_per_s is not None),
                        key=lambda c: -c.samples_per_s)
        refused = [c for c in self._scores.values() if c.refused is not None]
        if not scored:
            raise SimulationError(f"no layout of {self.gpus} GPUs passed the plugins' validation: "
                                  f"{refused[0].refused if refused else 'none was tried'}")
        runner = next((c for c in scored[1:] if (c.servers, c.eta) != (scored[0].servers, scored[0].eta)), None)
        return Plan(scored[0], runner, scored, refused, self.simulations)
