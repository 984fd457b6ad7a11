"""``areal plot RUN_DIR``: reward and validation accuracy curves of a run, as a PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

# (metric key, label) per panel; a panel is drawn when its key appears in the run's metrics.
PANELS = [
    ("reward/mean", "training reward (mean per step)"),
    ("eval/accuracy", "validation accuracy"),
    ("staleness/token_lag_mean", "token staleness (versions, mean)"),
    ("throughput/gen_tokens_per_s", "generation tokens/s"),
]


class PlotError(ValueError):
    """A run folder that cannot be plotted; the message says why and what to do."""


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise PlotError(f"{run_dir} has no metrics.jsonl. Fix: pass the run folder "
                        f"(<output_dir>/<experiment>/<trial>, the one holding config.yaml)")
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


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the curves PNG (default ``RUN_DIR/curves.png``) atomically; return its path."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("areal plot needs matplotlib. Fix: pip install 'areal-core[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    panels = [(key, label, *series(rows, key)) for key, label in PANELS]
    panels = [p for p in panels if p[2]]
    if not panels:
        raise PlotError(f"{run_dir / 'metrics.jsonl'} has none of {', '.join(k for k, _ in PANELS)}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, label, steps, values) in zip(axes[:, 0], panels):
        ax.plot(steps, values, marker="o" if len(steps) < 12 else None, markersize=3)
        ax.set_ylabel(key.split("/")[0])
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        if key == "eval/accuracy":
            ax.set_ylim(-0.02, 1.02)
            for s, v in zip(steps, values):
                ax.annotate(f"{v:.2f}", (s, v), textcoords="offset points", xytext=(0, 5), fontsize=7, ha="center")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(str(run_dir), fontsize=8)
    fig.tight_layout()
    out = out or run_dir / "curves.png"
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out
