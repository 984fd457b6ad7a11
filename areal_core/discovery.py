"""Entry-point discovery shared by hook plugins and named components.

Listing entry points reads installed metadata only; nothing is imported until
an entry point is loaded.

Loading goes through stevedore: :func:`load_each` (the hook plugins) is a
``NamedExtensionManager`` and :meth:`Found.load` (the one selected component)
a ``DriverManager``, both with ``on_load_failure_callback``; callers word the
failure.

Kept by hand, because stevedore cannot do it:

- *Who installed each entry point.* Every message names the distribution and
  its version, the allow and block lists below match distribution names, and
  "claimed twice" names both owners. stevedore's entry-point cache keeps only
  (name, value, group) and drops the distribution, so the listing here comes
  from one scan of ``importlib.metadata.distributions()`` that keeps it.
- *The cache.* That scan (all ``areal*`` groups at once) is done once per
  ``sys.path`` (about 2 ms on a quiet machine, a hundred on a loaded one; a
  run's validation used to repeat it for every lookup) and kept until
  ``sys.path`` changes or :func:`invalidate_cache` is called, as
  ``areal_core.testing.install_fake_distribution`` does. stevedore's own
  caches cannot be told: ``ExtensionManager.ENTRY_POINT_CACHE`` keeps a
  group's list for the life of the process, and its on-disk cache lives in
  the user's home. So the managers here are handed their entry points
  (:class:`_Given` overrides ``list_entry_points``) and never scan.
- *The allow and block lists* (``AREAL_LOAD_PLUGINS``, ``AREAL_DISABLE_PLUGINS``),
  applied on every call (tests change them), to the cached listing.
- *Typo suggestions* (:func:`did_you_mean`).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

from areal_core.catalogue import reinstall_line

CORE_DISTRIBUTION = "areal-core"
ALLOW_ENV = "AREAL_LOAD_PLUGINS"
BLOCK_ENV = "AREAL_DISABLE_PLUGINS"


def claimed_twice(what: str, owners: str) -> tuple[str, str]:
    """(message, fix) for a name two installed distributions both provide: ``what`` names it ("trainer engine
    'fsdp'", 'plugin name "x"'), ``owners`` lists them."""
    return (f"{what} is provided by two distributions: {owners}",
            f"uninstall one of them, or block one with {BLOCK_ENV}=<distribution>")


def normalize(name: str) -> str:
    """PEP 503 normalisation, so ``Areal_Plugin.FSDP`` names ``areal-plugin-fsdp``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Found:
    """One entry point and who installed it."""

    group: str
    name: str
    value: str
    distribution: str
    version: str

    @property
    def builtin(self) -> bool:
        return normalize(self.distribution) == CORE_DISTRIBUTION

    @property
    def owner(self) -> str:
        return f"{self.distribution} {self.version}"

    @property
    def module(self) -> str:
        return self.value.partition(":")[0].strip()

    def entry_point(self) -> metadata.EntryPoint:
        return metadata.EntryPoint(self.name, self.value, self.group)

    def load(self) -> object:
        """Import and return the object the entry point names (its import error propagates)."""
        from stevedore import DriverManager

        return _given(DriverManager, [self], self.name, on_missing_entrypoints_callback=None).driver


def _given(manager_class: type, found: list[Found], *args, **kwargs):
    """A stevedore manager of ``manager_class`` over exactly the entry points ``found`` (it scans nothing)."""

    class _Given(manager_class):  # type: ignore[misc, valid-type]
        def list_entry_points(self) -> list[metadata.EntryPoint]:
            return [f.entry_point() for f in found]

    group = found[0].group if found else "areal"
    return _Given(group, *args, **kwargs)


def load_each(found: list[Found], on_failure: Callable[[Found, Exception], None]) -> list[tuple[Found, object]]:
    """Import every entry point of ``found`` (their names distinct), in order: (found, object) for each that
    imports; ``on_failure(found, exception)`` for each that does not."""
    from stevedore import NamedExtensionManager

    if not found:
        return []
    by_name = {f.name: f for f in found}
    manager = _given(NamedExtensionManager, found, names=list(by_name), name_order=True,
                     on_load_failure_callback=lambda _manager, ep, exc: on_failure(by_name[ep.name], exc),
                     on_missing_entrypoints_callback=None)
    return [(by_name[ext.name], ext.plugin) for ext in manager.extensions]


# -- the listing, cached ----------------------------------------------------------------------------------
_cache: tuple[tuple[str, ...], dict[str, list[Found]]] | None = None


def invalidate_cache() -> None:
    """Forget the installed entry points, so the next call scans again. Call it after installing or removing a
    distribution inside a running process without changing ``sys.path`` (a change of ``sys.path`` is noticed)."""
    global _cache
    _cache = None


def _scan() -> dict[str, list[Found]]:
    """Every entry point in the ``areal`` group and the ``areal.*`` groups: group -> [Found], each group sorted
    by name, then distribution."""
    global _cache
    key = tuple(sys.path)
    if _cache is not None and _cache[0] == key:
        return _cache[1]
    groups: dict[str, dict[tuple[str, str, str], Found]] = {}
    seen_dists: set[str] = set()
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or "<unknown>"
        # The same distribution can be visible twice on sys.path (an editable install plus a stale
        # egg-info): the first one found wins, as for imports and importlib.metadata.entry_points().
        if normalize(name) in seen_dists:
            continue
        seen_dists.add(normalize(name))
        for ep in dist.entry_points:
            if ep.group == "areal" or ep.group.startswith("areal."):
                found = Found(ep.group, ep.name, ep.value, name, dist.version)
                groups.setdefault(ep.group, {}).setdefault((normalize(name), ep.name, ep.value), found)
    result = {group: sorted(entries.values(), key=lambda f: (f.name, normalize(f.distribution)))
              for group, entries in groups.items()}
    _cache = (key, result)
    return result


def distributions() -> dict[tuple[str, str], list[str]]:
    """Every installed distribution that provides areal entry points (disabled ones too): (name, version) ->
    the entry-point names it provides, sorted; the core's own included."""
    found: dict[tuple[str, str], set[str]] = {}
    for entries in _scan().values():
        for f in entries:
            found.setdefault((f.distribution, f.version), set()).add(f.name)
    return {key: sorted(names) for key, names in sorted(found.items())}


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {normalize(x) for x in raw.split(",") if x.strip()}


def _hook_plugin_names() -> dict[str, set[str]]:
    """Distribution -> its plugin names in the ``areal`` group, so a plugin name
    enables or blocks the distribution's components too."""
    names: dict[str, set[str]] = {}
    for f in _scan().get("areal", []):
        names.setdefault(normalize(f.distribution), set()).add(normalize(f.name))
    return names


def is_enabled(found: Found, aliases: dict[str, set[str]] | None = None) -> bool:
    """Apply ``AREAL_LOAD_PLUGINS`` (allow list) and ``AREAL_DISABLE_PLUGINS`` (block list).

    Each is a comma-separated list of distribution names (``areal-plugin-fsdp``)
    or plugin names (the entry-point name in the ``areal`` group, ``fsdp``); a
    name covers everything its distribution provides, hooks and components.
    The core's own built-ins are always loaded. An empty allow list loads no
    plugin but the built-ins.
    """
    if found.builtin:
        return True
    names = {normalize(found.distribution)}
    if found.group == "areal":
        names.add(normalize(found.name))
    names |= (aliases if aliases is not None else _hook_plugin_names()).get(normalize(found.distribution), set())
    allow = _env_names(ALLOW_ENV)
    if allow is not None and not names & allow:
        return False
    block = _env_names(BLOCK_ENV)
    return not (block and names & block)


def entry_points(group: str, *, include_disabled: bool = False) -> list[Found]:
    """Every entry point in ``group``, deduplicated, in a stable order (cached: see the module docstring)."""
    result = list(_scan().get(group, []))
    if include_disabled or (os.environ.get(ALLOW_ENV) is None and os.environ.get(BLOCK_ENV) is None):
        return result
    aliases = _hook_plugin_names()
    return [f for f in result if is_enabled(f, aliases)]


# -- an entry point whose module is missing, told without importing anything ------------------------------
def _module_findable(module: str) -> bool:
    """Whether ``module`` can be found by the import system, importing nothing (not even its parents)."""
    path = None
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else None
        if loaded is None:
            for finder in sys.meta_path:
                find_spec = getattr(finder, "find_spec", None)
                try:
                    spec = find_spec(name, path) if find_spec else None
                except Exception:  # a finder that cannot answer without importing: assume it would
                    return True
                if spec is not None:
                    break
        if loaded is not None and spec is None:
            return True  # a module made at run time: it is there
        if spec is None:
            return False
        path = spec.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return False  # a plain module cannot hold the next part
    return True


def _ships(distribution: str, module: str) -> bool:
    """Whether the installed files of ``distribution`` (its RECORD) include ``module``."""
    try:
        files = metadata.distribution(distribution).files
    except metadata.PackageNotFoundError:
        return False
    if files is None:
        return False
    stem = module.replace(".", "/")
    return any(str(p).replace(os.sep, "/") in (f"{stem}.py", f"{stem}/__init__.py")
               or str(p).replace(os.sep, "/").startswith(f"{stem}.") for p in files)


def missing_module(found: Found) -> tuple[str, str] | None:
    """(problem, fix) when the module ``found`` names cannot be found, importing nothing; None when it can (it
    may still fail to import: only importing tells)."""
    module = found.module
    if not module or _module_findable(module):
        return None
    if _ships(found.distribution, module):
        return (f"its module {module} is listed in {found.owner}'s installed files but is missing",
                f"reinstall it with `{reinstall_line(found.distribution)}`")
    return (f"{found.owner} does not ship module {module}",
            f"its entry point is wrong, so reinstalling will not help: the maintainers of {found.distribution} "
            f"must name a module the distribution contains (uninstall it, or block it with "
            f"{BLOCK_ENV}={found.distribution})")


def import_failure(found: Found, exc: BaseException) -> tuple[str, str] | None:
    """(cause, fix) for an entry point whose import raised an ImportError the installed metadata explains: a
    module the distribution does not have, or a declared requirement that is not installed (named with its
    range, so the fix installs it rather than reinstalling the plugin). None when nothing explains it."""
    if not isinstance(exc, ImportError):
        return None
    missing = missing_module(found)
    if missing:
        return missing
    unmet = unmet_requirements(found.distribution)
    if unmet:
        listing = ", ".join(f"{requirement} ({instead})" for requirement, instead in unmet)
        return (f"{type(exc).__name__}: {exc}; {found.owner} requires {listing}",
                "pip install " + " ".join(f"'{requirement}'" for requirement, _ in unmet))
    return None


def unmet_requirements(distribution: str) -> list[tuple[str, str]]:
    """(requirement, what is installed instead) for each of ``distribution``'s declared dependencies (extras left
    out, markers evaluated here) that is not installed or not at an allowed version; read from installed
    metadata, importing nothing. A component's module can be findable and still fail to import for this."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        declared = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    unmet = []
    for text in declared:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            unmet.append((str(requirement), "not installed"))
            continue
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            unmet.append((str(requirement), f"{installed} is installed"))
    return unmet


def closest(name: str, candidates: list[str]) -> str | None:
    """The candidate a typo most likely meant, or None (YAML keys may be numbers: compared as text)."""
    matches = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: list[str]) -> str:
    guess = closest(name, candidates)
    return f" Did you mean '{guess}'?" if guess else ""
