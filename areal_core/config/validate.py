"""Everything checked before a run starts, reported all at once.

Order: config types and ranges; the allocation's syntax; the selected
components (resolved through their entry points: only those are imported)
and their own keys; then every plugin's ``areal_validate_config`` and
``areal_validate_parallelism``. A hook that crashes becomes a problem naming
its plugin rather than a traceback.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from areal_core.config.allocation import Allocation, AllocationParseError, parse_allocation
from areal_core.config.load import build, load_config
from areal_core.config.model_info import ModelInfo, read_model_info
from areal_core.discovery import claimed_twice, closest
from areal_core.config.schema import COMPONENT_SECTIONS, RunConfig
from areal_core.parallelism import BackendSupport, role_of
from areal_core.plugins import PluginManager, get_plugin_manager
from areal_core.problems import Problem
from areal_core.registry import KINDS, ComponentError, contract_for, names, resolve


@dataclass
class ValidatedRun:
    """A config with everything it selects, and every problem found on the way."""

    config: RunConfig
    allocation: Allocation | None = None
    model: ModelInfo | None = None
    backends: dict[str, BackendSupport] = field(default_factory=dict)
    backend_owners: dict[str, str] = field(default_factory=dict)
    components: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def placement(self, role: str) -> Any:
        """The allocation component serving ``role`` (``actor``, ``rollout``, ``ref``): named so,
        or unnamed and of the role's default kind."""
        return next(c for c in self.allocation.components
                    if role_of(c, self.backends[c.backend].kind) == role)

    def resolved_dict(self) -> dict:
        """The config as written to the run folder, component options filled in."""
        data = asdict(self.config)
        data["allocation"] = str(self.allocation) if self.allocation else self.config.allocation_text()
        for section, options in self.options.items():
            data[section]["extra"] = asdict(options) if options is not None else {}
        return data


def declared_backends(manager: PluginManager) -> tuple[dict[str, BackendSupport], dict[str, str], list[Problem]]:
    """Every declared backend, who declared it, and any clash between declarations."""
    backends: dict[str, BackendSupport] = {}
    owners: dict[str, str] = {}
    problems: list[Problem] = []
    for info, result in manager.call_each("areal_declare_backends", problems):
        for support in result or []:
            if not isinstance(support, BackendSupport):
                problems.append(Problem("core.plugin", f'plugin "{info.name}" ({info.distribution} '
                                        f"{info.version}) declared {support!r}, not a BackendSupport",
                                        f"report this to the maintainers of {info.distribution}"))
                continue
            if support.backend in backends:
                problems.append(Problem("core.duplicate-backend", *claimed_twice(
                    f"backend '{support.backend}'", f"{owners[support.backend]} and {info.distribution} "
                                                    f"{info.version}"), key="allocation"))
                continue
            backends[support.backend] = support
            owners[support.backend] = f"{info.distribution} {info.version}"
    return backends, owners, problems


def resolve_components(run: ValidatedRun) -> None:
    """Import each selected component and check the keys it declares."""
    for section, (kind, key) in COMPONENT_SECTIONS.items():
        section_cfg = getattr(run.config, section)
        name = getattr(section_cfg, key)
        label = KINDS[kind][1]
        extra = dict(section_cfg.extra)
        core_keys = [f.name for f in fields(type(section_cfg)) if f.name != "extra"]
        try:
            cls = resolve(kind, name, expected=contract_for(kind))
        except ComponentError as exc:
            message, fix = exc.message, exc.fix
            owner = run.backend_owners.get(name) if kind.endswith("_engine") else None
            if owner and name not in names(kind):
                message += (f" ({owner} declares the backend '{name}' for placement checks but "
                            f"provides no {label} named '{name}' in this version.)")
            run.problems.append(Problem("core.component", message, fix, key=f"{section}.{key}"))
            for extra_key in extra:
                run.problems.append(_unknown_extra(section, extra_key, core_keys, f"{label} '{name}' is not available"))
            continue
        if contract_for(kind) is None and not callable(cls):
            run.problems.append(Problem("core.component", f"{label} '{name}' is {cls!r}, not callable",
                                        "its entry point must name a function or class", f"{section}.{key}"))
            continue
        run.components[section] = cls
        config_class = getattr(cls, "config_class", None)
        declared = [f.name for f in fields(config_class)] if config_class is not None else []
        for extra_key in [k for k in extra if k not in declared]:
            run.problems.append(_unknown_extra(section, extra_key, core_keys + declared,
                                               f"neither the core nor {label} '{name}' declares it"))
            del extra[extra_key]
        run.options[section] = build(config_class, extra, f"{section}.", run.problems) if config_class else None


