"""Per-step metrics: one dict of scalars per trainer step, fanned out to sinks.

The trainer calls :meth:`MetricsLogger.log` once per step. Sinks write
``run_dir/metrics.jsonl`` (always) and ``run_dir/tensorboard/`` (when
tensorboardX is installed); a live progress bar shows chosen fields on a TTY.
A sink that fails is reported once and switched off: metrics never kill training.

Nothing heavy is imported at module load: tensorboardX and rich are imported
by the classes that use them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# label shown in the progress bar -> metric key it reads
DEFAULT_PROGRESS_FIELDS: dict[str, str] = {
    "reward": "reward/mean",
    "accuracy": "accuracy/mean",
    "staleness": "staleness/token_lag_mean",
    "tokens/s": "throughput/tokens_per_s",
}


@runtime_checkable
class MetricsSink(Protocol):
    """Where one step's scalars go. ``write`` is called once per step, in step order."""

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _as_number(value: Any) -> float | int | None:
    """A plain Python number for ``value`` (python, numpy or 0-d torch scalar), else None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class JsonlSink:
    """``run_dir/metrics.jsonl``: one line ``{"step": n, "time": unix, **metrics}`` per step.

    Each write is flushed. Opening appends to an existing file (a resumed run
    continues it) after dropping a trailing partial line (a crash mid-write),
    any line that is not JSON, and, when ``resume_step`` is given, every line
    with ``step >= resume_step`` so that the resumed run does not repeat steps.
    Non-finite values are written as ``null`` (strict JSON); values that are not
    numbers are skipped.
    """

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / JSONL_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            truncate_jsonl(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            number = _as_number(value)
            if number is None:
                continue
            record[key] = number if math.isfinite(number) else None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


def truncate_jsonl(path: Path, resume_step: int | None) -> None:
    """Keep only complete JSON lines with step < resume_step; rewrite atomically if anything goes."""
    if not path.exists():
        return
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete = lines[:-1]  # the last piece is b"" when the file ends in a newline, else a partial line
    kept: list[bytes] = []
    for line in complete:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if resume_step is not None:
            step = record.get("step")
            if not isinstance(step, int) or step >= resume_step:
                continue
        kept.append(line)
    new = b"".join(line + b"\n" for line in kept)
    if new == data:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(new)
    os.replace(tmp, path)


class TensorboardSink:
    """``run_dir/tensorboard/`` event files through tensorboardX; scalars only.

    Non-finite and non-numeric values are skipped. With ``resume_step`` the
    event file carries a purge marker so TensorBoard hides the old run's
    events at steps >= resume_step. Raises ImportError naming the fix when
    tensorboardX is not installed.
    """

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError(
                f"TensorboardSink needs tensorboardX ({e}); fix: pip install tensorboardX"
            ) from e
        self.logdir = Path(run_dir) / TENSORBOARD_DIR
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(logdir=str(self.logdir), purge_step=resume_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            number = _as_number(value)
            if number is None or not math.isfinite(number):
                continue
            self._writer.add_scalar(key, number, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __repr__(self) -> str:
        return f"TensorboardSink({str(self.logdir)!r})"


def _format_value(value: Any) -> str:
    number = _as_number(value)
    if number is None:
        return str(value)
    if isinstance(number, int):
        return str(number)
    if not math.isfinite(number):
        return str(number)
    if abs(number) >= 1000:
        return f"{number:,.0f}"
    return f"{number:.4g}"


class ProgressDisplay:
    """A rich live bar: step / total, elapsed, ETA and chosen fields as text.

    ``fields`` maps the label shown to the metric key read (a sequence of keys
    uses each key as its label). A field missing from a step shows ``-``.
    Disabled, writing nothing at all, when ``enabled`` is False or the console
    is not a terminal. ``update`` and ``close`` never raise.
    """

    def __init__(
        self,
        total: int | None,
        fields: Mapping[str, str] | Sequence[str] = DEFAULT_PROGRESS_FIELDS,
        *,
        enabled: bool = True,
        start_step: int = 0,
        console: Any = None,
        description: str = "train",
    ) -> None:
        self.fields: dict[str, str] = (
            dict(fields) if isinstance(fields, Mapping) else {key: key for key in fields}
        )
        self._values: dict[str, str] = {label: "-" for label in self.fields}
        self._progress: Any = None
        self._task: Any = None
        if not enabled:
            return
        from rich.console import Console

        console = console if console is not None else Console(stderr=True, emoji=False)
        if not console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task(
            description, total=total, completed=start_step, info=self._info()
        )
        self._progress.start()

    @property
    def enabled(self) -> bool:
        return self._progress is not None

    def _info(self) -> str:
        return "  ".join(f"{label} {text}" for label, text in self._values.items())

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show that ``step`` (0-based) is done, with this step's fields."""
        if self._progress is None:
            return
        try:
            for label, key in self.fields.items():
                self._values[label] = _format_value(metrics[key]) if key in metrics else "-"
            self._progress.update(self._task, completed=step + 1, info=self._info())
        except Exception as e:  # a display glitch must never stop training
            log.debug("progress display update failed: %s", e)

    def close(self) -> None:
        if self._progress is None:
            return
        try:
            self._progress.stop()
        except Exception as e:
            log.debug("progress display close failed: %s", e)
        self._progress = None


