"""What engine backends declare about placement, and the core's own plan rules.

Each engine plugin declares its backends through ``areal_declare_backends``;
the rules every plan must obey whatever the backend (known backend, supported
dimensions and devices, colocated components of equal size, one trainer and
at least one inference engine) are checked here, and plugins add their own
through ``areal_validate_parallelism``. :func:`declare_backend` and
:func:`validate_components` build those two hooks, so that a plugin's hook
module states only its backend and its rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_core.config.allocation import DIMENSION_NAMES, DIMENSIONS, Allocation, Component
from areal_core.catalogue import install_fix
from areal_core.discovery import did_you_mean
from areal_core.hookspecs import hookimpl
from areal_core.problems import Problem

if TYPE_CHECKING:  # pragma: no cover - typing only
    from areal_core.config.model_info import ModelInfo

KINDS = ("train", "inference")


@dataclass(frozen=True)
class BackendSupport:
    """One backend's declaration.

    ``dims`` lists the parallel dimensions it accepts above 1 (``"dtc"``);
    ``devices`` where it can run; ``description`` one line for ``areal plugins``.
    """

    backend: str
    kind: str
    dims: str = "d"
    devices: tuple[str, ...] = ("gpu",)
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"BackendSupport.kind must be one of {KINDS}, got {self.kind!r}")
        bad = set(self.dims) - set(DIMENSIONS)
        if bad:
            raise ValueError(f"BackendSupport.dims has unknown dimension(s) {sorted(bad)}")


def declare_backend(
    backend: str,
    kind: str,
    *,
    dims: str = "d",
    devices: tuple[str, ...] = ("gpu",),
    description: str = "",
) -> Callable[[], list[BackendSupport]]:
    """An ``areal_declare_backends`` hook that declares one backend.

    Assign it to that name in a plugin's hook module:
    ``areal_declare_backends = declare_backend("mine", "train", dims="dt")``.
    """
    support = BackendSupport(backend, kind, dims=dims, devices=devices, description=description)

    @hookimpl
    def areal_declare_backends() -> list[BackendSupport]:
        return [support]

    return areal_declare_backends


# What a backend's plan rules say about one of its components: problems, and None for each rule that holds.
ComponentRules = Callable[[Any, Component, "ModelInfo | None"], Iterable["Problem | None"]]


def validate_components(backend: str, rules: ComponentRules) -> Callable[..., list[Problem]]:
    """An ``areal_validate_parallelism`` hook that applies ``rules(config, component, model)``
    to every component of ``backend`` in the allocation, in order, and reports the problems found.

    Assign it to that name in a plugin's hook module:
    ``areal_validate_parallelism = validate_components("mine", my_rules)``.
    """

    @hookimpl
    def areal_validate_parallelism(config: Any, allocation: Allocation, model: ModelInfo | None) -> list[Problem]:
        return [
            problem
            for comp in allocation.find(backend=backend)
            for problem in rules(config, comp, model)
            if problem is not None
        ]

    return areal_validate_parallelism


def default_role(kind: str) -> str:
    """The config section a component serves when the allocation does not name it."""
    return "actor" if kind == "train" else "rollout"


def role_of(component: Component, kind: str) -> str:
    """The role a component of ``kind`` serves: its name in the allocation, else the default."""
    return component.name or default_role(kind)


def core_plan_problems(allocation: Allocation, backends: dict[str, BackendSupport]) -> list[Problem]:
    """Rules every allocation obeys, whichever plugins are installed."""
    problems: list[Problem] = []
    known = sorted(backends)
    for comp in allocation.components:
        support = backends.get(comp.backend)
        if support is None:
            listing = ", ".join(known) if known else "none (install an engine plugin)"
            problems.append(
                Problem(
                    "core.unknown-backend",
                    f"backend '{comp.backend}' in '{comp}' is not declared by any installed plugin."
                    f"{did_you_mean(comp.backend, known)} Declared backends: {listing}.",
                    install_fix("backend", comp.backend) or
                    f"correct the allocation, or install a plugin that declares backend '{comp.backend}' "
                    f"(areal plugins lists the backends installed here)",
                    key="allocation",
                )
            )
            continue
        problems.extend(_dimension_problems(comp, support))
    for group in allocation.groups:
        if len(group) > 1 and len({c.world_size for c in group}) > 1:
            sizes = ", ".join(f"{c} uses {c.world_size}" for c in group)
            problems.append(
                Problem(
                    "core.colocated-size",
                    f"colocated components must have the same number of processes: {sizes}.",
                    "give every component joined by '|' the same product of dimensions, "
                    "or separate them with '+'",
                    key="allocation",
                )
            )
    problems.extend(_role_problems(allocation, backends))
    return problems


def _dimension_problems(comp: Component, support: BackendSupport) -> list[Problem]:
    out = []
    for dim in DIMENSIONS:
        size = getattr(comp.parallel, dim)
        if size > 1 and dim not in support.dims:
            allowed = ", ".join(f"{d} ({DIMENSION_NAMES[d]})" for d in support.dims)
            out.append(
                Problem(
                    "core.unsupported-dimension",
                    f"'{comp}': {comp.backend} does not support {DIMENSION_NAMES[dim]} "
                    f"parallelism ({dim}{size}); it supports {allowed}.",
                    f"remove {dim}{size} or choose a backend that supports it",
                    key="allocation",
                )
            )
    if comp.device not in support.devices:
        out.append(
            Problem(
                "core.unsupported-device",
                f"'{comp}': {comp.backend} cannot run on {comp.device}; it runs on "
                f"{', '.join(support.devices)}.",
                "place it on " + " or ".join(support.devices)
                + (" (append @cpu)" if "cpu" in support.devices else ""),
                key="allocation",
            )
        )
    return out


def _duplicate_role_fix(comps: list[Component], kind: str) -> str:
    """The fix for several components serving one role, written with the user's own components."""
    if kind == "inference":
        first = comps[0]
        return (f"one inference component serves the rollouts; give it more servers instead, e.g. "
                f"'{first.backend}:d{sum(c.parallel.d for c in comps)}"
                f"{'@' + first.device if first.device != 'gpu' else ''}', or name each for a role of its own")
    names = ("actor", "ref", "critic")
    return "give each one its own role, e.g. " + "+".join(
        f"{c.backend}[{names[i] if i < len(names) else f'role{i}'}]:{str(c).split(':', 1)[1]}"
        for i, c in enumerate(comps))


