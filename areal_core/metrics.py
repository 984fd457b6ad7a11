"""Per-step metrics: one dict of scalars per trainer step, fanned out to sinks.

The trainer calls :meth:`MetricsLogger.log` once per step. The sinks are the
metrics loggers named by ``metrics.loggers``, found in the entry-point group
``areal.loggers``: the core's ``jsonl`` (``run_dir/metrics.jsonl``, always on)
and ``tensorboard`` (``run_dir/tensorboard/``), and plugins' (wandb, mlflow,
...). A live progress bar shows chosen fields on a TTY. A sink that cannot be
built or fails to write is reported once, with the fix, and switched off:
metrics never kill training.

Nothing heavy is imported at module load: tensorboardX, rich and the plugins'
libraries are imported by the classes that use them.
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
REQUIRED_LOGGER = "jsonl"  # the launcher's live bar, `areal plot` and --resume read metrics.jsonl
DEFAULT_LOGGERS = ("jsonl", "tensorboard")

# label shown in the progress bar -> metric key it reads
DEFAULT_PROGRESS_FIELDS: dict[str, str] = {
    "reward": "reward/mean",
    "accuracy": "accuracy/mean",
    "staleness": "staleness/token_lag_mean",
    "tokens/s": "throughput/tokens_per_s",
}


@runtime_checkable
class MetricsSink(Protocol):
    """Where one step's scalars go. ``write`` is called once per step, in step order.

    A metrics logger (entry-point group ``areal.loggers``) is a callable, usually the sink class, called as
    ``factory(run_dir, resume_step=..., config=...)``: ``run_dir`` the run's folder (a :class:`~pathlib.Path`),
    ``resume_step`` the first step this process logs (1 for a fresh run; steps from there on may have been
    logged by an earlier process and are logged again), ``config`` the resolved run config as plain dicts and
    lists (``config.yaml``'s content). It may raise :class:`SinkError` (or any exception) when it cannot be
    used; so may ``write``. Either way it is reported once and switched off, and training goes on.

    Optional: ``write_samples(step, records)``, the step's trained samples as text (the records of
    ``completions.jsonl``: step, version, item, group, sample, prompt, completion, reward, ...), for a tracker
    that shows them as a table. Called after that step's ``write``, every ``metrics.completions_every`` steps.
    One that raises is reported once and gets no more samples; its ``write`` goes on.
    """

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class SinkError(Exception):
    """A metrics sink cannot go on: ``message`` says why, ``fix`` what the user can do (kept apart so the report
    says both; ``str()`` joins them)."""

    def __init__(self, message: str, fix: str) -> None:
        self.message, self.fix = message, fix
        super().__init__(f"{message}. Fix: {fix}")


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


def import_for_logger(module: str, logger: str, distribution: str) -> Any:
    """Import ``module``, the library metrics logger ``logger`` needs, or raise :class:`SinkError` naming the fix
    (``distribution`` is the logger's, which depends on the library)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SinkError(f"{module} cannot be imported ({e})",
                        f"pip install {distribution} (it brings {module.partition('.')[0]}), or leave {logger} out "
                        f"of metrics.loggers") from e


def run_names(run_dir: str | os.PathLike[str], config: Mapping[str, Any]) -> tuple[str, str]:
    """(experiment, trial) of a run, for a tracker's project and run names: the config's, else read from the run
    folder, ``<output_dir>/<experiment>/<trial>``."""
    folder = Path(run_dir).resolve()
    return str(config.get("experiment") or folder.parent.name), str(config.get("trial") or folder.name)


