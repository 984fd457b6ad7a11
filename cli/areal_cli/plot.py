"""``areal plot RUN [RUN ...]``: one run's curves, or several runs overlaid, as a PNG or an interactive HTML page.

A RUN is an areal run folder (``<output_dir>/<experiment>/<trial>``: ``metrics.jsonl`` and ``config.yaml``), a
metrics file, or a TRL output folder / its ``trainer_state.json`` (``log_history``; TRL's ``reward`` is drawn as
``reward/mean``). Each run keeps one color across the panels and is named in the legend by its trial (with its
experiment when two trials share a name). Lines are smoothed by TensorBoard's debiased exponential moving average,
the raw values faint behind them; ``eval/*`` points (few, each a measurement) are drawn as they are.

With ``seeds=True`` (``--seeds``), runs whose configs differ only in ``trainer.seed`` (and their names and
folders) are drawn as one curve: the mean over them at the steps they all logged, in a band of one standard
deviation, named by the first run's trial and the number of seeds; at ``x="time"`` each point sits at the runs'
mean time of that step.

The x axis is the step, or (``x="time"``) the training time: seconds since the run's first step began, read from
each record's ``time`` (unix). A resumed run (or any stop) leaves a gap between two records that the later record's
own timings (``time/step_s`` + ``time/checkpoint_s`` + ``eval/seconds``; the run's median interval for a file
without them) do not explain: a gap more than :data:`RESUME_GAP_S` seconds and more than twice longer than those
timings is counted as that record's timings alone, and a dotted line marks where the run came back. TRL logs carry
no wall-clock time: asking for ``x="time"`` with one names it.
"""

from __future__ import annotations

import difflib
from html import escape as html_escape
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
TRL_STATE = "trainer_state.json"
RUN_FORMS = ("the run folder (<output_dir>/<experiment>/<trial>, the one holding config.yaml and metrics.jsonl), "
             "its metrics.jsonl, or a TRL output folder or its trainer_state.json")

# (metric key, title) of the default panels; a panel is drawn when some run logs its key.
PANELS = [
    ("reward/mean", "training reward (mean per step)"),
    ("accuracy/mean", "training accuracy (mean per step)"),
    ("eval/accuracy", "validation accuracy"),
    ("train/loss", "loss"),
    ("train/entropy", "entropy (nats per token)"),
    ("train/clip_frac", "clip fraction"),
    ("train/kl", "KL to the reference"),
    ("length/mean", "completion length (tokens, mean)"),
    ("throughput/tokens_per_s", "tokens/s"),
    ("throughput/gen_tokens_per_s", "generation tokens/s"),
    ("staleness/token_lag_mean", "token staleness (versions, mean)"),
]
TITLES = dict(PANELS)

# TRL's log_history keys -> the areal metric drawn for them (the TRL key is kept too).
TRL_KEYS = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "eval_reward": "eval/reward_mean",
    "entropy": "train/entropy",
    "kl": "train/kl",
    "completions/mean_length": "length/mean",
}
# --x choices; samples and tokens are cumulative: areal's train/samples and train/tokens summed over the steps,
# TRL's num_tokens as it logs it (TRL logs no sample count)
X_CHOICES = ("step", "samples", "tokens", "time")
X_COUNTS = {"samples": "train/samples", "tokens": "train/tokens"}
WHOLE_X = ("step", *X_COUNTS)  # axes of whole numbers: their ticks are integers

DEFAULT_SMOOTH = 0.6  # TensorBoard's default weight
RESUME_GAP_S = 60.0
STATIC_FORMATS = (".png", ".svg", ".pdf")
# One timings' sum explains the gap before a record: the step itself, the previous step's save, an evaluation.
OWN_TIMINGS = ("time/step_s", "time/checkpoint_s", "eval/seconds")


class PlotError(ValueError):
    """A run that cannot be plotted, or an option that cannot be used; the message says why and what to do."""


