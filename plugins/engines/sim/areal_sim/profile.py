"""Latency profiles: how long a simulated engine spends on each piece of work, as data.

A profile file (YAML) describes one model on one kind of GPU: a decode step's
time as a table over the running batch and the context length, prefill time
per token, training time per token and the gradient all-reduce, the time to
move the weights, and the distribution of response lengths. The simulated
engines ask it, and spend that much (simulated) time instead of computing.
Only the interpolation and the all-reduce formula are code; every number is
in the file, with where it comes from (``source``).

Shipped profiles are in ``areal_sim/profiles/`` (``load_profile("qwen2.5-7b-h800")``);
any other path works too. Units: seconds, bytes, Gbit/s.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILES = Path(__file__).with_name("profiles")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file, the field, the value and the fix."""


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys); beyond either end, the end segment extended (never below 0)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class DecodeTable:
    """Seconds of one decode step (every running request gets a token) by running batch and mean context.

    Interpolated linearly in the batch and in the context (a decode step is
    memory-bound: weights read once per step, KV cache read per token of
    context, both linear), extended linearly past the table's edges.
    """

    batch: tuple[float, ...]
    context: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]  # [batch index][context index]
    _lines: dict = field(default_factory=dict, compare=False, repr=False)  # batch -> _line(batch), memoised

    def __call__(self, batch: float, context: float) -> float:
        if batch <= 0:
            return 0.0
        return _interp(list(self.context), self._line(batch), context)

    def _line(self, batch: float) -> list[float]:
        """Seconds at each of the table's contexts for this batch (interpolated in the batch; piecewise-linear
        in both, so this equals interpolating each row in the context first)."""
        line = self._lines.get(batch)
        if line is None:
            line = [_interp(list(self.batch), [row[j] for row in self.seconds], batch)
                    for j in range(len(self.context))]
            if len(self._lines) < 4096:
                self._lines[batch] = line
        return line

    def sum_steps(self, batch: float, context: float, k: int) -> float:
        """``sum(self(batch, context + i) for i in range(k))`` in closed form: k steps at a fixed batch while
        every request's context grows by one token per step. Linear pieces sum as arithmetic series, so the
        cost does not grow with k: what an engine that advances a whole stretch of steps between two events
        needs (the next step of issue 24; today's engine still sleeps once per step)."""
        if batch <= 0 or k <= 0:
            return 0.0
        xs, ys = list(self.context), self._line(batch)
        if len(xs) == 1:
            return k * ys[0]
        total = 0.0
        for j in range(len(xs) - 1):
            lo = 0 if j == 0 else max(0, math.ceil(xs[j] - context))
            hi = k - 1 if j == len(xs) - 2 else min(k - 1, math.ceil(xs[j + 1] - context) - 1)
            if hi < lo:
                continue
            n, slope = hi - lo + 1, (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
            total += n * (ys[j] + slope * (context - xs[j])) + slope * (lo + hi) * n / 2
        return total

    def steps_within(self, batch: float, context: float, seconds: float, k: int) -> int:
        """How many of the next ``k`` steps end within ``seconds`` (as :meth:`sum_steps` counts them)."""
        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.sum_steps(batch, context, mid) <= seconds + 1e-12:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass(frozen=True)
class InferenceModel:
    tp: int  # the tensor-parallel size the table holds for (the layout one server has)
    decode_step_s: DecodeTable
    prefill_s_per_token: float
    kv_capacity_tokens: int  # KV-cache tokens one server holds (prompt + output of every running request)
    prefill_s_fixed: float = 0.0  # per prefill, whatever its tokens (reading the weights once)
    shared_prompts: bool = False  # identical prompts joining together are prefilled once (the embedded engine)
    # the serving engine's CPU-side work per decode step (scheduling, sampling, detokenising), part of every cell
    # of decode_step_s: the profile's table plus this (Profile.with_step_cpu replaces it)
    step_cpu_s: float = 0.0
    # not a profile field: the controller's CPU per request that comes out of this server's core while the roles
    # run at once on a shared CPU (Profile.on_threads sets it from cpu.controller_s_per_sample)
    side_s_per_request: float = 0.0

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_s_fixed + tokens * self.prefill_s_per_token if tokens else 0.0


@dataclass(frozen=True)
class TrainModel:
    s_per_token_per_gpu: float  # forward + backward + optimizer, per token, on one GPU's share
    grad_bytes: float  # what the all-reduce moves per optimizer step
    allreduce_gbps: float  # the bus bandwidth the all-reduce runs at (Gbit/s)
    allreduce_latency_s: float  # per hop
    s_per_step: float = 0.0  # per optimizer step whatever its tokens (the optimizer's update of every weight)
    forward_share: float = 0.25  # a logprob forward's time per token / a training step's (2 of 8 x params FLOPs)
    shared_prompts: bool = False  # a group's prompt is computed once, not once per sample (the fsdp engine)
    side_s_per_sample: float = 0.0  # not a profile field: as InferenceModel.side_s_per_request, per trained sample
    # the model's shape and the intra-node link, for tensor and pipeline parallelism's own costs (0: not modelled,
    # and areal plan does not search t / p)
    layers: int = 0
    hidden: int = 0
    tp_link_gbps: float = 0.0  # the tensor-parallel all-reduces' bus bandwidth (NVLink), Gbit/s
    tp_latency_s: float = 0.0  # per all-reduce
    pipeline_microbatches: int = 8  # micro-batches a pipeline is fed per optimizer step

    @property
    def models_tp(self) -> bool:
        return self.layers > 0 and self.hidden > 0 and self.tp_link_gbps > 0

    def allreduce_s(self, d: int, nbytes: float | None = None) -> float:
        """A ring all-reduce over ``d`` ranks: 2 (d - 1) / d of ``nbytes`` (the gradients) over the bus,
        2 (d - 1) hops."""
        if d <= 1:
            return 0.0
        nbytes = self.grad_bytes if nbytes is None else nbytes
        return 2 * (d - 1) / d * nbytes / (self.allreduce_gbps * 1e9 / 8) + 2 * (d - 1) * self.allreduce_latency_s

    def step_s(self, tokens: int, d: int, t: int = 1, p: int = 1) -> float:
        """One optimizer step over ``tokens`` tokens on ``d`` x ``t`` x ``p`` ranks (data, tensor, pipeline).

        The compute splits evenly over every rank; a pipeline of ``p`` stages fed ``pipeline_microbatches`` (m)
        micro-batches idles for (p - 1) / m of it (the 1F1B schedule's fill and drain); tensor parallelism adds,
        per layer of a stage, 6 all-reduces of the rank's activations (2 in the forward, 2 in the recomputed
        forward, 2 in the backward: the profiles' training uses activation recomputation) over NVLink; the
        gradient all-reduce over the ``d`` replicas moves each rank's 1 / (t p) share of the gradients."""
        return (self._compute_s(tokens, d, t, p) + self.tp_s(tokens, d, t, p, 6) + self.s_per_step / (t * p)
                + self.allreduce_s(d, self.grad_bytes / (t * p)))

    def forward_s(self, tokens: int, d: int, t: int = 1, p: int = 1) -> float:
        """A logprob forward over ``tokens`` on the layout: ``forward_share`` of the compute, 2 all-reduces a
        layer."""
        return self.forward_share * self._compute_s(tokens, d, t, p) + self.tp_s(tokens, d, t, p, 2)

    def _compute_s(self, tokens: int, d: int, t: int, p: int) -> float:
        ideal = tokens * self.s_per_token_per_gpu / max(d * t * p, 1)
        return ideal * (1 + (p - 1) / self.pipeline_microbatches) if p > 1 else ideal

    def tp_s(self, tokens: int, d: int, t: int, p: int, per_layer: int) -> float:
        """The tensor-parallel all-reduces: ``per_layer`` a layer of a stage, over each micro-batch."""
        if t <= 1 or not self.models_tp:
            return 0.0
        calls = per_layer * self.layers / p * (self.pipeline_microbatches if p > 1 else 1)
        nbytes = per_layer * self.layers / p * 2 * (t - 1) / t * tokens / max(d, 1) * self.hidden * 2  # bf16
        return calls * self.tp_latency_s + nbytes / (self.tp_link_gbps * 1e9 / 8)


@dataclass(frozen=True)
class WeightModel:
    bytes: float  # the weights the trainer sends per update
    link_gbps: float  # trainer -> inference servers
    latency_s: float
    export_s: float = 0.0  # the trainer's own time to hand the weights out (it waits; the transfer it does not)

    def transfer_s(self, nbytes: float | None = None) -> float:
        return (self.bytes if nbytes is None else nbytes) / (self.link_gbps * 1e9 / 8) + self.latency_s


@dataclass(frozen=True)
class Lengths:
    """Response lengths: log-normal (long-tailed, as reasoning traces are), cut at ``cap`` tokens."""

    median: float
    sigma: float
    cap: int
    prompt: int  # prompt tokens per request

    def sample(self, rng: random.Random) -> int:
        return max(1, min(self.cap, round(rng.lognormvariate(math.log(self.median), self.sigma))))

    def mean(self) -> float:
        """The mean of the capped distribution, numerically (for reports)."""
        rng = random.Random(0)
        return sum(self.sample(rng) for _ in range(20000)) / 20000


@dataclass(frozen=True)
class SharedCores:
    """Inference servers and train ranks on one machine's cores, shared as the ``local`` launcher shares them
    (``areal_core.processes.fleet.thread_plan``): at eta 0 the two sides take turns and each gets every core;
    otherwise every process gets its share at once. The profile's times are for one thread; a role on n threads
    runs ``speedup[n - 1]`` times faster (measured: more threads do not scale linearly)."""

    cores: int
    inference_speedup: tuple[float, ...]  # n = 1 .. cores
    train_speedup: tuple[float, ...]
    # time of each role while the other runs at once on the other cores / time alone (shared memory bandwidth and
    # caches, the trainer process's own threads): what eta > 0 costs on one machine
    inference_contention: float = 1.0
    train_contention: float = 1.0
    # CPU seconds the trainer process spends per generated sample beside training: the rollout controller's loop,
    # its HTTP client, the rewards (measured from the real demo at eta 4). While both roles run at once, three
    # busy threads share two cores and half of it comes out of each role's time; at eta 0 the server's second
    # thread leaves room for it (2 threads decode only inference_speedup[1] times faster than one)
    controller_s_per_sample: float = 0.0

    def threads(self, servers: int, train_ranks: int, eta: int) -> tuple[int, int]:
        """Threads of one server and of one train rank under the local launcher's plan."""
        from areal_core.processes.fleet import thread_plan

        per_server, per_rank = thread_plan(max(servers, 1), max(train_ranks, 1), eta, self.cores)
        return per_server[0], per_rank[0]

    @staticmethod
    def factor(speedup: tuple[float, ...], threads: int) -> float:
        """Time on ``threads`` threads / time on one."""
        return 1.0 / speedup[min(max(threads, 1), len(speedup)) - 1]


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    gpu: str
    params: float  # model parameters
    inference: InferenceModel
    train: TrainModel
    weights: WeightModel
    lengths: Lengths
    cpu: SharedCores | None = None  # None: every role on its own GPUs

    def with_step_cpu(self, seconds: float) -> Profile:
        """This profile with ``seconds`` of CPU-side work per decode step in place of its own
        ``inference.step_cpu_s`` (the GPU's part of each step unchanged)."""
        table, delta = self.inference.decode_step_s, seconds - self.inference.step_cpu_s
        return dataclasses.replace(self, inference=dataclasses.replace(
            self.inference, step_cpu_s=seconds,
            decode_step_s=DecodeTable(table.batch, table.context,
                                      tuple(tuple(x + delta for x in row) for row in table.seconds))))

    def on_threads(self, inference: int, train: int, contended: bool = False) -> Profile:
        """This profile with every time as it is on ``inference`` threads per server and ``train`` per train rank,
        and with ``contended`` as it is while the other role runs at once (a profile without ``cpu`` is returned as
        it is)."""
        if self.cpu is None:
            return self
        fi = SharedCores.factor(self.cpu.inference_speedup, inference)
        ft = SharedCores.factor(self.cpu.train_speedup, train)
        side = 0.0
        if contended:
            fi, ft = fi * self.cpu.inference_contention, ft * self.cpu.train_contention
            side = self.cpu.controller_s_per_sample / 2
        table = self.inference.decode_step_s
        return dataclasses.replace(
            self,
            inference=dataclasses.replace(
                self.inference, prefill_s_per_token=self.inference.prefill_s_per_token * fi,
                prefill_s_fixed=self.inference.prefill_s_fixed * fi, side_s_per_request=side,
                decode_step_s=DecodeTable(table.batch, table.context,
                                          tuple(tuple(x * fi for x in row) for row in table.seconds))),
            train=dataclasses.replace(self.train, s_per_token_per_gpu=self.train.s_per_token_per_gpu * ft,
                                      s_per_step=self.train.s_per_step * ft, side_s_per_sample=side),
            weights=dataclasses.replace(self.weights, latency_s=self.weights.latency_s * fi,
                                        link_gbps=self.weights.link_gbps / fi, export_s=self.weights.export_s * ft))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``qwen2.5-7b-h800``) or a YAML file by path."""
    import yaml

    shipped_path = PROFILES / f"{name_or_path}.yaml"
    path = shipped_path if shipped_path.is_file() else Path(name_or_path)
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml")))
        raise ProfileError(f"sim.profile: {str(name_or_path)!r} is neither a shipped profile nor a file. Fix: one of "
                           f"{shipped}, or the path of a profile YAML (see {PROFILES}/README.md)")
    # hundreds of simulated servers load the same file: read it once (per version of the file); each call still
    # gets its own Profile
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    data = _read_cache.get(key)
    if data is None:
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ProfileError(f"profile {path}: not valid YAML ({exc})") from None
        _read_cache[key] = data
    return parse_profile(data, str(path))


_read_cache: dict[tuple[str, int], Any] = {}


def parse_profile(data: Any, where: str = "the profile") -> Profile:
    reader = _Reader(data, where)
    inference, train = reader.section("inference"), reader.section("train")
    weights, lengths = reader.section("weights"), reader.section("lengths")
    table = inference.section("decode_step_s")
    batch = table.numbers("batch", increasing=True)
    context = table.numbers("context", increasing=True)
    seconds = table.get("seconds")
    if not (isinstance(seconds, list) and len(seconds) == len(batch)
            and all(isinstance(row, list) and len(row) == len(context) for row in seconds)):
        raise ProfileError(f"{where}: inference.decode_step_s.seconds must be a list of {len(batch)} rows (one per "
                           f"batch) of {len(context)} numbers (one per context)")
    step_cpu = inference.optional("step_cpu_s", 0.0, minimum=0.0)
    rows = tuple(tuple(table.positive(f"seconds[{i}][{j}]", v) + step_cpu for j, v in enumerate(row))
                 for i, row in enumerate(seconds))
    lengths_profile = Lengths(median=lengths.positive_number("median"), sigma=lengths.positive_number("sigma"),
                              cap=int(lengths.positive_number("cap")), prompt=int(lengths.positive_number("prompt")))
    return Profile(
        name=reader.text("name"), source=reader.text("source"), gpu=reader.text("gpu"),
        params=reader.positive_number("params"),
        inference=InferenceModel(tp=int(inference.positive_number("tp")),
                                 decode_step_s=DecodeTable(tuple(batch), tuple(context), rows),
                                 prefill_s_per_token=inference.positive_number("prefill_s_per_token"),
                                 kv_capacity_tokens=int(inference.positive_number("kv_capacity_tokens")),
                                 prefill_s_fixed=inference.optional("prefill_s_fixed", 0.0, minimum=0.0),
                                 shared_prompts=inference.flag("shared_prompts"), step_cpu_s=step_cpu),
        train=TrainModel(s_per_token_per_gpu=train.positive_number("s_per_token_per_gpu"),
                         grad_bytes=train.positive_number("grad_bytes"),
                         allreduce_gbps=train.positive_number("allreduce_gbps"),
                         allreduce_latency_s=train.number("allreduce_latency_s", minimum=0.0),
                         s_per_step=train.optional("s_per_step", 0.0, minimum=0.0),
                         forward_share=train.optional("forward_share", 0.25, minimum=0.0),
                         shared_prompts=train.flag("shared_prompts"),
                         layers=int(train.optional("layers", 0, minimum=0)),
                         hidden=int(train.optional("hidden", 0, minimum=0)),
                         tp_link_gbps=train.optional("tp_link_gbps", 0.0, minimum=0.0),
                         tp_latency_s=train.optional("tp_latency_s", 0.0, minimum=0.0),
                         pipeline_microbatches=max(1, int(train.optional("pipeline_microbatches", 8, minimum=1)))),
        weights=WeightModel(bytes=weights.positive_number("bytes"), link_gbps=weights.positive_number("link_gbps"),
                            latency_s=weights.number("latency_s", minimum=0.0),
                            export_s=weights.optional("export_s", 0.0, minimum=0.0)),
        lengths=lengths_profile, cpu=_shared_cores(reader))


def _shared_cores(reader: _Reader) -> SharedCores | None:
    if "cpu" not in reader.data:
        return None
    cpu = reader.section("cpu")
    cores = cpu.positive_number("cores")
    if cores != int(cores):
        raise ProfileError(f"{reader.where}: cpu.cores must be a whole number, got {cores!r}")
    speedups = {}
    for role in ("inference", "train"):
        values = cpu.numbers(f"{role}_speedup")
        if len(values) != int(cores) or values[0] != 1.0:
            raise ProfileError(f"{reader.where}: cpu.{role}_speedup must list {int(cores)} numbers (time on 1 "
                               f"thread / time on n threads, n = 1..cores), the first 1.0; got {values!r}")
        speedups[role] = tuple(values)
    contention = {"inference": 1.0, "train": 1.0}
    if "contention" in cpu.data:
        section = cpu.section("contention")
        contention = {role: section.positive_number(role) for role in ("inference", "train")}
    return SharedCores(int(cores), speedups["inference"], speedups["train"], contention["inference"],
                       contention["train"], cpu.optional("controller_s_per_sample", 0.0, minimum=0.0))


class _Reader:
    """Field access with messages that name the file, the dotted field, the value and what it must be."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: {prefix.rstrip('.') or 'the file'} must be a mapping, got {data!r}")
        self.data, self.where, self.prefix = data, where, prefix

    def get(self, key: str) -> Any:
        if key not in self.data:
            raise ProfileError(f"{self.where}: {self.prefix}{key} is missing. Fix: add it (see "
                               f"{PROFILES}/README.md for every field)")
        return self.data[key]

    def section(self, key: str) -> _Reader:
        return _Reader(self.get(key), self.where, f"{self.prefix}{key}.")

    def text(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ProfileError(f"{self.where}: {self.prefix}{key} must be a non-empty text, got {value!r}")
        return value

    def number(self, key: str, minimum: float) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < minimum:
            raise ProfileError(f"{self.where}: {self.prefix}{key} must be a finite number >= {minimum:g}, "
                               f"got {value!r}")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.data.get(key, False)
        if not isinstance(value, bool):
            raise ProfileError(f"{self.where}: {self.prefix}{key} must be true or false, got {value!r}")
        return value

    def optional(self, key: str, default: float, minimum: float) -> float:
        return self.number(key, minimum) if key in self.data else default

    def positive(self, label: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ProfileError(f"{self.where}: {self.prefix}{label} must be a finite number > 0, got {value!r}")
        return float(value)

    def positive_number(self, key: str) -> float:
        return self.positive(key, self.get(key))

    def numbers(self, key: str, increasing: bool = False) -> list[float]:
        values = self.get(key)
        if not isinstance(values, list) or not values:
            raise ProfileError(f"{self.where}: {self.prefix}{key} must be a non-empty list of numbers, got {values!r}")
        out = [self.positive(f"{key}[{i}]", v) for i, v in enumerate(values)]
        if increasing and any(b <= a for a, b in zip(out, out[1:])):
            raise ProfileError(f"{self.where}: {self.prefix}{key} must increase strictly, got {values!r}")
        return out
