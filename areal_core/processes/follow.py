"""Following a run from the terminal that started it, for every launcher: the live progress bar from
``metrics.jsonl`` (:class:`MetricsTail`), the failure report with the last complete checkpoint, and the exact
command that continues the run."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from areal_core.rollout.elastic import EVENTS_FILE

console = Console(stderr=True, highlight=False, markup=False, soft_wrap=True, emoji=False)


class MetricsTail:
    """Follows ``metrics.jsonl`` and feeds the progress display (the trainers' output goes to log files).

    The trainer may rewrite the file on resume (dropping steps after the
    checkpoint), so a replaced or shorter file is read again from the start.
    Evaluations of steps up to ``announced_until`` (a resumed run's
    checkpoint step: the earlier run's rows) are shown on the bar but not
    announced again. A display problem is never allowed to stop the run.
    """

    def __init__(self, run_dir: Path, total: int, announced_until: int = -1) -> None:
        from areal_core.metrics import ProgressDisplay

        self.path = run_dir / "metrics.jsonl"
        self.identity: tuple[int, int] | None = None
        self.offset = 0
        self.display = ProgressDisplay(total, {"reward": "reward/mean", "accuracy": "eval/accuracy",
                                               "staleness": "staleness/token_lag_mean",
                                               "gen tok/s": "throughput/gen_tokens_per_s",
                                               "train tok/s": "throughput/train_tokens_per_s"})
        self.last_eval: dict = {}
        self.announced_until = announced_until
        # A resumed run's file as it was at launch: rows there come from the earlier run, also those after the
        # checkpoint that the trainer is about to drop.
        self.earlier: tuple[tuple[int, int], int] | None = None
        if announced_until >= 0 and self.path.exists():
            stat = self.path.stat()
            self.earlier = ((stat.st_ino, stat.st_dev), stat.st_size)
        # Servers that left or joined routing (the trainer's rows): only this run's, shown as they come.
        self.events_path = run_dir / EVENTS_FILE
        self.events_offset = self.events_path.stat().st_size if self.events_path.exists() else 0
        # The trainer's warnings for the terminal (a tracker switched off, ...): this run's, each once.
        from areal_core.metrics import WARNINGS_FILE

        self.warnings_path = run_dir / WARNINGS_FILE
        self.warnings_offset = self.warnings_path.stat().st_size if self.warnings_path.exists() else 0
        self._say_lock = threading.Lock()

    def poll(self) -> bool:
        try:
            self._read_new_rows()
        except (OSError, ValueError):
            pass  # a half-written or replaced file: read again next time
        try:
            self._read_new_events()
        except (OSError, ValueError):
            pass
        try:
            if self.warnings_path.exists():
                for self.warnings_offset, line in _complete_lines(self.warnings_path, self.warnings_offset):
                    self.say(f"warning: {json.loads(line)['message']}")
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return False

    def _read_new_events(self) -> None:
        if not self.events_path.exists():
            return
        for self.events_offset, line in _complete_lines(self.events_path, self.events_offset):
            row = json.loads(line)
            self.say(f"inference server {row['server']} {row['event']}"
                     f"{' routing' if row['event'] in ('left', 'joined') else ''} at step {row.get('step', '?')}"
                     f": {row.get('why', '')}")

    def say(self, line: str) -> None:
        """One line above the bar (or alone when stderr is not a terminal); any thread may call it."""
        with self._say_lock:
            progress = getattr(self.display, "_progress", None)
            if progress is not None:
                progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=sys.stderr, flush=True)

    def _read_new_rows(self) -> None:
        if not self.path.exists():
            return
        stat = self.path.stat()
        if (stat.st_ino, stat.st_dev) != self.identity or stat.st_size < self.offset:
            self.identity, self.offset = (stat.st_ino, stat.st_dev), 0
        for self.offset, line in _complete_lines(self.path, self.offset):
            row = json.loads(line)
            if "eval/accuracy" in row:
                self.last_eval = {k: v for k, v in row.items() if k.startswith("eval/")}
                earlier = self.earlier is not None and self.identity == self.earlier[0] \
                    and self.offset <= self.earlier[1]
                if row["step"] > self.announced_until and not earlier:
                    self._say_eval(row)
            self.display.update(row["step"] - 1, {**self.last_eval, **row})  # accuracy stays shown

    def _say_eval(self, row: dict) -> None:
        """One line per evaluation, above the bar (or alone when stderr is not a terminal)."""
        after = int(row.get("eval/after_step", row["step"]))
        when = "before training" if after == 0 else f"after step {after}"
        line = (f"eval {when}: accuracy {row['eval/accuracy']:.3f} on {int(row.get('eval/items', 0))} "
                f"validation items")
        if row.get("eval/reward_mean") is not None:
            line += f", mean reward {row['eval/reward_mean']:.3f}"
        self.say(line)

    def close(self) -> None:
        self.display.close()


def _complete_lines(path: Path, offset: int) -> Iterator[tuple[int, bytes]]:
    """The lines of ``path`` after byte ``offset`` that a writer has finished (newline-ended), each with the
    offset just past it; a half-written last line waits for the next call."""
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            if not line.endswith(b"\n"):
                return
            offset += len(line)
            yield offset, line


def resume_command(argv: list[str] | None = None) -> str:
    """The command that continues this run: ``areal`` with the arguments this process was given (``argv``,
    default ``sys.argv``), plus ``--resume``, quoted for a POSIX shell. When this process was not started as
    ``areal run ...`` (a script calling a launcher), the general form."""
    import shlex

    args = list(sys.argv if argv is None else argv)[1:]
    if args[:1] != ["run"]:
        return "areal run CONFIG [key=value ...] --resume (the command that started the run)"
    return shlex.join(["areal", *args, *([] if "--resume" in args else ["--resume"])])


def report_failure(message: str, run_dir: Path) -> int:
    """Say that the run failed and, when a checkpoint is complete, how to continue from it; the exit status (1).
    Every launcher ends a failed run with these words."""
    console.print(f"areal run failed: {message}")
    saved = checkpoint_step(run_dir)
    if saved > 0:
        console.print(f"The checkpoint of step {saved} is complete and verifies: continue from it with: "
                      f"{resume_command()}", highlight=False, markup=False)
    return 1


def checkpoint_step(run_dir: Path, verified: bool = True) -> int:
    """The step of the run's newest checkpoint that verifies against its manifest; 0 when there is none (or none
    can be read): the step ``--resume`` continues from. ``verified=False``: of the newest complete one, without
    reading its files (where the step only starts a progress bar: the trainer verifies before it loads)."""
    from areal_core.checkpoint import CheckpointDamagedError, CheckpointStore

    store = CheckpointStore(run_dir / "checkpoints")
    try:
        found = store.resumable()[0] if verified else store.latest()
        return int(store.load_meta(found)["step"]) if found is not None else 0
    except (OSError, ValueError, KeyError, TypeError, CheckpointDamagedError):
        return 0