@dataclass
class Run:
    source: Path  # what was named on the command line
    trial: str
    experiment: str
    rows: list[dict]  # step order; TRL rows also hold the areal keys of TRL_KEYS
    kind: str = "areal"  # or "trl"
    label: str = ""
    resumes: list[float] = field(default_factory=list)  # x (seconds) where the run came back after a stop
    config: dict | None = None  # its resolved config.yaml, when it has one
    members: list["Run"] = field(default_factory=list)  # a group of seeds (--seeds): the runs it stands for

    def keys(self) -> set[str]:
        return {k for row in self.rows for k, v in row.items() if _finite(v)} - {"step", "time"}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------ reading runs
def read_metrics(path: Path) -> list[dict]:
    """The complete step records of a metrics.jsonl (a line being written, or not JSON, is skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    if not rows:
        raise PlotError(f"{path} holds no complete step yet; plot again once the run has logged a step")
    return rows


def _read_config(folder: Path) -> dict | None:
    import yaml

    try:
        config = yaml.safe_load((folder / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def _names_from_config(folder: Path) -> tuple[str, str]:
    """(trial, experiment) from the run's resolved config; the folder's own names when it has none."""
    trial, experiment = folder.name, folder.parent.name
    config = _read_config(folder)
    if config is not None:
        trial = str(config.get("trial") or trial)
        experiment = str(config.get("experiment") or experiment)
    return trial, experiment


def _trl_state(folder: Path) -> Path | None:
    """``trainer_state.json`` of a TRL output folder: its own, else the newest ``checkpoint-N``'s."""
    if (folder / TRL_STATE).is_file():
        return folder / TRL_STATE
    checkpoints = [(int(p.parent.name.split("-")[-1]), p) for p in folder.glob(f"checkpoint-*/{TRL_STATE}")
                   if p.parent.name.split("-")[-1].isdigit()]
    return max(checkpoints)[1] if checkpoints else None


