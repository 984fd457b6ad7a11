"""Built-in CLI commands, registered through ``areal_register_commands`` like a plugin's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from areal_core.hookspecs import hookimpl
from areal_core.problems import format_problems

console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)

# A str, not a Path: what the file system makes of the name is the loader's to report (as a problem).
ConfigArg = Annotated[Optional[str], typer.Argument(help="YAML run config (a file path); omit for the built-in demo")]
OverridesArg = Annotated[Optional[list[str]], typer.Argument(help="dotted overrides, e.g. actor.optimizer.lr=1e-5")]


DEMO_CONFIG = Path(__file__).with_name("demo.yaml")


def _split(config: str | None, overrides: list[str] | None) -> tuple[str, list[str]]:
    """The config file (the built-in demo when none is given) and the overrides.

    Typer cannot tell `areal check a=1` from `areal check file.yaml`: a first argument with an '=' is an
    override unless it names an existing file (a name the file system refuses, too long for instance, names
    none). Without an '=' it is the config, and what is wrong with it is reported as a problem.
    """
    overrides = list(overrides or [])
    if config is not None and "=" in config:
        try:
            is_file = Path(config).is_file()
        except (OSError, ValueError):
            is_file = False
        if not is_file:
            return str(DEMO_CONFIG), [config, *overrides]
    return (config if config is not None else str(DEMO_CONFIG)), overrides


def _validated(config: str | None, overrides: list[str] | None, *, dry_run: bool = False):
    from areal_core.config.validate import output_problems, validate_run
    from areal_core.problems import ProblemsError

    path, overrides = _split(config, overrides)
    if dry_run:
        overrides.append(f"{DRY_RUN_KEY}=true")
    try:
        run = validate_run(path, overrides)
    except ProblemsError as exc:
        err.print(str(exc))
        raise typer.Exit(1) from None
    run.problems.extend(output_problems(run.config))
    if dry_run:
        _refuse_a_launcher_without_dry_run(run)
    if run.problems:
        source = "the built-in demo" if path == str(DEMO_CONFIG) else path
        err.print(format_problems(run.problems, source))
        raise typer.Exit(1)
    return run, path


ResumeOpt = Annotated[bool, typer.Option("--resume", help="continue the run in its folder from the last complete checkpoint")]
CheckResumeOpt = Annotated[bool, typer.Option("--resume", help="also check that the run's folder can be resumed with "
                                              "this config: the config matches and a checkpoint verifies against "
                                              "its manifest (every file re-read)")]


def check(config: ConfigArg = None, overrides: OverridesArg = None, resume: CheckResumeOpt = False) -> None:
    """Validate a run config and its placement; start nothing. Exit 0 when valid, 1 with every problem."""
    run, path = _validated(config, overrides)
    alloc = run.allocation
    console.print(f"{'the built-in demo' if path == str(DEMO_CONFIG) else path}: OK. allocation {alloc} "
                  f"({alloc.n_devices} accelerator(s), {sum(c.world_size for c in alloc.components)} process(es))")
    if resume:
        _check_resume(run)


def _check_resume(run) -> None:
    """What `areal run --resume` would continue from, verified as the trainer verifies it; exits 1 if nothing."""
    from areal_core.checkpoint import CheckpointDamagedError, CheckpointStore

    cfg = run.config
    run_dir = Path(cfg.output_dir).expanduser() / cfg.experiment / cfg.trial
    if not _decide(run_dir, run.resolved_dict(), True, quiet=True):
        err.print(f"--resume: {run_dir} holds no completed step, so `areal run --resume` would start the run afresh "
                  f"there.")
        raise typer.Exit(1)
    store = CheckpointStore(run_dir / "checkpoints")
    try:
        found, passed = store.resumable()
    except CheckpointDamagedError as exc:
        err.print(f"--resume: {exc}")
        raise typer.Exit(1) from None
    for note in passed:
        console.print(f"--resume: {note}; `areal run --resume` would pass over it")
    if found is None:
        console.print(f"--resume: {run_dir} holds steps but no complete checkpoint yet, so `areal run --resume` "
                      f"starts again from step 0 there")
        return
    console.print(f"--resume: {run_dir} resumes after step {store.load_meta(found)['step']} from {found} (every "
                  f"file verified against its manifest)")
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="show what the launcher would do (e.g. the batch scripts it "
                                         "would submit) and start nothing; the same as launcher.dry_run=true")]
DRY_RUN_KEY = "launcher.dry_run"


def _refuse_a_launcher_without_dry_run(run) -> None:
    """--dry-run is the override launcher.dry_run=true; a launcher without that option would otherwise get an
    unknown-key problem about a key the user never wrote, so say in words what is missing."""
    if "launcher" not in run.components:  # an unknown launcher: its own problem says so
        return
    if not any(p.key == DRY_RUN_KEY and p.code == "core.unknown-key" for p in run.problems):
        return
    name = run.config.launcher.name
    err.print(f"--dry-run: the '{name}' launcher has no dry run (it declares no {DRY_RUN_KEY} option), so it cannot "
              f"show what it would do without starting the run. Nothing was started or written. Fix: drop "
              f"--dry-run to start the run with the '{name}' launcher, choose a launcher that has a dry run "
              f"(launcher.name=...), or run `areal check` with the same arguments to validate the config and its "
              f"placement without starting anything.")
    raise typer.Exit(1)


def _is_dry_run(validated) -> bool:
    """launcher.dry_run is true (from --dry-run, an override or the YAML): the launcher only shows what it would do."""
    return getattr(validated.options.get("launcher"), "dry_run", False) is True


def run(config: ConfigArg = None, overrides: OverridesArg = None, resume: ResumeOpt = False,
        dry_run: DryRunOpt = False) -> None:
    """Train: with no CONFIG, the built-in demo (a small real model on a built-in task, CPU only).

    The run folder is <output_dir>/<experiment>/<trial>. One that holds a run
    (a completed step or a checkpoint) is continued with --resume, with the
    same config, and refused without it. One whose earlier start stopped
    before its first step holds nothing to keep: the run starts afresh there,
    with this config, with or without --resume (which then says that there
    is nothing to resume from).
    """
    from areal_core.api import Context
    from areal_core.problems import ProblemsError

    validated, _ = _validated(config, overrides, dry_run=dry_run)
    cfg = validated.config
    run_dir = Path(cfg.output_dir).expanduser() / cfg.experiment / cfg.trial
    resolved = validated.resolved_dict()
    resume = _decide(run_dir, resolved, resume)
    launcher_cls = validated.components["launcher"]
    try:  # a launcher that cannot run on this machine (its tools missing) says so before the run folder is made
        launcher = launcher_cls.create(Context(config=cfg, options=validated.options.get("launcher")))
    except ProblemsError as exc:
        err.print(str(exc))
        raise typer.Exit(1) from None
    if _is_dry_run(validated):
        # Nothing is created or claimed: a dry run leaves no run folder (nor a config.yaml in one) behind, so the
        # real run afterwards starts exactly as it would have without it. The launcher writes nothing there either.
        raise typer.Exit(launcher.launch(validated, run_dir, resume=resume))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        claim = _claim(run_dir)
    except OSError as exc:
        err.print(f"cannot create the run folder {run_dir}: {exc.strerror or exc}. Fix: set output_dir to a folder "
                  f"you can write.")
        raise typer.Exit(1) from None
    with claim:
        if _decide(run_dir, resolved, resume, quiet=True) != resume:  # another start got there in between
            err.print(f"run folder {run_dir} changed while this run was starting. Fix: run the command again.")
            raise typer.Exit(1)
        if not resume:
            for leftover in (METRICS_FILE, SAMPLES_FILE):  # rows of a start that stopped before its first step
                (run_dir / leftover).unlink(missing_ok=True)
        # On resume the config can differ only where the run lives (_WHERE_NOT_WHAT): the trainer reads this file.
        write_resolved_config(resolved, run_dir / CONFIG_FILE)
        code = launcher.launch(validated, run_dir, resume=resume)
    raise typer.Exit(code)


CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, LOCK_FILE = "config.yaml", "metrics.jsonl", "samples.jsonl", "run.lock"
# Keys (and key prefixes, ending in '.') that say where a run lives and reports, not what it trains: a run folder
# moved or copied elsewhere, a Ray head or SLURM job of a new cluster, other trackers. They may change at --resume.
_WHERE_NOT_WHAT = ("output_dir ", "experiment ", "trial ", "launcher.", "metrics.")


def _decide(run_dir: Path, resolved: dict, resume: bool, *, quiet: bool = False) -> bool:
    """Whether to launch with resume, from what the run folder holds; exits (1) where it must refuse."""
    saved = run_dir / CONFIG_FILE
    started = _holds_a_step(run_dir)
    if resume:
        if not saved.exists():
            err.print(f"--resume: {run_dir} holds no run to resume (no config.yaml). Fix: check output_dir, "
                      f"experiment and trial, or drop --resume to start the run.")
            raise typer.Exit(1)
        if not started:
            if not quiet:
                err.print(f"--resume: {run_dir} holds no completed step (its earlier start stopped before the first "
                          f"one), so there is nothing to resume from; starting the run afresh there.")
            return False
        moved = _differences(_load_yaml(saved), resolved)
        differences = [d for d in moved if not d.startswith(_WHERE_NOT_WHAT)]
        if differences:
            err.print(f"--resume: the config differs from the one {run_dir} was started with, at: "
                      f"{', '.join(differences)}. Fix: resume with the same config and overrides (only where the "
                      f"run lives and reports may change: output_dir, experiment, trial, launcher.*, metrics.*).")
            raise typer.Exit(1)
        if moved and not quiet:
            err.print(f"--resume: continuing with {', '.join(moved)}: where the run lives and reports, not what it "
                      f"trains; {run_dir / CONFIG_FILE} is updated to say so.")
        return True
    if started:
        err.print(f"run folder {run_dir} already holds a run. Fix: continue it with --resume, choose another "
                  f"name with trial=<name>, or delete the folder.")
        raise typer.Exit(1)
    return False


def _holds_a_step(run_dir: Path) -> bool:
    """A complete checkpoint, or a step (>= 1) in metrics.jsonl; an unreadable folder counts as holding one."""
    from areal_core.checkpoint import CheckpointStore

    try:
        if CheckpointStore(run_dir / "checkpoints").latest() is not None:
            return True
        lines = (run_dir / METRICS_FILE).read_bytes().splitlines()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: never start over what may be a run's results
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] >= 1:
            return True
    return False


class _claim:
    """An exclusive lock on <run_dir>/run.lock for as long as this command runs the folder's run.

    The lock goes with the process (flock), so a crashed or killed ``areal run`` never leaves it held.
    """

    def __init__(self, run_dir: Path) -> None:
        import fcntl

        self.file = open(run_dir / LOCK_FILE, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            err.print(f"run folder {run_dir} is in use by another areal run (it holds {LOCK_FILE}). Fix: wait for "
                      f"it to end, or choose another name with trial=<name>.")
            raise typer.Exit(1) from None

    def __enter__(self) -> "_claim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(_differences(va, vb, f"{prefix}{k}."))
        elif va != vb:
            out.append(f"{prefix}{k} ({va!r} -> {vb!r})")
    return out


def write_resolved_config(data: dict, target: Path) -> None:
    """Write atomically: a reader never sees half a config."""
    import yaml

    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, target)


PLUGINS_TABLE_MIN_WIDTH = 80  # narrower terminals get one block per distribution: no name cut mid-word


def plugins(as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False) -> None:
    """Every installed plugin: distribution, version, components, hooks and load errors (exit status 1 when
    any is broken: a hook module or a component's module that cannot be imported, a name claimed twice)."""
    from areal_core.listing import collect_listing

    listing = collect_listing()
    broken = [e["distribution"] for e in listing["distributions"] if e["errors"]]
    if as_json:
        typer.echo(json.dumps(listing, indent=2))
        if broken:
            raise typer.Exit(1)
        return
    if console.width < PLUGINS_TABLE_MIN_WIDTH:  # too narrow for four columns: one block per distribution
        for entry in listing["distributions"]:
            console.print(f"{entry['distribution']} {entry['version']}" + (" (built-in)" if entry["builtin"] else ""),
                          style="bold", soft_wrap=True)
            for label, items in (("components", [f"{k}: {', '.join(v)}" for k, v in entry["components"].items()]),
                                 ("backends", [f"{b['backend']} ({b['kind']}, dims {b['dims']}, "
                                               f"{'/'.join(b['devices'])})" for b in entry["backends"]]),
                                 ("hooks", entry["hooks"]), ("problems", entry["errors"] + entry["warnings"])):
                console.print(f"  {label}: {'; '.join(items) or '-'}", soft_wrap=True)
        _exit_if_broken(broken)
        return
    # Names are never cut mid-word (distributions, hooks): the free-text columns wrap instead. Hooks are shown
    # without their common "areal_" prefix.
    table = Table(title="areal plugins", show_lines=True)
    table.add_column("distribution", no_wrap=True)
    table.add_column("components", overflow="fold")
    table.add_column("hooks (areal_...)", no_wrap=True)
    table.add_column("problems", overflow="fold")
    for entry in listing["distributions"]:
        comps = "\n".join(f"{kind}: {', '.join(names)}" for kind, names in entry["components"].items())
        backs = "\n".join(f"backend {b['backend']} ({b['kind']}, dims {b['dims']}, {'/'.join(b['devices'])})"
                          for b in entry["backends"])
        table.add_row(f"{entry['distribution']}\n{entry['version']}" + (" (built-in)" if entry["builtin"] else ""),
                      "\n".join(x for x in (comps, backs) if x) or "-",
                      "\n".join(h.removeprefix("areal_") for h in entry["hooks"]) or "-",
                      "\n".join(entry["errors"] + entry["warnings"]) or "-")
    console.print(table)
    _exit_if_broken(broken)


def _exit_if_broken(broken: list[str]) -> None:
    if broken:
        err.print(f"broken: {', '.join(broken)} (see problems above)")
        raise typer.Exit(1)


RunsArg = Annotated[list[Path], typer.Argument(
    help="run folders (<output_dir>/<experiment>/<trial>), metrics.jsonl files, or TRL output folders / their "
         "trainer_state.json", show_default=False)]
OutOpt = Annotated[Optional[Path], typer.Option(
    "--out", help="file to write: .png, .svg, .pdf, or .html (an interactive page) [default: curves.png in the run's "
                  "folder for one run, compare.png here for several]")]
XOpt = Annotated[str, typer.Option("--x", help="x axis: step; samples or tokens (trained, cumulative); or time "
                                               "(training time since the first step; stops of a resumed run left "
                                               "out)")]
SmoothOpt = Annotated[float, typer.Option("--smooth", help="weight of the debiased moving average, as "
                                                           "TensorBoard's (0 = none); the raw line stays faint")]
MetricsOpt = Annotated[Optional[str], typer.Option(
    "--metrics", help="comma-separated metric keys, one panel each, e.g. reward/mean,eval/accuracy [default: reward, "
                      "accuracy, validation accuracy, tokens/s, staleness: those some run logs]")]
HtmlOpt = Annotated[bool, typer.Option("--html", help="write an interactive page (plotly, inline: opens from disk)")]
SeedsOpt = Annotated[bool, typer.Option("--seeds", help="runs whose configs differ only in trainer.seed: one curve, "
                                                        "their mean, in a band of one standard deviation")]


def plot(runs: RunsArg, out: OutOpt = None, x: XOpt = "step", smooth: SmoothOpt = 0.6,
         metrics: MetricsOpt = None, html: HtmlOpt = False, seeds: SeedsOpt = False) -> None:
    """Draw runs' reward, accuracy, throughput and staleness curves, overlaid, into a PNG or an HTML page."""
    from areal_cli.plot import PlotError, plot_runs

    keys = [k.strip() for k in metrics.split(",") if k.strip()] if metrics is not None else None
    try:
        written = plot_runs(runs, out, x=x, smooth=smooth, metrics=keys, html=html, seeds=seeds)
    except PlotError as exc:
        err.print(str(exc))
        raise typer.Exit(1) from None
    console.print(f"wrote {written}")


@hookimpl(trylast=True)
def areal_register_commands(registrar) -> None:
    registrar.add_command(run, "run")
    registrar.add_command(plot, "plot")
    registrar.add_command(check, "check")
    registrar.add_command(plugins, "plugins")
    from areal_cli.evaluate import eval_command  # here: that module imports this one

    registrar.add_command(eval_command, "eval")
    from areal_cli.samples import samples

    registrar.add_command(samples, "samples")