def _unknown_extra(section: str, key: Any, known: list[str], why: str) -> Problem:
    key = str(key)  # a YAML key may be a number (`actor: {0: ...}`)
    guess = closest(key, known)
    hint = f"did you mean {section}.{guess}?" if guess else "remove it, or check the component's documentation for its keys"
    return Problem("core.unknown-key", f"unknown key: {why}", hint, key=f"{section}.{key}")


def minibatch_problem(actor: Any, capabilities: frozenset[str]) -> Problem | None:
    """``actor.ppo_minibatches`` / ``ppo_epochs`` above 1 with a train engine that does not declare
    ``minibatches`` (``areal check`` and the trainer both ask)."""
    if (actor.ppo_minibatches == 1 and actor.ppo_epochs == 1) or "minibatches" in capabilities:
        return None
    return Problem("core.capability",
                   f"actor.ppo_minibatches={actor.ppo_minibatches} x actor.ppo_epochs={actor.ppo_epochs} asks for "
                   f"several optimizer steps per batch, but actor.backend '{actor.backend}' does not declare "
                   f"'minibatches'",
                   "set actor.ppo_minibatches=1 actor.ppo_epochs=1, or use a train engine that declares it "
                   "(fsdp, megatron)",
                   key="actor.ppo_minibatches" if actor.ppo_minibatches > 1 else "actor.ppo_epochs")


def _capability_problems(run: ValidatedRun) -> list[Problem]:
    """Keys that need a capability the selected train engine does not declare."""
    engine = run.components.get("actor")
    problem = None if engine is None else minibatch_problem(run.config.actor,
                                                            getattr(engine, "capabilities", frozenset()))
    return [] if problem is None else [problem]


def _path_error(exc: Exception) -> str:
    """What the file system (or pathlib) said about a path, in words."""
    if isinstance(exc, RuntimeError):  # Path.expanduser
        return "its '~user' names no home folder on this machine"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


MODEL_FIX = ("set model.path to a local Hugging Face model folder (config.json, *.safetensors weights, tokenizer), "
             "a hub model as ORG/NAME[@REVISION], or '' for the built-in demo model")


def model_path_problems(path: str, dtype: str, manager: PluginManager, problems: list[Problem]) -> list[Problem]:
    """What makes ``model.path`` unloadable, found without loading it.

    ``""`` (the built-in demo model) is left to the plugin that provides it. A folder must hold a readable
    ``config.json`` and ``*.safetensors`` weights (what every train engine reads). Anything else must be a
    name some plugin's ``areal_resolve_model`` knows; it is asked with ``materialize=False``, so nothing is
    written. A plugin that crashes when asked is reported in ``problems``.
    """
    if not path:
        return []
    shown = path if len(path) <= 120 else f"{path[:100]}... ({len(path)} characters)"
    try:
        folder = Path(path).expanduser()
        is_dir, exists = folder.is_dir(), folder.exists()
    except (OSError, ValueError, RuntimeError) as exc:  # too long a name, a NUL byte, an unknown ~user
        return [Problem("core.model", f"{shown!r} cannot be a model folder: {_path_error(exc)}", MODEL_FIX,
                        "model.path")]
    if not is_dir:
        known = [answer for _, answer in manager.call_each("areal_resolve_model", problems, path=path, dtype=dtype,
                                                           materialize=False) if answer is not None]
        if known:
            return []
        from areal_core.hub import HubModelError, model_config_folder, parse_hub_id

        if parse_hub_id(path) is not None:  # a hub id: its config.json alone is fetched (or read from the cache)
            try:
                model_config_folder(path)
            except HubModelError as exc:
                return [Problem("core.model-hub", str(exc).removeprefix("model.path "), key="model.path")]
            return []
        what = "is a file, not a folder" if exists else "does not exist"
        return [Problem("core.model", f"{shown!r} {what}, and no installed plugin knows it as a model name",
                        MODEL_FIX, "model.path")]
    try:
        names = {child.name for child in folder.iterdir()}
    except OSError as exc:
        return [Problem("core.model", f"folder {shown!r} cannot be read: {exc.strerror or exc}", MODEL_FIX,
                        "model.path")]
    missing = []
    if "config.json" not in names:
        missing.append("no config.json")
    else:
        try:
            parsed = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            missing.append(f"a config.json that cannot be read as JSON ({exc})")
        else:
            if not isinstance(parsed, dict):
                missing.append("a config.json that is not a JSON object")
    if not any(name.endswith(".safetensors") for name in names):
        bins = any(name.endswith(".bin") for name in names)
        missing.append("only PyTorch *.bin weights; the engines read *.safetensors (convert with transformers: "
                       "from_pretrained then save_pretrained)" if bins else "no *.safetensors weights")
    if not missing:
        return []
    what = "is an empty folder" if not names else f"holds {' and '.join(missing)}"
    return [Problem("core.model", f"{shown!r} {what}: it is not a Hugging Face model folder", MODEL_FIX,
                    "model.path")]