def read_trl(path: Path) -> list[dict]:
    """The step records of a TRL ``trainer_state.json``, each also holding the areal keys of :data:`TRL_KEYS`."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlotError(f"{path} cannot be read as a TRL trainer_state.json ({exc}). Fix: pass {RUN_FORMS}") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise PlotError(f"{path} has no log_history list, so it is not a TRL trainer_state.json. Fix: pass {RUN_FORMS}")
    rows = []
    for entry in history:
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            continue
        row = dict(entry)
        for trl_key, key in TRL_KEYS.items():
            if trl_key in entry:
                row[key] = entry[trl_key]
        per_function = [k for k in entry if k.startswith("rewards/") and k.endswith("/mean")]
        if "reward/mean" not in row and len(per_function) == 1:  # one reward function: its mean is the reward
            row["reward/mean"] = entry[per_function[0]]
        rows.append(row)
    if not rows:
        raise PlotError(f"{path} logs no step yet (an empty log_history); plot again once TRL has logged and saved "
                        f"its state (logging_steps, save_steps, or trainer.save_state())")
    return rows


def load_run(path: Path) -> Run:
    """The run named by ``path`` (see the module docstring for the forms); PlotError naming it and the fix."""
    path = Path(path)
    if not path.exists():
        raise PlotError(f"{path} does not exist. Fix: pass {RUN_FORMS}")
    if path.is_dir():
        if (path / METRICS_FILE).is_file():
            trial, experiment = _names_from_config(path)
            return Run(path, trial, experiment, read_metrics(path / METRICS_FILE), config=_read_config(path))
        state = _trl_state(path)
        if state is None:
            raise PlotError(f"{path} has no metrics.jsonl. Fix: pass {RUN_FORMS}")
        return Run(path, path.name, path.parent.name, read_trl(state), kind="trl")
    if path.suffix == ".json":
        folder = path.parent.parent if path.parent.name.startswith("checkpoint-") else path.parent
        return Run(path, folder.name, folder.parent.name, read_trl(path), kind="trl")
    if path.suffix == ".jsonl":
        if path.name == METRICS_FILE:
            trial, experiment = _names_from_config(path.parent)
            return Run(path, trial, experiment, read_metrics(path), config=_read_config(path.parent))
        return Run(path, path.stem, path.parent.name, read_metrics(path))
    raise PlotError(f"{path} is neither a folder, a .jsonl metrics file nor a TRL trainer_state.json. "
                    f"Fix: pass {RUN_FORMS}")


# what may differ between the seeds of one configuration
SEED_KEYS = ("trainer.seed", "trial", "experiment", "output_dir")


def _without_seed(config: dict) -> str:
    import json

    flat = json.loads(json.dumps(config, default=str))
    for key in SEED_KEYS:
        parent, _, leaf = key.rpartition(".")
        section = flat.get(parent) if parent else flat
        if isinstance(section, dict):
            section.pop(leaf, None)
    return json.dumps(flat, sort_keys=True)


def group_seeds(runs: list[Run]) -> list[Run]:
    """``runs`` with those whose configs differ only in :data:`SEED_KEYS` joined into one run each (its
    ``members``), in the order of their first; a run without a config stays alone. PlotError when nothing joins."""
    groups: dict[str, list[Run]] = {}
    order: list[str | int] = []
    for i, run in enumerate(runs):
        key = _without_seed(run.config) if run.config is not None else None
        if key is None:
            order.append(i)
        elif key not in groups:
            groups[key] = [run]
            order.append(key)
        else:
            groups[key].append(run)
    if all(len(g) == 1 for g in groups.values()):
        raise PlotError("--seeds: no two of these runs differ only in trainer.seed (their configs differ elsewhere, "
                        "or have no config.yaml). Fix: name the runs of one configuration's seeds, or leave --seeds out")
    out = []
    for item in order:
        if isinstance(item, int):
            out.append(runs[item])
            continue
        members = groups[item]
        if len(members) == 1:
            out.append(members[0])
            continue
        first = members[0]
        out.append(Run(first.source, f"{first.trial} ({len(members)} seeds)", first.experiment, [],
                       config=first.config, members=members))
    return out


def label_runs(runs: list[Run]) -> None:
    """Each run's legend label: its trial; ``experiment/trial`` where trials repeat; its path where those do."""
    for run in runs:
        run.label = run.trial
    for better in (lambda r: f"{r.experiment}/{r.trial}", lambda r: str(r.source)):
        labels = [r.label for r in runs]
        for run in runs:
            if labels.count(run.label) > 1:
                run.label = better(run)


# ------------------------------------------------------------------ series
def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average debiased for its zero start; ``weight`` 0 = none."""
    if weight <= 0:
        return list(values)
    smoothed, last = [], 0.0
    for n, value in enumerate(values, 1):
        last = last * weight + (1 - weight) * value
        smoothed.append(last / (1 - weight**n))
    return smoothed


def elapsed(run: Run) -> dict[int, float]:
    """Training seconds at each timed record (by its index in ``run.rows``); sets ``run.resumes``.

    The origin is the first step's start (the first record's time less its own timings). A gap that the later
    record's own timings do not explain (see the module docstring) counts as those timings only."""
    timed = [(i, row["time"]) for i, row in enumerate(run.rows) if _finite(row.get("time"))]
    if not timed:
        what = "a TRL trainer_state.json" if run.kind == "trl" else "its metrics file"
        raise PlotError(f"{run.source}: {what} records no wall-clock time, so it cannot be drawn against time. "
                        f"Fix: --x step (or leave this run out of a --x time figure)")
    gaps = [b - a for (_, a), (_, b) in zip(timed, timed[1:])]
    median = statistics.median(gaps) if gaps else 0.0

    def own(row: dict) -> float | None:
        parts = [row[k] for k in OWN_TIMINGS if _finite(row.get(k))]
        return sum(parts) if parts else None

    at = own(run.rows[timed[0][0]]) or 0.0
    x = {timed[0][0]: at}
    run.resumes = []
    for (_, before), (i, now) in zip(timed, timed[1:]):
        gap = now - before
        expected = own(run.rows[i])
        expected = median if expected is None else expected
        if gap > expected + max(RESUME_GAP_S, expected):  # a stop: only the record's own timings count
            run.resumes.append(at)
            gap = expected
        at += gap
        x[i] = at
    return x