def finite_scalars(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """The finite numbers of ``metrics`` as plain Python numbers (numpy and 0-d torch scalars converted, bools as
    0 / 1); text, NaN and infinities left out. For sinks whose library takes only such values."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        number = _as_number(value)
        if number is not None and math.isfinite(number):
            out[key] = number
    return out


class JsonlSink:
    """``run_dir/metrics.jsonl``: one line ``{"step": n, "time": unix, **metrics}`` per step.

    Each write is flushed. Opening appends to an existing file (a resumed run
    continues it) after dropping a trailing partial line (a crash mid-write),
    any line that is not JSON, and, when ``resume_step`` is given, every line
    with ``step >= resume_step`` so that the resumed run does not repeat steps.
    Non-finite values are written as ``null`` (strict JSON); values that are not
    numbers are skipped.
    """

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
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
    events at steps >= resume_step. Raises :class:`SinkError` naming the fix
    when tensorboardX is not installed.
    """

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise SinkError(f"it needs tensorboardX ({e})",
                            "pip install tensorboardX, or leave tensorboard out of metrics.loggers") from e
        self.logdir = Path(run_dir) / TENSORBOARD_DIR
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(logdir=str(self.logdir), purge_step=resume_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, number in finite_scalars(metrics).items():
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


def logger_problems(loggers: Sequence[str]) -> list[Any]:
    """What is wrong with ``metrics.loggers``, found before the run starts and importing nothing: ``jsonl`` left
    out, a name given twice, a name no installed distribution provides in ``areal.loggers``."""
    from areal_core.catalogue import install_fix, provider
    from areal_core.problems import Problem
    from areal_core.registry import ComponentError, find

    key = "metrics.loggers"
    shown = "[" + ", ".join(str(name) for name in loggers) + "]"
    problems = []
    if REQUIRED_LOGGER not in loggers:
        problems.append(Problem(
            "core.loggers", f"{shown} leaves out {REQUIRED_LOGGER}, which is always needed: the launcher's live bar, "
            "`areal plot` and --resume read metrics.jsonl",
            f"{key}=[{', '.join([REQUIRED_LOGGER, *map(str, dict.fromkeys(loggers))])}]", key))
    twice = sorted({str(name) for name in loggers if list(loggers).count(name) > 1})
    if twice:
        problems.append(Problem("core.loggers", f"{shown} names {', '.join(twice)} more than once",
                                f"name each logger once: {key}=[{', '.join(map(str, dict.fromkeys(loggers)))}]",
                                key))
    for name in dict.fromkeys(loggers):
        try:
            find("logger", name)
        except ComponentError as exc:
            fix = exc.fix
            distribution = provider("logger", name)
            if distribution is not None:
                fix = f"{install_fix('logger', name)}; or leave '{name}' out of {key}"
            problems.append(Problem("core.component", f"{shown}: {exc.message}", fix, key))
    return problems


def _failure(error: BaseException, default_fix: str) -> str:
    """``<what went wrong>. Fix: <fix>`` for a sink's exception (a :class:`SinkError` or a ``ComponentError``
    brings its own fix)."""
    message, fix = getattr(error, "message", None), getattr(error, "fix", None)
    if not (isinstance(message, str) and isinstance(fix, str)):
        message, fix = f"{type(error).__name__}: {error}", default_fix
    return f"{message}. Fix: {fix}"


_WRITE_FIX = ("correct the cause and continue with --resume to log to it again (from the last checkpoint), or "
              "leave it out of metrics.loggers")


class BackgroundSink:
    """Another sink's writes on a thread of its own, so a slow tracker (a database, a network store that retries)
    never holds a training step.

    Steps are queued in order (at most ``max_queued``; past that a step is dropped for this sink, said once, rather
    than block training). A write that raises is handed to ``on_failure(step, error)`` once and the sink takes no
    more. :meth:`close` waits for the queue to drain, at most ``close_timeout_s``, then closes the sink on the
    writer's thread; a sink still writing then is named in a warning with how many steps it had left.
    Hand-written: a thread and a queue per sink is all it needs, and the standard library's QueueHandler is for
    log records.
    """

    _DONE = object()

    def __init__(self, sink: MetricsSink | None, label: str, on_failure: Any, *, max_queued: int = 10_000,
                 close_timeout_s: float = 30.0, build: Any = None, on_build_failure: Any = None,
                 start_timeout_s: float = 60.0) -> None:
        """``build``: instead of ``sink``, a callable that makes it, called on the writer's thread (a tracker's
        start-up, which may wait on the network, never holds training); steps queue meanwhile. One that raises
        goes to ``on_build_failure(error)``; one not done within ``start_timeout_s`` is reported the same way
        (a ``TimeoutError``) at the next write, and what it makes later is closed unused."""
        import queue
        import threading
        import time

        self.sink, self.label, self.on_failure = sink, label, on_failure
        self.on_samples_failure: Any = None  # set by MetricsLogger: a write_samples that raised, reported once
        self._samples_failed = False
        self.close_timeout_s = close_timeout_s
        self._build, self._on_build_failure = build, on_build_failure
        self._start_deadline = time.monotonic() + start_timeout_s
        self._start_timeout_s = start_timeout_s
        self._built = threading.Event()
        self._settled = threading.Event()  # built, or failed to: what wait_started waits for
        if build is None:
            self._built.set()
            self._settled.set()
        self._queue: Any = queue.Queue(max_queued)
        self._failed = self._dropping = False
        self._thread = threading.Thread(target=self._run, name=f"areal-metrics-{label}"[:60], daemon=True)
        self._thread.start()

    def wait_started(self) -> MetricsSink | None:
        """The sink once built (waiting at most until the start time limit); None when it failed or is late."""
        import time

        # a build that failed is not waited on to its time limit (it was: `targets` took 60 s per failed logger)
        self._settled.wait(max(0.0, self._start_deadline - time.monotonic()))
        return self.sink if self._built.is_set() and not self._failed else None

    def _build_here(self) -> bool:
        try:
            sink = self._build()
        except Exception as e:
            if not self._failed:
                self._failed = True
                self._on_build_failure(e)
            self._settled.set()
            return False
        if self._failed:  # given up on at the start time limit: what it made is not used
            try:
                sink.close()
            except Exception:
                pass
            return False
        self.sink = sink
        self._built.set()
        self._settled.set()
        return True

    def _run(self) -> None:
        if self._build is not None and not self._build_here():
            while self._queue.get() is not self._DONE:  # take what is queued, write nothing
                pass
            return
        while True:
            item = self._queue.get()
            if item is self._DONE:
                break
            if self._failed:
                continue
            kind, step, payload = item
            if kind == "samples":
                self._write_samples_here(step, payload)
                continue
            try:
                self.sink.write(step, payload)
            except Exception as e:
                self._failed = True
                self.on_failure(step, e)
        try:
            self.sink.close()
        except Exception as e:
            log.warning("%s failed to close: %s: %s", self.label, type(e).__name__, e)

    def _write_samples_here(self, step: int, records: list[dict]) -> None:
        write_samples = getattr(self.sink, "write_samples", None)
        if self._samples_failed or write_samples is None:
            return
        try:
            write_samples(step, records)
        except Exception as e:
            self._samples_failed = True
            if self.on_samples_failure is not None:
                self.on_samples_failure(step, e)

    def write_samples(self, step: int, records: list[dict]) -> None:
        """Queue the step's samples for the sink's ``write_samples`` (if it has one), after that step's write."""
        if self._failed or self._samples_failed:
            return
        self._put(("samples", step, [dict(r) for r in records]), step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        import time

        if not self._built.is_set() and not self._failed and time.monotonic() > self._start_deadline:
            self._failed = True
            self._on_build_failure(TimeoutError(f"it did not start within {self._start_timeout_s:g} s "
                                                "(metrics.logger_start_timeout_s)"))
        if self._failed:
            return
        self._put(("metrics", step, dict(metrics)), step)

    def _put(self, item: tuple, step: int) -> None:
        import queue

        try:
            self._queue.put_nowait(item)
        except queue.Full:
            if not self._dropping:
                self._dropping = True
                log.warning("%s is %d steps behind; step %d and later ones it cannot take are dropped for it "
                            "(training goes on; metrics.jsonl has every step)", self.label,
                            self._queue.maxsize, step)

    def close(self) -> None:
        import queue
        import time

        deadline = time.monotonic() + self.close_timeout_s
        try:
            self._queue.put(self._DONE, timeout=self.close_timeout_s)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("waited %.0f s for %s to write its last %d queued steps and close; left it (metrics.jsonl "
                        "has every step)", self.close_timeout_s, self.label, self._queue.qsize())

    def __repr__(self) -> str:
        return repr(self.sink) if self.sink is not None else self.label


WARNINGS_FILE = "warnings.jsonl"  # a run's warnings for the terminal: the launcher prints each line once


def _off_message(name: str, error: Exception) -> str:
    """Why metrics logger ``name`` is off for the run, and the fix."""
    from areal_core.catalogue import reinstall_line
    from areal_core.discovery import Found, import_failure
    from areal_core.registry import find

    try:
        entry = find("logger", name)
    except Exception:
        entry = None
    fix = f"correct the cause, or leave '{name}' out of metrics.loggers"
    if isinstance(error, ImportError) and entry is not None:  # a library the logger needs
        found = Found("areal.loggers", entry.name, entry.value, entry.distribution, entry.version)
        explained = import_failure(found, error)
        fix = (f"{explained[1]}, or leave '{name}' out of metrics.loggers" if explained else
               f"install what it needs (`{reinstall_line(entry.distribution)}` brings its dependencies), or "
               f"leave '{name}' out of metrics.loggers")
    return (f"metrics logger '{name}'{f' from {entry.owner}' if entry else ''} is off for this run (training goes "
            f"on; metrics.jsonl has every step): {_failure(error, fix)}")


class MetricsLogger:
    """Fan one step's metrics out to every sink and the progress display.

    A sink that raises is reported once (a logging warning naming it, what went
    wrong and the fix) and disabled for the rest of the run; the others go on.
    ``names`` (one per sink) name the sinks in those reports. Usable as a
    context manager; ``close`` closes every sink, even disabled ones, and never
    raises.
    """

    def __init__(
        self, sinks: Iterable[MetricsSink] = (), progress: ProgressDisplay | None = None, *,
        names: Sequence[str] | None = None, warnings_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.sinks: list[MetricsSink] = list(sinks)
        self.progress = progress
        self.disabled: list[MetricsSink] = []
        self._names = {id(sink): name for sink, name in zip(self.sinks, names or ())}
        self._closed = False
        self._samples_off: set[int] = set()
        self.warnings_path = Path(warnings_path) if warnings_path is not None else None

    def warn(self, message: str) -> None:
        """A logging warning, and a line of ``warnings_path`` (the launcher prints each on the terminal once)."""
        log.warning("%s", message)
        if self.warnings_path is not None:
            try:
                with open(self.warnings_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"time": time.time(), "message": message}) + "\n")
            except OSError:
                pass  # the log has it

    def _label(self, sink: MetricsSink) -> str:
        name = self._names.get(id(sink))
        return f"metrics logger '{name}' ({sink!r})" if name else f"metrics sink {sink!r}"

    @classmethod
    def for_run(
        cls,
        run_dir: str | os.PathLike[str],
        *,
        loggers: Sequence[str] = DEFAULT_LOGGERS,
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        resume_step: int | None = None,
        progress: bool = True,
        progress_fields: Mapping[str, str] | Sequence[str] = DEFAULT_PROGRESS_FIELDS,
        start_timeout_s: float = 60.0,
        warnings_path: str | os.PathLike[str] | None = None,
    ) -> MetricsLogger:
        """The run's sinks, built from the metrics loggers named in ``loggers`` (``metrics.loggers``), and a
        progress bar.

        Each is found in the entry-point group ``areal.loggers`` and called as ``factory(run_dir,
        resume_step=resume_step, config=config)``: ``jsonl`` here (the run cannot go without metrics.jsonl: its
        failure raises), every other one on a thread of its own (:class:`BackgroundSink`), so a tracker that
        waits on the network at start-up never holds the first step; one that cannot be imported or built, or
        has not started within ``start_timeout_s``, is reported once (:meth:`warn`, with the fix) and left out,
        an empty folder it made removed. ``config``: the resolved run config (``config.yaml``'s content), for
        the loggers that record hyperparameters and name the run.
        """
        from areal_core.registry import resolve

        run_dir = Path(run_dir)
        display = ProgressDisplay(
            total_steps, progress_fields, enabled=progress, start_step=resume_step or 0
        )
        logger = cls([], display, warnings_path=warnings_path)
        for name in dict.fromkeys(loggers):  # each once, in order
            try:
                factory = resolve("logger", name)
                if name == REQUIRED_LOGGER:  # metrics.jsonl is written in the step: a checkpoint's steps have theirs
                    sink = factory(run_dir, resume_step=resume_step, config=dict(config or {}))
                    logger.sinks.append(sink)
                    logger._names[id(sink)] = name
                    continue
            except Exception as e:
                if name == REQUIRED_LOGGER:
                    raise
                logger.warn(_off_message(name, e))
                continue

            def build(factory=factory):
                return factory(run_dir, resume_step=resume_step, config=dict(config or {}))

            before = set(run_dir.iterdir()) if run_dir.is_dir() else set()

            def failed_to_start(e: Exception, name=name, before=before) -> None:
                logger.warn(_off_message(name, e))
                for made in (set(run_dir.iterdir()) if run_dir.is_dir() else set()) - before:
                    if made.is_dir() and not any(made.iterdir()):  # an empty folder it left: gone
                        made.rmdir()

            logger.sinks.append(logger._in_background(None, name, build=build, on_build_failure=failed_to_start,
                                                      start_timeout_s=start_timeout_s))
        return logger

    @property
    def targets(self) -> list[MetricsSink]:
        """The sinks still written to, as the loggers built them (without their background writers); waits for
        those still starting, each at most until its start time limit."""
        out = []
        for sink in self.sinks:
            if isinstance(sink, BackgroundSink):
                sink = sink.wait_started()
            if sink is not None:
                out.append(sink)
        return out

    def _in_background(self, sink: MetricsSink | None, name: str = "", **build: Any) -> BackgroundSink:
        """``sink``'s writes on a thread of its own; with ``build=`` (and ``on_build_failure=``,
        ``start_timeout_s=``) the sink is made there too (:class:`BackgroundSink`)."""
        label = self._label(sink) if sink is not None else f"metrics logger '{name}'"

        def failed(step: int, error: Exception) -> None:
            built = wrapped.sink  # made on the writer's thread: named as the logger made it
            said = label if sink is not None or built is None else f"metrics logger '{name}' ({built!r})"
            self.warn(f"{said} failed at step {step} and is off for the rest of the run (training goes on; "
                      f"metrics.jsonl has every step): {_failure(error, _WRITE_FIX)}")

        wrapped = BackgroundSink(sink, label, failed, **build)

        def samples_failed(step: int, error: Exception) -> None:
            built = wrapped.sink
            said = label if sink is not None or built is None else f"metrics logger '{name}' ({built!r})"
            self._samples_refused(said, step, error)

        wrapped.on_samples_failure = samples_failed
        self._names[id(wrapped)] = name or (self._names.get(id(sink), "") if sink is not None else "")
        return wrapped

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
                self.warn(f"{self._label(sink)} failed at step {step} and is off for the rest of the run (training "
                          f"goes on; metrics.jsonl has every step): {_failure(e, _WRITE_FIX)}")
        if self.progress is not None:
            self.progress.update(step, metrics)

    def log_samples(self, step: int, records: Sequence[dict]) -> None:
        """The step's trained samples (``completions.jsonl``'s records) to every sink that takes them
        (``write_samples``); never raises because of a sink, and a sink whose ``write_samples`` raises gets no
        more samples (said once) but keeps its metrics."""
        if self._closed or not records:
            return
        for sink in list(self.sinks):
            if isinstance(sink, BackgroundSink):
                sink.write_samples(step, list(records))
                continue
            write_samples = getattr(sink, "write_samples", None)
            if write_samples is None or id(sink) in self._samples_off:
                continue
            try:
                write_samples(step, list(records))
            except Exception as e:
                self._samples_off.add(id(sink))
                self._samples_refused(self._label(sink), step, e)

    def _samples_refused(self, said: str, step: int, error: Exception) -> None:
        self.warn(f"{said} could not take the samples of step {step} and gets no more (its metrics go on; "
                  f"completions.jsonl has them): {_failure(error, _WRITE_FIX)}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks + self.disabled:
            try:
                sink.close()
            except Exception as e:
                log.warning("%s failed to close: %s: %s", self._label(sink), type(e).__name__, e)
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
