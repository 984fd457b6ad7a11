"""Named components a user selects in config, resolved lazily by kind.

Each kind is an entry-point group; the entry-point name is the name a user
writes (``reward.name: math``). Listing reads metadata only; :func:`resolve`
imports only the one component asked for, so a machine without Megatron can
still list and use everything else.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from areal_core.catalogue import install_fix, reinstall_line
from areal_core.discovery import Found, claimed_twice, did_you_mean, entry_points, import_failure

# kind -> (entry-point group, what a user calls one, config key that selects it)
KINDS: dict[str, tuple[str, str, str]] = {
    "train_engine": ("areal.engines.train", "train engine", "actor.backend"),
    "inference_engine": ("areal.engines.inference", "inference engine", "rollout.backend"),
    "algorithm": ("areal.algorithms", "algorithm", "algorithm.name"),
    "workflow": ("areal.workflows", "workflow", "workflow.name"),
    "reward": ("areal.rewards", "reward", "reward.name"),
    "launcher": ("areal.launchers", "launcher", "launcher.name"),
    "dataset": ("areal.datasets", "dataset", "dataset.name"),
    "logger": ("areal.loggers", "metrics logger", "metrics.loggers"),
}


def contract_for(kind: str) -> type | None:
    """The class a component of ``kind`` must subclass (None for rewards and metrics loggers: any callable)."""
    from areal_core import api  # lazily: listing components needs no contract

    _check_kind(kind)
    return {
        "train_engine": api.TrainEngine,
        "inference_engine": api.InferenceEngine,
        "algorithm": api.Algorithm,
        "workflow": api.Workflow,
        "launcher": api.Launcher,
        "dataset": api.Dataset,
        "reward": None,
        "logger": None,  # a callable (run_dir, *, resume_step, config) -> areal_core.metrics.MetricsSink
    }[kind]


class ComponentError(Exception):
    """The selected component cannot be used: ``message`` says why, ``fix`` what to do (kept apart so that
    ``areal check`` reports them as a problem's fields; ``str()`` joins them for a traceback)."""

    def __init__(self, message: str, fix: str) -> None:
        self.message, self.fix = message, fix
        super().__init__(f"{message}. Fix: {fix}.")


@dataclass(frozen=True)
class ComponentEntry:
    kind: str
    name: str
    value: str
    distribution: str
    version: str

    @property
    def owner(self) -> str:
        return f"{self.distribution} {self.version}"


def _check_kind(kind: str) -> tuple[str, str, str]:
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")
    return KINDS[kind]


def _entries(kind: str) -> list[ComponentEntry]:
    group, _, _ = _check_kind(kind)
    return [_entry(kind, f) for f in entry_points(group)]


def _entry(kind: str, f: Found) -> ComponentEntry:
    return ComponentEntry(kind, f.name, f.value, f.distribution, f.version)


def list_components(kind: str | None = None) -> list[ComponentEntry]:
    """Every installed component of ``kind`` (or of every kind). Imports nothing."""
    kinds = [kind] if kind else list(KINDS)
    return [e for k in kinds for e in _entries(k)]


def names(kind: str) -> list[str]:
    return sorted({e.name for e in _entries(kind)})


def find(kind: str, name: str) -> ComponentEntry:
    """The entry for ``name``, or a :class:`ComponentError` saying what exists."""
    _, label, key = _check_kind(kind)
    entries = _entries(kind)
    matches = [e for e in entries if e.name == name]
    if not matches:
        available = sorted({e.name for e in entries})
        if available:
            listing = ", ".join(
                f"{e.name} ({e.owner})" for e in sorted(entries, key=lambda e: e.name)
            )
            what = f"Available: {listing}."
        else:
            what = f"No {label} plugin is installed."
        raise ComponentError(
            f"no {label} named '{name}' is installed.{did_you_mean(name, available)} {what}".rstrip("."),
            f"correct {key}, or {install_fix(kind, name) or f'install a plugin that provides {label} {name!r} (areal plugins lists what is installed)'}")
    if len(matches) > 1:
        raise ComponentError(*claimed_twice(f"{label} '{name}'",
                                            " and ".join(f"{m.owner} ({m.value})" for m in matches)))
    return matches[0]


def resolve(kind: str, name: str, expected: type | None = None) -> object:
    """Import and return the selected component.

    ``expected``, when given, is the contract class the component must
    subclass (or, for a plain callable contract, ``None`` skips the check).
    """
    _, label, _ = _check_kind(kind)
    entry = find(kind, name)
    found = Found(KINDS[kind][0], entry.name, entry.value, entry.distribution, entry.version)
    try:
        obj = found.load()
    except Exception as exc:
        cause, fix = import_failure(found, exc) or (
            f"{type(exc).__name__}: {exc}",
            f"reinstall it with `{reinstall_line(entry.distribution)}`")
        raise ComponentError(f"{label} '{name}' from {entry.owner} failed to import ({entry.value}): {cause}",
                             f"{fix}, or select another {label}") from exc
    if expected is not None and not (isinstance(obj, type) and issubclass(obj, expected)):
        raise ComponentError(
            f"{label} '{name}' from {entry.owner} points at {entry.value}, which is "
            f"{obj!r}, not a subclass of {expected.__module__}.{expected.__qualname__}",
            "the plugin's entry point must name a class implementing that contract")
    if expected is not None and inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise ComponentError(
            f"{label} '{name}' from {entry.owner} ({entry.value}) leaves {missing} of "
            f"{expected.__qualname__} unimplemented, so it cannot be built",
            "the plugin must implement every abstract method of the contract")
    return obj