def cumulative(run: Run, by: str) -> dict[int, float]:
    """Samples or tokens trained through each record (by its index in ``run.rows``): the running sum of the
    per-step count (a step logged twice, as after a resume, counted once), or TRL's own ``num_tokens``."""
    if run.kind == "trl":
        if by == "tokens":
            counted = {i: float(row["num_tokens"]) for i, row in enumerate(run.rows) if _finite(row.get("num_tokens"))}
            if counted:
                return counted
        raise PlotError(f"{run.source}: TRL's log_history records no {'sample count' if by == 'samples' else 'num_tokens'}"
                        f", so it cannot be drawn against {by}. Fix: --x step (or leave it out of this figure)")
    key = X_COUNTS[by]
    per_step: dict[int, float] = {}
    for row in run.rows:
        if _finite(row.get(key)):
            per_step[row["step"]] = float(row[key])
    if not per_step:
        raise PlotError(f"{run.source}: its metrics file has no {key}, so it cannot be drawn against {by} (runs "
                        f"before 2026-11-29 did not log it). Fix: --x step")
    through, total = {}, 0.0
    for step in sorted(set(row["step"] for row in run.rows)):
        total += per_step.get(step, 0.0)
        through[step] = total
    return {i: through[row["step"]] for i, row in enumerate(run.rows)}


def positions(run: Run, by: str) -> dict[int, float] | None:
    """x of each record (by index) for ``by`` other than step; None for step."""
    if by == "step":
        return None
    return elapsed(run) if by == "time" else cumulative(run, by)


def series(run: Run, key: str, by: str) -> tuple[list[float], list[float]]:
    """(x, values) of ``key`` in ``run``, x by ``step``, cumulative ``samples`` or ``tokens``, or ``time``
    (seconds; see :func:`elapsed`)."""
    times = positions(run, by)
    points = []
    for i, row in enumerate(run.rows):
        if not _finite(row.get(key)):
            continue
        if times is None:
            points.append((row["step"], row[key]))
        elif i in times:
            points.append((times[i], row[key]))
    return [p[0] for p in points], [p[1] for p in points]


# ------------------------------------------------------------------ what to draw
@dataclass
class Curve:
    run: Run
    color: str
    x: list[float]
    raw: list[float]
    smooth: list[float] | None  # None: drawn as is (eval points, smoothing off, one point)
    band: tuple[list[float], list[float]] | None = None  # a group of seeds: mean -+ one standard deviation


def group_series(run: Run, key: str, by: str) -> tuple[list[float], list[float], list[float]]:
    """(x, mean, standard deviation) of ``key`` over a group's members, at the steps every member logged it."""
    per_member = []
    for member in run.members:
        times = positions(member, by)
        points = {}
        for i, row in enumerate(member.rows):
            if _finite(row.get(key)) and (times is None or i in times):
                points[row["step"]] = (row["step"] if times is None else times[i], row[key])
        per_member.append(points)
    steps = sorted(set.intersection(*(set(p) for p in per_member)))
    xs, means, sds = [], [], []
    for step in steps:
        values = [p[step][1] for p in per_member]
        xs.append(statistics.fmean(p[step][0] for p in per_member))
        means.append(statistics.fmean(values))
        sds.append(statistics.stdev(values))
    return xs, means, sds


@dataclass
class Panel:
    key: str
    title: str
    curves: list[Curve]