def _role_problems(allocation: Allocation, backends: dict[str, BackendSupport]) -> list[Problem]:
    roles: dict[str, list[Component]] = {}
    kinds: dict[str, int] = {"train": 0, "inference": 0}
    kinds_of: dict[str, str] = {}
    for comp in allocation.components:
        support = backends.get(comp.backend)
        if support is None:
            continue
        kinds[support.kind] += 1
        roles.setdefault(role_of(comp, support.kind), []).append(comp)
        kinds_of[role_of(comp, support.kind)] = support.kind
    out = []
    for role, comps in roles.items():
        if len(comps) > 1:
            out.append(
                Problem(
                    "core.duplicate-role",
                    f"{len(comps)} components serve '{role}': "
                    + ", ".join(f"'{c}'" for c in comps) + ".",
                    _duplicate_role_fix(comps, kinds_of[role]),
                    key="allocation",
                )
            )
    for kind, label, example in (
        ("train", "a train engine", "fsdp:d1@cpu"),
        ("inference", "an inference engine", "local:cpu"),
    ):
        # an unknown backend may be the missing engine (its own problem says so): judged only when all are known
        if kinds[kind] == 0 and all(c.backend in backends for c in allocation.components):
            out.append(
                Problem(
                    f"core.no-{kind}-engine",
                    f"allocation '{allocation}' places no {kind} engine; an RL run needs {label}.",
                    f"add one joined with '+', e.g. '{allocation}+{example}'",
                    key="allocation",
                )
            )
    return out