def output_problems(config: RunConfig) -> list[Problem]:
    """Whether ``<output_dir>/<experiment>/<trial>`` can be created and written, tried for real.

    The nearest folder of that path that exists already gets a temporary folder made and removed in it
    (so a read-only mount or a missing permission shows, for root too where the file system refuses);
    nothing is left behind.
    """
    import errno
    import os
    import tempfile

    key = "output_dir"
    raw = config.output_dir
    shown = raw if len(raw) <= 120 else f"{raw[:100]}... ({len(raw)} characters)"
    try:
        run_dir = Path(raw).expanduser() / config.experiment / config.trial
        probe = run_dir
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
        if not probe.is_dir():
            return [Problem("core.output-dir", f"{probe} is a file, so the run folder {run_dir} cannot be made "
                            f"there", "set output_dir to a folder (it is created if missing)", key)]
        os.rmdir(tempfile.mkdtemp(prefix=".areal-check-", dir=probe))
    except (OSError, ValueError, RuntimeError) as exc:
        reason = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.ENOSPC: "the disk is full"}.get(
            getattr(exc, "errno", None), _path_error(exc))
        return [Problem("core.output-dir", f"{shown!r}: the run folder <output_dir>/{config.experiment}/"
                        f"{config.trial} cannot be written: {reason}",
                        "set output_dir to a folder you can write (it is created if missing)", key)]
    return []


def validate_run(path: str | None = None, overrides: list[str] | None = None, *,
                 manager: PluginManager | None = None, with_components: bool = True) -> ValidatedRun:
    """Load, resolve and validate a run; ``run.problems`` holds everything wrong."""
    config, problems = load_config(path, overrides)
    run = ValidatedRun(config=config, problems=problems)
    manager = manager or get_plugin_manager()
    run.backends, run.backend_owners, backend_problems = declared_backends(manager)
    run.problems.extend(backend_problems)
    try:
        run.allocation = parse_allocation(config.allocation_text())
    except AllocationParseError as exc:
        where = "" if config.allocation else "the default allocation (from actor/rollout backends): "
        run.problems.append(Problem("core.allocation-syntax", f"{where}{exc.reason} at character "
                                    f"{exc.position + 1}\n      {exc.text}\n      {' ' * exc.position}^",
                                    "see docs/engines.md for the allocation grammar", key="allocation"))
    run.problems.extend(model_path_problems(config.model.path, config.model.dtype, manager, run.problems))
    run.model = read_model_info(config.model.path)
    if with_components:
        resolve_components(run)
        run.problems.extend(_capability_problems(run))
    for _, result in manager.call_each("areal_validate_config", run.problems, config=config):
        run.problems.extend(result or [])
    if run.allocation is not None:
        for _, result in manager.call_each("areal_validate_parallelism", run.problems, config=config,
                                    allocation=run.allocation, model=run.model, backends=run.backends):
            run.problems.extend(result or [])
    return run