def choose_panels(runs: list[Run], metrics: list[str] | None) -> list[tuple[str, str]]:
    """(key, title) of each panel: the default ones some run logs, or ``metrics`` (each checked)."""
    logged = set().union(*(run.keys() for run in runs))
    if metrics is None:
        panels = [(key, title) for key, title in PANELS if key in logged]
        if not panels:
            raise PlotError(f"{', '.join(str(r.source) for r in runs)}: none of {', '.join(k for k, _ in PANELS)} "
                            f"is logged. Fix: name the metrics to draw with --metrics")
        return panels
    if not metrics:
        raise PlotError("--metrics names no metric. Fix: e.g. --metrics reward/mean,eval/accuracy, or leave it out")
    for key in metrics:
        if key not in logged:
            close = difflib.get_close_matches(key, sorted(logged), n=5, cutoff=0.4) or sorted(logged)[:8]
            raise PlotError(f"--metrics: no run logs {key!r}. Fix: use one of the logged keys, e.g. "
                            f"{', '.join(close)}")
    return [(key, TITLES.get(key, key)) for key in metrics]


def panels_of(runs: list[Run], *, x: str = "step", smooth: float = DEFAULT_SMOOTH,
              metrics: list[str] | None = None) -> list[Panel]:
    """The curves of every panel; the run's color is the same in each (matplotlib's cycle C0, C1, ...)."""
    if x not in X_CHOICES:
        raise PlotError(f"--x {x!r} is not a choice. Fix: --x {', --x '.join(X_CHOICES[:-1])} or --x {X_CHOICES[-1]}")
    if not 0 <= smooth < 1:
        raise PlotError(f"--smooth {smooth}: the moving average's weight must be in [0, 1). Fix: e.g. --smooth 0.6 "
                        f"(TensorBoard's default), or --smooth 0 for none")
    panels = []
    for key, title in choose_panels(runs, metrics):
        curves = []
        for i, run in enumerate(runs):
            band = None
            if run.members:
                xs, ys, sds = group_series(run, key, x)
                band = ([m - d for m, d in zip(ys, sds)], [m + d for m, d in zip(ys, sds)])
            else:
                xs, ys = series(run, key, x)
            if xs:
                smoothed = ema(ys, smooth) if smooth and len(ys) > 1 and not key.startswith("eval/") else None
                curves.append(Curve(run, f"C{i % 10}", xs, ys, smoothed, band))
        panels.append(Panel(key, title, curves))
    return panels


def time_unit(panels: list[Panel]) -> tuple[str, float]:
    """(unit, seconds per unit) for the time axis: seconds, minutes or hours by the longest run."""
    longest = max((max(c.x) for p in panels for c in p.curves), default=0.0)
    return ("h", 3600.0) if longest > 2 * 3600 else ("min", 60.0) if longest > 120 else ("s", 1.0)


def x_label(x: str, unit: str, runs: list[Run]) -> str:
    if x == "step":
        return "step"
    if x == "samples":
        return "samples trained (trajectories, cumulative)"
    if x == "tokens":
        return "tokens trained (prompt and completion, cumulative)"
    return f"training time ({unit}{'; stops left out, dotted: resumed' if any(r.resumes for r in runs) else ''})"


