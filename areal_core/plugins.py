"""The plugin manager: finds hook plugins through entry points and loads them.

Hook plugins are modules named in the ``areal`` entry-point group. Built-in
features are plugins of the ``areal-core`` distribution, loaded the same way.
A plugin that fails to import, implements a hook with the wrong signature or
misspells a hook name is not registered; the failure is recorded on its
:class:`PluginInfo` and shown as a warning naming the distribution, version,
what was expected and the fix. Only the selected component of a run is ever
fatal (see :mod:`areal_core.registry`).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

import pluggy

from areal_core import hookspecs
from areal_core.discovery import claimed_twice, BLOCK_ENV, Found, closest, entry_points, import_failure, load_each
from areal_core.hookspecs import PROJECT

GROUP = "areal"


@dataclass
class PluginInfo:
    """What ``areal plugins`` shows for one hook plugin."""

    name: str
    distribution: str
    version: str
    module: str
    builtin: bool
    hooks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def loaded(self) -> bool:
        return not self.errors


def _spec_names() -> dict[str, list[str]]:
    """Hook name -> argument names, read from the spec module."""
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(hookspecs).items()
        if name.startswith(f"{PROJECT}_") and callable(fn)
    }


def _hook_functions(module: object) -> Iterator[tuple[str, Any, bool]]:
    """(attribute name, object, is marked as hookimpl) for candidate hook functions."""
    for attr in dir(module):
        obj = getattr(module, attr, None)
        marked = hasattr(obj, f"{PROJECT}_impl")
        if marked or (attr.startswith(f"{PROJECT}_") and callable(obj)):
            yield attr, obj, marked


def check_hook_module(name: str, owner: str, module: object) -> tuple[list[str], list[str]]:
    """Errors and warnings for one plugin's hook implementations, in our wording.

    pluggy would accept a misspelt hook silently (it never runs) and words a
    signature mismatch in its own terms; we check first so the message names
    the plugin, its distribution and the fix.
    """
    specs = _spec_names()
    errors: list[str] = []
    warnings: list[str] = []
    for attr, obj, marked in _hook_functions(module):
        if not marked:
            if attr in specs:
                warnings.append(
                    f'plugin "{name}" ({owner}): function {attr} is not marked with '
                    f"@areal_core.hookimpl, so it is never called. Fix: decorate it."
                )
            continue
        if attr not in specs:
            guess = closest(attr, list(specs))
            hint = f"rename it to {guess}" if guess else f"use one of: {', '.join(sorted(specs))}"
            errors.append(
                f'plugin "{name}" ({owner}): {attr} is not an areal hook. Fix: {hint}.'
            )
            continue
        try:
            params = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            params = []
        extra = [p for p in params if p not in specs[attr]]
        if extra:
            errors.append(
                f'plugin "{name}" ({owner}): {attr} takes argument(s) '
                f"{', '.join(extra)} that the hook does not provide; it provides "
                f"({', '.join(specs[attr])}). Fix: accept only those names (any subset)."
            )
    return errors, warnings


class PluginManager:
    """pluggy's manager plus what we know about each plugin."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}

    @property
    def hook(self) -> Any:
        return self.pm.hook

    # -- loading --------------------------------------------------------
    def load_entry_points(self) -> None:
        found = entry_points(GROUP)
        by_name: dict[str, list[Found]] = {}
        for f in found:
            by_name.setdefault(f.name, []).append(f)
        single = []
        for name, claims in by_name.items():
            if len(claims) > 1:
                owners = " and ".join(c.owner for c in claims)
                for c in claims:
                    info = self._info(c)
                    message, fix = claimed_twice(f'plugin name "{name}"', owners)
                    info.errors.append(f"{message}. Fix: {fix}.")
                    self.plugins[f"{name} ({c.owner})"] = info
                continue
            single.append(claims[0])
        for f, module in load_each(single, self._import_failed):
            info = self.plugins[f.name] = self._info(f)
            self.register_module(module, info)

    def _info(self, f: Found) -> PluginInfo:
        return PluginInfo(f.name, f.distribution, f.version, f.value, f.builtin)

    def _import_failed(self, f: Found, exc: Exception) -> None:
        info = self.plugins[f.name] = self._info(f)
        cause, fix = import_failure(f, exc) or (
            f"{type(exc).__name__}: {exc}",
            f"reinstall or upgrade {f.distribution}, or skip it with {BLOCK_ENV}={f.distribution}")
        info.errors.append(f'Error importing plugin "{f.name}" ({f.owner}) from {f.value}: {cause}. Fix: {fix}.')

    def register_found(self, f: Found) -> PluginInfo:
        """Import one hook plugin and register it (its failure recorded on the returned info)."""
        for _, module in load_each([f], self._import_failed):
            self.register_module(module, self.plugins.setdefault(f.name, self._info(f)))
        return self.plugins[f.name]

    def register_module(self, module: object, info: PluginInfo) -> None:
        errors, warnings = check_hook_module(info.name, f"{info.distribution} {info.version}", module)
        info.warnings.extend(warnings)
        if errors:
            info.errors.extend(errors)
            return
        try:
            self.pm.register(module, name=info.name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            info.errors.append(f'plugin "{info.name}" ({info.distribution} {info.version}): {exc}')
            return
        info.hooks = sorted(
            h.name for h in self.pm.get_hookcallers(module) or [] if h.name.startswith(PROJECT)
        )
        self.plugins[info.name] = info

    # -- calling --------------------------------------------------------
    def call_each(self, hook_name: str, problems: list | None = None, **kwargs: Any) -> list[tuple[PluginInfo, Any]]:
        """Call every implementation of a hook, keeping who returned what.

        pluggy's normal call returns bare results; declaration and validation
        hooks need the owner to name it in conflicts. An implementation that
        raises does not stop the others: its failure is appended to
        ``problems`` as a :class:`~areal_core.problems.Problem` naming the
        plugin (or, without ``problems``, recorded on the plugin's info).
        """
        from areal_core.problems import Problem

        caller = getattr(self.pm.hook, hook_name)
        out = []
        for impl in reversed(caller.get_hookimpls()):  # registration order
            info = self.plugins[impl.plugin_name]
            try:
                result = impl.function(**{k: kwargs[k] for k in impl.argnames if k in kwargs})
            except Exception as exc:
                message = (f'plugin "{info.name}" ({info.distribution} {info.version}) crashed in '
                           f"{hook_name}: {type(exc).__name__}: {exc}")
                fix = (f"report this to the maintainers of {info.distribution}, or skip the plugin "
                       f"with {BLOCK_ENV}={info.distribution}")
                if problems is not None:
                    problems.append(Problem("core.plugin-crash", message, fix))
                else:
                    info.errors.append(f"{message}. Fix: {fix}.")
                continue
            out.append((info, result))
        return out

    def warnings(self) -> list[str]:
        """Every load error and warning, one line each, for the CLI to print."""
        lines: list[str] = []
        for info in self.plugins.values():
            lines.extend(info.errors)
            lines.extend(info.warnings)
        return lines


_cached: PluginManager | None = None


def get_plugin_manager(*, refresh: bool = False) -> PluginManager:
    """The process-wide manager, built on first use (``refresh`` rebuilds it)."""
    global _cached
    if _cached is None or refresh:
        manager = PluginManager()
        manager.load_entry_points()
        _cached = manager
    return _cached


def manager_from_modules(*modules: types.ModuleType | object, names: list[str] | None = None) -> PluginManager:
    """A manager holding only the given hook modules (for plugin authors' tests)."""
    manager = PluginManager()
    for i, module in enumerate(modules):
        name = names[i] if names else getattr(module, "__name__", f"plugin{i}")
        manager.register_module(module, PluginInfo(name, "<test>", "0", name, builtin=False))
    return manager
