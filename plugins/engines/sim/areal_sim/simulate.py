"""``areal simulate``: a run's own config, the real controller and trainer, simulated engines, a virtual clock.

The config a real run takes is read as it is (with its overrides); what
simulation needs replaces what needs hardware:

- the inference and train backends become ``sim`` and ``sim_train`` (the profile's latencies), the
  allocation ``sim:d{servers}t{tp}+sim:d{train GPUs}`` for ``sim.gpus`` GPUs of which
  ``sim.inference_gpus`` (default: the share the config's own allocation gives
  inference) serve, in servers of the profile's tensor-parallel size;
- dataset, workflow and reward become the simulated workload
  (:mod:`areal_sim.workload`): no model, tokenizer or text;
- lengths are in modelled tokens and each token id stands for
  ``sim.token_scale`` of them (``rollout.sampling.max_new_tokens`` is divided by it);
- no evaluation, no checkpoints but the last.

Everything the config says about the algorithm and the controller (batch size,
group size, ``max_head_offpolicyness``, concurrency, pacing, mini-batches and
epochs, total steps, weight sync) is kept, and runs through the same code as a
real run: :class:`areal_core.trainer.Trainer` with a
:class:`areal_core.clock.VirtualClock`. The report (``simulation.json`` in the
run folder) gives samples/s and trained tokens/s, GPU utilisation and waiting per
role, the staleness histogram, and the simulator's own cost per episode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from areal_sim.profile import ProfileError, load_profile

DEFAULT_PROFILE = "qwen2.5-7b-h800"


class SimulationError(ValueError):
    """A simulation setting that cannot be used; the message names the key, the value and the fix."""


@dataclass(frozen=True)
class SimSettings:
    gpus: int | None = None  # None: the config's own allocation's count (at least 2)
    inference_gpus: int | None = None
    profile: str = DEFAULT_PROFILE
    token_scale: int = 100
    dataset_size: int = 1_000_000
    success_mean: float = 0.5  # the items' success rates: Beta with this mean and concentration (a + b)
    success_concentration: float = 1.4
    train_t: int = 1  # the simulated actor's tensor- and pipeline-parallel sizes (the rest of its GPUs: d)
    train_p: int = 1
    step_cpu_ms: float | None = None  # the serving engine's CPU per decode step; None: the profile's step_cpu_s
    colocate: bool = False  # generation and training in turns on all the GPUs (the synchronous baseline of verl)
    # stop once the second-half rate has stopped moving by more than this share (0: run trainer.total_steps);
    # trainer.total_steps is then the most steps simulated (see Steady)
    steady_tolerance: float = 0.0

    @classmethod
    def from_overrides(cls, items: list[str]) -> tuple[SimSettings, list[str]]:
        """The ``sim.*`` overrides, and the others (the run config's) in their order."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        rest = []
        for item in items:
            key, sep, value = item.partition("=")
            if not key.startswith("sim."):
                rest.append(item)
                continue
            name = key[len("sim."):]
            if name not in fields or not sep:
                raise SimulationError(f"{key}: not a simulation setting. Fix: one of "
                                      f"{', '.join('sim.' + n + '=...' for n in fields)}")
            if name == "profile":
                values[name] = value
                continue
            if fields[name].type == "bool":
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise SimulationError(f"{key}={value}: must be true or false")
                values[name] = value.lower() in ("true", "1", "yes")
                continue
            if fields[name].type.startswith("float"):
                try:
                    number = float(value)
                except ValueError:
                    raise SimulationError(f"{key}={value}: must be a number") from None
                if name in ("step_cpu_ms", "steady_tolerance"):
                    if not (math.isfinite(number) and number >= 0) or (name == "steady_tolerance" and number >= 1):
                        raise SimulationError(f"{key}={value}: must be 0 or more" + (
                            " (milliseconds)" if name == "step_cpu_ms" else " and below 1 (e.g. 0.02; 0: off)"))
                    values[name] = number
                    continue
                if not (math.isfinite(number) and number > 0) or (name == "success_mean" and number >= 1):
                    raise SimulationError(f"{key}={value}: must be above 0" + (" and below 1" if name ==
                                                                              "success_mean" else ""))
                values[name] = number
                continue
            try:
                number = int(value)
            except ValueError:
                raise SimulationError(f"{key}={value}: must be a whole number") from None
            if number < 1:
                raise SimulationError(f"{key}={value}: must be at least 1")
            values[name] = number
        return cls(**values), rest


def _kept(section: Any, schema: type) -> dict:
    """The keys of ``section`` that the core's schema ``schema`` declares (a backend's own keys go)."""
    if not isinstance(section, dict):
        return {}
    names = {f.name for f in dataclasses.fields(schema)} - {"extra"}
    return {k: v for k, v in section.items() if k in names}


def simulated_config(raw: dict, settings: SimSettings) -> tuple[dict, dict]:
    """The run config to simulate, built from the user's merged raw config; and facts for the report."""
    from areal_core.config.allocation import AllocationParseError, parse_allocation
    from areal_core.config.schema import ActorConfig, RolloutConfig, TrainerConfig

    from areal_sim.inference import SimEngineConfig

    try:
        profile = load_profile(settings.profile)
    except ProfileError as exc:
        raise SimulationError(str(exc)) from None
    rollout_raw = raw.get("rollout") or {}
    allocation_text = raw.get("allocation") or ""
    share = 0.5
    if allocation_text:
        try:
            alloc = parse_allocation(allocation_text)
        except AllocationParseError as exc:
            raise SimulationError(f"allocation: {exc.reason}; fix it, or give sim.gpus and sim.inference_gpus") \
                from None
        infer = sum(c.world_size for c in alloc.components if c.backend == rollout_raw.get("backend", "local"))
        total = sum(c.world_size for c in alloc.components)
        share = infer / total if total and 0 < infer < total else 0.5
        default_gpus = max(2, total)
    else:
        default_gpus = 2
    gpus = settings.gpus or default_gpus
    tp = profile.inference.tp
    eta = int(rollout_raw.get("max_head_offpolicyness", RolloutConfig().max_head_offpolicyness))
    if settings.colocate:
        # both roles on every GPU, in turns: the servers generate a batch, then the actor trains on it
        if eta != 0:
            raise SimulationError(
                f"sim.colocate=true: generation and training take turns on the same GPUs, so nothing can be "
                f"generated while training (rollout.max_head_offpolicyness is {eta}). Fix: add "
                f"rollout.max_head_offpolicyness=0, or drop sim.colocate for the split layout")
        if settings.inference_gpus is not None:
            raise SimulationError(f"sim.inference_gpus={settings.inference_gpus} with sim.colocate=true: colocated, "
                                  f"every GPU serves and trains. Fix: drop one of the two")
        if gpus % tp:
            raise SimulationError(f"sim.gpus={gpus} with sim.colocate=true: every GPU serves, in servers of the "
                                  f"profile's tensor-parallel size ({tp}, {profile.name}). Fix: a multiple of {tp}")
        inference_gpus = gpus
    else:
        inference_gpus = settings.inference_gpus or max(tp, int(round(gpus * share / tp)) * tp)
    if not settings.colocate and (inference_gpus % tp or inference_gpus >= gpus):
        raise SimulationError(
            f"sim.inference_gpus={inference_gpus}: must be a multiple of the profile's tensor-parallel size "
            f"({tp}, {profile.name}) and leave GPUs for training out of sim.gpus={gpus}. Fix: e.g. "
            f"sim.inference_gpus={max(tp, (gpus // 2) // tp * tp)}")
    train_gpus = gpus if settings.colocate else gpus - inference_gpus
    t, p = settings.train_t, settings.train_p
    if train_gpus % (t * p):
        raise SimulationError(f"sim.train_t={t} x sim.train_p={p} must divide the {train_gpus} training GPUs "
                              f"(sim.gpus={gpus} - {inference_gpus} serving). Fix: sizes whose product divides "
                              f"{train_gpus}, or other sim.inference_gpus")
    servers = inference_gpus // tp
    scale = settings.token_scale
    rollout = _kept(rollout_raw, RolloutConfig)
    # the simulated engine's own keys given with the run (rollout.interruptible=false, ...) go through
    rollout.update(_kept(rollout_raw, SimEngineConfig))
    sampling = dict(rollout.get("sampling") or {})
    modelled_max = int(sampling.get("max_new_tokens", profile.lengths.cap))
    sampling["max_new_tokens"] = max(1, math.ceil(min(modelled_max, profile.lengths.cap) / scale))
    sampling.pop("stop", None)
    rollout.update(backend="sim", sampling=sampling, request_timeout_s=1e9, profile=settings.profile, token_scale=scale)
    if settings.step_cpu_ms is not None:
        rollout["step_cpu_s"] = settings.step_cpu_ms / 1e3
    if settings.colocate:
        rollout["colocated"] = True
    actor = _kept(raw.get("actor") or {}, ActorConfig)
    actor.update(backend="sim_train", profile=settings.profile, token_scale=scale)
    trainer = _kept(raw.get("trainer") or {}, TrainerConfig)
    trainer.update(save_every=0, save_every_s=0)
    config = {
        "experiment": raw.get("experiment", "areal"), "trial": f"{raw.get('trial', 'run0')}-sim",
        "output_dir": raw.get("output_dir", "runs"),
        "allocation": f"sim:d{servers}" + (f"t{tp}" if tp > 1 else "") + ("|" if settings.colocate else "+")
                      + "sim_train:" + _layout(train_gpus, t, p),
        "model": {"path": ""}, "rollout": rollout, "actor": actor,
        "algorithm": raw.get("algorithm") or {"name": "grpo"},
        "workflow": {"name": "sim"}, "reward": {"name": "sim"},
        "dataset": {"name": "sim", "profile": settings.profile, "token_scale": scale, "size": settings.dataset_size,
                    "success_mean": settings.success_mean, "success_concentration": settings.success_concentration},
        "trainer": trainer, "eval": {"size": 0, "before": False},
    }
    facts = {"gpus": gpus, "inference_gpus": inference_gpus, "train_gpus": train_gpus, "train_layout": [t, p],
             "colocated": settings.colocate,
             "servers": servers,
             "tp": tp, "profile": profile.name, "profile_source": profile.source, "token_scale": scale,
             "max_new_tokens": min(modelled_max, profile.lengths.cap),
             "step_cpu_ms": settings.step_cpu_ms if settings.step_cpu_ms is not None
             else profile.inference.step_cpu_s * 1e3}
    if profile.cpu is not None:
        # the roles share one machine's cores, as the local launcher shares them (eta 0: in turns, all cores each)
        server_threads, rank_threads = profile.cpu.threads(servers, train_gpus, eta)
        rollout["threads"], actor["threads"] = server_threads, rank_threads
        rollout["contended"] = actor["contended"] = eta > 0  # at once, each beside the other
        facts["threads"] = {"inference": server_threads, "train": rank_threads, "cores": profile.cpu.cores,
                            "contended": eta > 0}
    return config, facts


@dataclass(frozen=True)
class Steady:
    """When a simulation has run long enough: the rate it reports (trajectories a second over the second half of
    its steps, :func:`steady_samples_per_s`) has stopped moving.

    After step n (at least ``min_steps``), the second-half rate is compared with what it was after every step
    since n / 2; when none differs from it by more than ``tolerance`` of it, the figure is steady: doubling the
    horizon did not move it. Runs settle slowly and in cycles: at eta 8 on 32 GPUs (7B, 64 x 8 a step, 16k) the
    step times repeat a pattern of ~23 steps (a stall every cycle, the early steps fast on the short answers that
    finish first), and the second-half rate moved between 8.6 and 11.5 samples/s over the first 48 steps. A
    window of the last quarter's steps passed such a run as steady at 11.2 where 60 steps give 9.2; a fixed 5-6
    steps ended inside the filling and made ``areal plan`` pick large eta and large inference shares too rarely.
    A run that never settles runs its ``trainer.total_steps``."""

    tolerance: float = 0.02
    min_steps: int = 8

    def reached(self, step_s: list[float], per_step: int) -> bool:
        n = len(step_s)
        if n < self.min_steps:
            return False
        rates = [_half_rate(step_s[:m], per_step) for m in range((n + 1) // 2, n + 1)]
        now = rates[-1]
        return now > 0 and all(abs(r - now) <= self.tolerance * now for r in rates[:-1])


def _half_rate(step_s: list[float], per_step: int) -> float:
    """Trajectories a second over the second half of the steps: the least-squares slope of trajectories done
    against the simulated time at each step's end. Runs settle into cycles (at eta 2 one long step, then two
    short ones); a ratio of sums over the half moved by +-7 % as steps entered and left it, the slope by +-2 %."""
    ends = list(itertools.accumulate(step_s))[len(step_s) // 2:]
    if len(ends) < 3:
        later = step_s[len(step_s) // 2:]
        return len(later) * per_step / sum(later) if sum(later) else 0.0
    count = [i + 1 for i in range(len(step_s) // 2, len(step_s))]
    mean_t, mean_n = sum(ends) / len(ends), sum(count) / len(count)
    spread = sum((t - mean_t) ** 2 for t in ends)
    return per_step * sum((t - mean_t) * (n - mean_n) for t, n in zip(ends, count)) / spread if spread else 0.0


class _SteadyNow(Exception):
    """Raised in the trainer's loop to end a simulation whose figure is steady."""


def _stop_when_steady(trainer: Any, steady: Steady) -> None:
    """Make ``trainer`` end its run (by :class:`_SteadyNow`, before another step begins) once ``steady`` holds.
    The check runs where a step would start, after the previous step's metrics were logged."""
    per_step = trainer.cfg.rollout.batch_size * trainer.cfg.rollout.group_size
    step_s: list[float] = []
    train_step = trainer.train_step

    def checked() -> dict:
        if steady.reached(step_s, per_step):
            raise _SteadyNow
        metrics = train_step()
        step_s.append(metrics["time/step_s"])
        return metrics

    trainer.train_step = checked


def _layout(gpus: int, t: int, p: int) -> str:
    """``gpus`` GPUs as an allocation's layout with tensor size ``t`` and pipeline size ``p``: ``d4t2p2``."""
    return f"d{gpus // (t * p)}" + (f"t{t}" if t > 1 else "") + (f"p{p}" if p > 1 else "")


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """Python's cyclic garbage collector run a hundred times less often while a simulation runs.

    A simulation at hundreds of servers keeps millions of small objects alive (requests, futures, token lists)
    and makes millions more a step; at the default thresholds each collection of the older generations walks
    all of them, which took 40 % of the wall time at 512 GPUs (56 s against 34 s for 5 steps). The figures are
    the same either way: only when garbage is collected changes."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], 1) * 200, max(before[1], 1) * 5, max(before[2], 1) * 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run_simulation(config_path: str | None, overrides: list[str], out_dir: str | None = None) -> dict:
    """Simulate the run ``config_path`` + ``overrides`` (``sim.*`` keys included); the report (also written to
    ``simulation.json`` in the run folder). Raises :class:`SimulationError` or the core's ``ProblemsError``
    for what the user must fix."""
    import yaml

    from areal_core.clock import VirtualClock
    from areal_core.config.load import read_raw
    from areal_core.config.validate import validate_run
    from areal_core.problems import ProblemsError, format_problems
    from areal_core.trainer import Trainer

    settings, rest = SimSettings.from_overrides(overrides)
    raw, problems = read_raw(config_path, rest)
    if problems:
        raise ProblemsError(problems, config_path or "the overrides")
    config, facts = simulated_config(raw, settings)
    run_dir = Path(out_dir) if out_dir else Path(config["output_dir"]) / config["experiment"] / config["trial"]
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "samples.jsonl", "events.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    run = validate_run(str(run_dir / "config.yaml"), [])
    if run.problems:
        raise SimulationError(format_problems(run.problems, f"the simulated config {run_dir / 'config.yaml'}"))
    clock = VirtualClock(threads=1)
    began = time.perf_counter()
    trainer = Trainer(run, run_dir, clock=clock)
    if settings.steady_tolerance > 0:
        _stop_when_steady(trainer, Steady(settings.steady_tolerance))
    steady = False
    with open(run_dir / "trainer.log", "w") as log, contextlib.redirect_stdout(log), _few_collections():
        try:
            trainer.fit()  # its lines (one per simulated server) go to the log
        except _SteadyNow:
            steady = True
    wall = time.perf_counter() - began
    report = _report(trainer, clock, facts, wall, run_dir)
    # with sim.steady_tolerance: whether the figure settled before trainer.total_steps (the most it may run)
    report["steady"] = {"tolerance": settings.steady_tolerance, "reached": steady,
                        "max_steps": trainer.cfg.trainer.total_steps} if settings.steady_tolerance > 0 else None
    (run_dir / "simulation.json").write_text(json.dumps(report, indent=1))
    return report


def _report(trainer: Any, clock: Any, facts: dict, wall: float, run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    engines = trainer.controller.fleet.initial_engines
    actor = trainer.actor
    simulated = clock.now()
    k = facts["token_scale"]
    steps = len(rows)
    trajectories = steps * trainer.cfg.rollout.batch_size * trainer.cfg.rollout.group_size
    lags: dict[int, float] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("staleness/tokens_at_lag_"):
                lag = int(key.rsplit("_", 1)[1])
                lags[lag] = lags.get(lag, 0.0) + value * k
    total_lag_tokens = sum(lags.values()) or 1.0
    inference_busy = sum(e.busy_s for e in engines) / max(len(engines), 1)
    wait_batch = sum(r.get("time/wait_batch_s", 0.0) for r in rows)
    episodes = trainer.controller.stats()["started"]
    report = {
        **facts,
        "allocation": trainer.cfg.allocation, "steps": steps,
        "batch_size": trainer.cfg.rollout.batch_size, "group_size": trainer.cfg.rollout.group_size,
        "max_head_offpolicyness": trainer.cfg.rollout.max_head_offpolicyness,
        "simulated_s": simulated, "s_per_step": simulated / steps if steps else None,
        "samples_per_s": trajectories / simulated if simulated else 0.0,
        "steady_samples_per_s": steady_samples_per_s(rows, trainer.cfg.rollout.batch_size
                                                     * trainer.cfg.rollout.group_size),
        "trained_tokens_per_s": actor.tokens / simulated if simulated else 0.0,
        "generated_tokens_per_s": sum(e.tokens for e in engines) / simulated if simulated else 0.0,
        "utilisation": {"inference": inference_busy / simulated if simulated else 0.0,
                        "train": actor.busy_s / simulated if simulated else 0.0},
        "waiting_s": {"trainer_for_batches": wait_batch,
                      "inference_idle": max(0.0, simulated - inference_busy)},
        "staleness_tokens_by_lag": {str(lag): lags[lag] / total_lag_tokens for lag in sorted(lags)},
        "wall_s": wall, "episodes": episodes,
        "wall_ms_per_episode": 1e3 * wall / episodes if episodes else None,
        "clock_jumps": clock.jumps, "engine_events": sum(e.events for e in engines),
        "engine_calls": sum(e.requests for e in engines), "engine_aborts": sum(e.aborted for e in engines),
        "engine_preemptions": sum(e.preempted for e in engines),
        "recomputed_tokens": sum(e.recomputed_tokens for e in engines),
    }
    return report


def steady_samples_per_s(rows: list[dict], per_step: int) -> float:
    """Trajectories a second over the second half of the steps (:func:`_half_rate`), from each step's
    ``time/step_s``: the rate a long run settles at. (The first steps fill the pipeline: at eta 4 and 512 GPUs the rate over steps 3-8 was 149
    samples/s and over steps 51-100 196.)"""
    return _half_rate([r["time/step_s"] for r in rows], per_step)


def summary_lines(r: dict) -> list[str]:
    """The report in a few lines for the terminal."""
    lags = ", ".join(f"{lag}: {share:.0%}" for lag, share in r["staleness_tokens_by_lag"].items())
    return [
        f"{r['allocation']} ({r['gpus']} GPUs, {r['profile']}), batch {r['batch_size']} x {r['group_size']}, "
        f"eta {r['max_head_offpolicyness']}, {r['steps']} steps",
        f"simulated {r['simulated_s']:.0f} s ({r['s_per_step']:.1f} s a step) in {r['wall_s']:.1f} s of wall time "
        f"({r['wall_ms_per_episode']:.1f} ms an episode)",
        f"samples/s {r['samples_per_s']:.2f} (second half: {r['steady_samples_per_s']:.2f}), trained tokens/s {r['trained_tokens_per_s']:.0f}, "
        f"generated tokens/s {r['generated_tokens_per_s']:.0f}",
        f"GPU utilisation: inference {r['utilisation']['inference']:.0%}, train {r['utilisation']['train']:.0%}; "
        f"trainer waited {r['waiting_s']['trainer_for_batches']:.0f} s for batches",
        f"trained tokens by staleness: {lags}",
        f"KV cache: {r['engine_preemptions']} preemptions, {r['recomputed_tokens']:.0f} tokens prefilled again",
    ]


def parse_sweep(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``key=v1,v2,...`` each; the grid is their product, in the order given."""
    out = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise SimulationError(f"--sweep {spec!r}: write key=v1,v2,... (e.g. rollout.max_head_offpolicyness=0,4)")
        out.append((key, values.split(",")))
    return out


def run_sweep(config_path: str | None, overrides: list[str], sweeps: list[tuple[str, list[str]]],
              out_dir: Path) -> list[dict]:
    """Every point of the grid, each in ``out_dir/<key>=<value>...``; ``sweep.json`` and ``curves.png`` beside."""
    out_dir.mkdir(parents=True, exist_ok=True)
    points = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        extra = [f"{key}={value}" for (key, _), value in zip(sweeps, combo)]
        name = ",".join(extra).replace("/", "_")
        report = run_simulation(config_path, [*overrides, *extra], str(out_dir / name))
        points.append({"point": dict(zip((key for key, _ in sweeps), combo)), "report": report})
    (out_dir / "sweep.json").write_text(json.dumps(points, indent=1))
    plot_sweep(points, sweeps, out_dir / "curves.png")
    return points


def plot_sweep(points: list[dict], sweeps: list[tuple[str, list[str]]], path: Path) -> None:
    """Samples/s and trained tokens/s against the first swept key, a line per value of the others."""
    try:
        import matplotlib
    except ImportError:
        raise SimulationError(f"--sweep draws {path} with matplotlib, which is not installed (the sweep's figures are "
                              f"in {path.with_name('sweep.json')}). Fix: pip install 'matplotlib>=3.7' (the plugin's plot extra)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = sweeps[0][0]
    lines: dict[tuple, list[tuple[str, dict]]] = {}
    for p in points:
        rest = tuple((k, v) for k, v in p["point"].items() if k != first)
        lines.setdefault(rest, []).append((p["point"][first], p["report"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for rest, series in lines.items():
        label = ", ".join(f"{k}={v}" for k, v in rest) or "simulated"
        xs = [x for x, _ in series]
        axes[0].plot(xs, [r["samples_per_s"] for _, r in series], marker="o", label=label)
        axes[1].plot(xs, [r["trained_tokens_per_s"] for _, r in series], marker="o", label=label)
    for ax, title in zip(axes, ("samples / s", "trained tokens / s")):
        ax.set_xlabel(first)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
