"""``areal eval CHECKPOINT_OR_MODEL [CONFIG] [key=value ...]``: score a checkpoint or a base model on the dataset's
validation split, as the trainer does (the work is :mod:`areal_core.evaluate`'s; this module wires the command)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from areal_cli.builtin import DEMO_CONFIG, OverridesArg, _split, console, err

TargetArg = Annotated[str, typer.Argument(
    metavar="CHECKPOINT_OR_MODEL",
    help="a checkpoint folder (runs/<experiment>/<trial>/checkpoints/step-N), a run folder (its latest checkpoint), "
         "a Hugging Face model folder or a name a plugin resolves, or 'demo' (the built-in demo model)")]
EvalConfigArg = Annotated[Optional[str], typer.Argument(
    help="YAML run config (a file path); omit for the run's own config.yaml (a checkpoint of a run) or the "
         "built-in demo (a base model)")]
EvalOutOpt = Annotated[Optional[Path], typer.Option(
    "--out", help="where to write the results (default: eval.json in the checkpoint folder; ./eval.json for a "
                  "base model)")]


def eval_command(target: TargetArg, config: EvalConfigArg = None, overrides: OverridesArg = None,
                 out: EvalOutOpt = None) -> None:
    """Score a checkpoint (or a base model) on the dataset's validation split with the run's workflow and reward.

    eval.size items, eval.samples samples each at eval.temperature (greedy by default): pass@k and mean@k (k =
    eval.samples) and the mean reward, through the configured inference engine, its servers started on this
    machine as `areal run` starts them. Results go to eval.json (--out), written atomically, and a table.
    """
    from areal_core.evaluate import EvalError, ServedModel, resolve_target

    try:
        resolved = resolve_target(target)
    except EvalError as exc:
        _fail(str(exc))
    config_file, overrides = _config(config, overrides, resolved)
    destination = _destination(out, resolved)
    if any(o.split("=", 1)[0].strip() == "model.path" for o in overrides):
        _fail(f"model.path: the model evaluated is CHECKPOINT_OR_MODEL ({target!r}). Fix: drop the model.path "
              f"override and pass the model as CHECKPOINT_OR_MODEL")
    began = time.monotonic()
    try:
        with ServedModel(resolved) as served:
            run = _validate(config_file, [*overrides, f"model.path={_yaml_string(served)}"])
            per_item: list = []
            metrics = _evaluate(run, resolved, per_item)
    except EvalError as exc:
        _fail(str(exc))
    _write_and_show(resolved, run, metrics, config_file, overrides, destination, time.monotonic() - began,
                    per_item)


def _fail(message: str) -> None:
    err.print(f"areal eval: {message}")
    raise typer.Exit(1)


def _yaml_string(text: str) -> str:
    """An override value read back as exactly ``text`` (a path may look like a number or hold a colon)."""
    return "'" + text.replace("'", "''") + "'"


def _config(config: str | None, overrides: list[str] | None, target) -> tuple[str, list[str]]:
    """CONFIG (a first argument with '=' is an override, as for `areal run`), by default the run's own
    config.yaml for a checkpoint of a run, else the built-in demo; and the overrides."""
    path, overrides = _split(config, overrides)
    if config is None or path != config:  # no CONFIG given: only overrides
        path = str(target.run_config or DEMO_CONFIG)
    return path, overrides


def _destination(out: Path | None, target) -> Path:
    destination = (out if out is not None else (target.checkpoint / "eval.json" if target.checkpoint is not None
                                                 else Path("eval.json"))).expanduser()
    if destination.is_dir():
        _fail(f"--out {str(destination)!r} is a folder. Fix: name the file to write, e.g. --out "
              f"{destination / 'eval.json'}")
    parent = destination.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        what = "does not exist" if not parent.is_dir() else "is not writable"
        _fail(f"{'--out' if out is not None else 'eval.json'}: the folder {str(parent)!r} {what}, so "
              f"{destination.name} cannot be written there. Fix: pass --out with a file in a writable folder")
    return destination


def _validate(config_file: str, overrides: list[str]):
    from areal_core.config.validate import validate_run
    from areal_core.problems import ProblemsError, format_problems

    try:
        run = validate_run(config_file, overrides)
    except ProblemsError as exc:
        _fail(str(exc))
    if run.problems:
        source = "the built-in demo" if config_file == str(DEMO_CONFIG) else config_file
        _fail(format_problems(run.problems, source))
    return run


def _evaluate(run, target, per_item: list) -> dict[str, float]:
    """The evaluation, its server logs in the run's logs/ (a base model's: a temporary folder, kept and named
    when something failed)."""
    from areal_core.evaluate import EvalError, evaluate
    from areal_core.processes.supervisor import ProcessFailed, Shutdown

    temporary = target.run_dir is None or not os.access(target.run_dir, os.W_OK)
    log_dir = Path(tempfile.mkdtemp(prefix="areal-eval-logs-")) if temporary else target.run_dir / "logs"
    keep = False
    try:
        metrics = evaluate(run, log_dir, step=target.step, say=lambda line: err.print(line), per_item=per_item)
    except Shutdown as exc:
        err.print(f"areal eval stopped ({exc}); every server it started was stopped; nothing was written")
        raise typer.Exit(exc.exit_code) from None
    except EvalError:
        raise
    except (ProcessFailed, TimeoutError, RuntimeError, OSError, ValueError) as exc:
        # a server that did not come up, an episode that failed, an evaluation that took too long: the message
        # names which and quotes its log; the traceback would only show where this process waited
        keep = True
        _fail(f"the evaluation failed: {exc}\n(server logs: {log_dir}). Nothing was written.")
    finally:
        if temporary and not keep:
            shutil.rmtree(log_dir, ignore_errors=True)
    return metrics


def _write_and_show(target, run, metrics: dict[str, float], config_file: str, overrides: list[str],
                    destination: Path, seconds: float, per_item: list) -> None:
    from areal_core.evaluate import DEMO_MODEL, report, write_report

    data = report(target, run, metrics, config_file, overrides, seconds, per_item)
    try:
        write_report(data, destination)
    except OSError as exc:
        _fail(f"cannot write {destination}: {exc.strerror or exc}. Fix: pass --out with a file in a writable folder")
    k = data["k"]
    table = Table(title=f"areal eval: {target.given}", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")
    evaluated = f"checkpoint of step {target.step}" if target.kind == "checkpoint" else "base model"
    table.add_row("evaluated", f"{evaluated}: {target.model or DEMO_MODEL}" + (" (LoRA merged)" if target.lora else ""))
    table.add_row("dataset", f"{run.config.dataset.name} (validation), {data['items']} items")
    table.add_row("samples", f"k = {k} at temperature {run.config.eval.temperature:g}")
    table.add_row(f"pass@{k}", f"{data['pass@k']:.4f}")
    table.add_row(f"mean@{k}", f"{data['mean@k']:.4f}")
    if data["reward_mean"] is not None:
        table.add_row("mean reward", f"{data['reward_mean']:.4f}")
    if "eval/completion_tokens_mean" in metrics:
        table.add_row("completion tokens", f"{metrics['eval/completion_tokens_mean']:.2f} (mean)")
    table.add_row("time", f"{seconds:.1f} s")
    table.add_row("written", str(destination))
    console.print(table)
    sys.stdout.flush()