class MetricsLogger:
    """Fan one step's metrics out to every sink and the progress display.

    A sink that raises is reported once (a logging warning naming it) and
    disabled for the rest of the run; the others go on. Usable as a context
    manager; ``close`` closes every sink, even disabled ones, and never raises.
    """

    def __init__(
        self, sinks: Iterable[MetricsSink] = (), progress: ProgressDisplay | None = None
    ) -> None:
        self.sinks: list[MetricsSink] = list(sinks)
        self.progress = progress
        self.disabled: list[MetricsSink] = []
        self._closed = False

    @classmethod
    def for_run(
        cls,
        run_dir: str | os.PathLike[str],
        *,
        total_steps: int | None = None,
        resume_step: int | None = None,
        tensorboard: bool = True,
        progress: bool = True,
        progress_fields: Mapping[str, str] | Sequence[str] = DEFAULT_PROGRESS_FIELDS,
    ) -> MetricsLogger:
        """The usual set for a run: JSONL, TensorBoard (if installed) and a progress bar.

        A missing tensorboardX is a warning, not an error."""
        sinks: list[MetricsSink] = [JsonlSink(run_dir, resume_step)]
        if tensorboard:
            try:
                sinks.append(TensorboardSink(run_dir, resume_step))
            except ImportError as e:
                log.warning("TensorBoard logging is off: %s", e)
        display = ProgressDisplay(
            total_steps, progress_fields, enabled=progress, start_step=resume_step or 0
        )
        return cls(sinks, display)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for ``step`` everywhere; never raises because of a sink.

        After :meth:`close` it does nothing."""
        if self._closed:
            return
        metrics = dict(metrics)
        for sink in list(self.sinks):
            try:
                sink.write(step, metrics)
            except Exception as e:
                self.sinks.remove(sink)
                self.disabled.append(sink)
                log.warning(
                    "metrics sink %r failed at step %d and is disabled for the rest of the run: %s: %s",
                    sink, step, type(e).__name__, e,
                )
        if self.progress is not None:
            self.progress.update(step, metrics)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks + self.disabled:
            try:
                sink.close()
            except Exception as e:
                log.warning("metrics sink %r failed to close: %s: %s", sink, type(e).__name__, e)
        if self.progress is not None:
            self.progress.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summarize(values: Sequence[float], prefix: str) -> dict[str, float]:
    """``{prefix}/mean``, ``/std`` (population), ``/min``, ``/max`` of ``values``; {} when empty."""
    if not values:
        return {}
    xs = [float(v) for v in values]
    n = len(xs)
    mean = math.fsum(xs) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / n)
    return {
        f"{prefix}/mean": mean,
        f"{prefix}/std": std,
        f"{prefix}/min": min(xs),
        f"{prefix}/max": max(xs),
    }


def histogram(values: Iterable[int]) -> dict[int, int]:
    """Count of each value, keys ascending (e.g. staleness lag -> number of samples). A numpy array is counted by
    numpy (a batch's hundreds of thousands of token lags)."""
    if hasattr(values, "dtype"):
        import numpy

        keys, counts = numpy.unique(values, return_counts=True)
        return {int(k): int(n) for k, n in zip(keys, counts)}
    return dict(sorted(Counter(int(v) for v in values).items()))