# ------------------------------------------------------------------ matplotlib
def build_figure(runs: list[Run], *, x: str = "step", smooth: float = DEFAULT_SMOOTH,
                 metrics: list[str] | None = None, title: str | None = None):
    """The matplotlib Figure of ``runs``: one panel per metric, one legend entry per run (its label)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("areal plot needs matplotlib. Fix: pip install 'matplotlib>=3.7' (the core's plot extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from matplotlib.ticker import MaxNLocator

    panels = panels_of(runs, x=x, smooth=smooth, metrics=metrics)
    unit, per = time_unit(panels) if x == "time" else ("", 1.0)
    cols = 2 if len(panels) > 4 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols if cols == 1 else 13, 2.4 * rows + 0.8), sharex=True,
                             squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        for curve in panel.curves:
            xs = [v / per for v in curve.x]
            marker = "o" if len(xs) < 12 or curve.smooth is None else None
            if curve.band is not None:
                ax.fill_between(xs, *curve.band, color=curve.color, alpha=0.18, linewidth=0)
            if curve.smooth is None:
                ax.plot(xs, curve.raw, color=curve.color, marker=marker, markersize=3, linewidth=1.6)
            else:
                ax.plot(xs, curve.raw, color=curve.color, alpha=0.25, linewidth=1)
                ax.plot(xs, curve.smooth, color=curve.color, linewidth=1.8)
            if x == "time":
                for at in curve.run.resumes:
                    ax.axvline(at / per, color=curve.color, linestyle=":", linewidth=1, alpha=0.6)
            if panel.key == "eval/accuracy" and len(runs) == 1:
                for s, v in zip(xs, curve.raw):
                    ax.annotate(f"{v:.2f}", (s, v), textcoords="offset points", xytext=(0, 5), fontsize=7,
                                ha="center")
        if panel.key.endswith("accuracy"):
            ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel(panel.key.split("/")[0])
        ax.set_title(panel.title, fontsize=9)
        ax.grid(alpha=0.3)
        if x in WHOLE_X:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5
        ax.tick_params(labelbottom=True)  # every panel's own axis: a two-column grid has no single bottom row
        ax.set_xlabel(x_label(x, unit, runs), fontsize=8)
    fig.suptitle(page_title(runs, x), fontsize=10)
    handles = [Line2D([], [], color=f"C{i % 10}", linewidth=1.8) for i in range(len(runs))]
    fig.legend(handles, [r.label for r in runs], loc="outside upper center", ncol=min(len(runs), 4), fontsize=8,
               frameon=False, title=title, title_fontsize=8)
    return fig


# ------------------------------------------------------------------ plotly
def build_html_figure(runs: list[Run], *, x: str = "step", smooth: float = DEFAULT_SMOOTH,
                      metrics: list[str] | None = None, title: str | None = None):
    """The plotly Figure of ``runs``: the same panels, colors and legend as :func:`build_figure`; clicking a
    legend entry hides that run in every panel."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise PlotError("areal plot --html needs plotly. Fix: pip install 'plotly>=5.15' (the core's plot extra)") from None
    from matplotlib.colors import to_hex

    panels = panels_of(runs, x=x, smooth=smooth, metrics=metrics)
    unit, per = time_unit(panels) if x == "time" else ("", 1.0)
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.25 / len(panels),
                        subplot_titles=[p.title for p in panels])
    shown: set[str] = set()
    for row, panel in enumerate(panels, 1):
        for curve in panel.curves:
            color, xs = to_hex(curve.color), [v / per for v in curve.x]
            common = dict(legendgroup=curve.run.label, hovertemplate=f"{curve.run.label}<br>%{{x}}: %{{y:.4g}}"
                          "<extra></extra>")
            if curve.band is not None:
                fig.add_trace(go.Scatter(x=xs + xs[::-1], y=curve.band[1] + curve.band[0][::-1], fill="toself",
                                         fillcolor=color, opacity=0.18, line=dict(width=0), hoverinfo="skip",
                                         showlegend=False, name=f"{curve.run.label} (one sd)",
                                         legendgroup=curve.run.label), row=row, col=1)
            if curve.smooth is not None:
                fig.add_trace(go.Scatter(x=xs, y=curve.raw, mode="lines", line=dict(color=color, width=1),
                                         opacity=0.25, showlegend=False, name=f"{curve.run.label} (raw)", **common),
                              row=row, col=1)
            fig.add_trace(go.Scatter(x=xs, y=curve.smooth if curve.smooth is not None else curve.raw,
                                     mode="lines" if curve.smooth is not None else "lines+markers",
                                     line=dict(color=color, width=2), name=curve.run.label,
                                     showlegend=curve.run.label not in shown, **common), row=row, col=1)
            shown.add(curve.run.label)
            if x == "time":
                for at in curve.run.resumes:
                    fig.add_vline(x=at / per, line=dict(color=color, dash="dot", width=1), row=row, col=1)
        fig.update_yaxes(title_text=panel.key.split("/")[0], row=row, col=1)
    fig.update_xaxes(title_text=x_label(x, unit, runs), row=len(panels), col=1)
    if x in WHOLE_X:
        fig.update_xaxes(tickformat="d")  # integer ticks: no step 2.5
    fig.update_layout(height=260 * len(panels) + 120, template="plotly_white", hovermode="x unified",
                      title=dict(text=title or page_title(runs, x), font=dict(size=12)),
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    return fig


def page_title(runs: list[Run], x: str) -> str:
    """``areal plot: <run labels> by <x>``: the figure's heading and the HTML page's title (a browser tab)."""
    names = ", ".join(r.label for r in runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")
    return f"areal plot: {names} by {x}"


# ------------------------------------------------------------------ writing
def _default_out(runs: list[Run], html: bool) -> Path:
    name = f"{'curves' if len(runs) == 1 else 'compare'}.{'html' if html else 'png'}"
    if len(runs) > 1:
        return Path(name)
    source = runs[0].source
    folder = source if source.is_dir() else source.parent
    if runs[0].kind == "trl" and folder.name.startswith("checkpoint-"):
        folder = folder.parent
    return folder / name


def _write_atomically(out: Path, write) -> None:
    """``write(tmp)`` then rename onto ``out``: a reader never sees half a file; a failure leaves none."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}{out.suffix}")
    try:
        write(tmp)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def plot_runs(paths: list[Path], out: Path | None = None, *, x: str = "step", smooth: float = DEFAULT_SMOOTH,
              metrics: list[str] | None = None, html: bool = False, seeds: bool = False) -> Path:
    """Draw ``paths`` (see the module docstring) into ``out`` (a PNG/SVG/PDF, or an HTML page with ``html`` or an
    ``.html`` out) and return its path. Default: ``curves.png`` in a single run's folder, ``compare.png`` here
    for several."""
    if not paths:
        raise PlotError(f"no run given. Fix: areal plot RUN [RUN ...], each RUN {RUN_FORMS}")
    html = html or (out is not None and out.suffix == ".html")
    if out is not None:
        out = Path(out)
        if html and out.suffix != ".html":
            raise PlotError(f"--out {out}: an --html page is written to a .html file. "
                            f"Fix: --out {out.with_suffix('.html')}")
        if not html and out.suffix.lower() not in STATIC_FORMATS:
            raise PlotError(f"--out {out}: {out.suffix or 'no suffix'} is not a format areal plot writes. Fix: end it "
                            f"in {', '.join(STATIC_FORMATS)}, or .html (an interactive page)")
        if not out.parent.is_dir():
            raise PlotError(f"--out {out}: the folder {out.parent} does not exist. Fix: create it, or write elsewhere")
    runs = [load_run(p) for p in paths]
    if seeds:
        runs = group_seeds(runs)
    label_runs(runs)
    title = str(runs[0].source) if len(runs) == 1 else None
    out = out or _default_out(runs, html)
    if html:
        page = build_html_figure(runs, x=x, smooth=smooth, metrics=metrics, title=title).to_html(
            include_plotlyjs=True, full_html=True)  # plotly.js inline: the page opens from disk, offline
        # plotly writes no <title>: name the page (the browser's tab, bookmarks) after what it draws
        page = page.replace("<head>", f"<head><meta charset=\"utf-8\"><title>{html_escape(page_title(runs, x))}"
                                      "</title>", 1)
        _write_atomically(out, lambda tmp: tmp.write_text(page, encoding="utf-8"))
        return out
    fig = build_figure(runs, x=x, smooth=smooth, metrics=metrics, title=title)
    import matplotlib.pyplot as plt

    try:
        _write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format=out.suffix.lower()[1:]))
    finally:
        plt.close(fig)
    return out


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """One run's curves (default ``RUN_DIR/curves.png``); see :func:`plot_runs`."""
    return plot_runs([run_dir], out)
