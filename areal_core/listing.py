"""What is installed, by distribution: hook plugins, components, declared backends, errors and warnings.

Gathered without importing any component (entry points and hook calls only): a component whose module
cannot be found is listed as an error all the same (:func:`areal_core.discovery.missing_module`), and so is a
distribution whose declared requirements are not installed (:func:`areal_core.discovery.unmet_requirements`).
``areal plugins`` renders it; the conformance kit reads it. Data here, the
presentation in the CLI (as datasette keeps ``get_plugins()`` in its core).
"""

from __future__ import annotations

from dataclasses import asdict

from areal_core.discovery import claimed_twice, entry_points, missing_module, normalize, unmet_requirements
from areal_core.plugins import get_plugin_manager
from areal_core.registry import KINDS


def collect_listing() -> dict:
    """``{"distributions": [{"distribution", "version", "builtin", "plugins", "hooks", "components",
    "backends", "errors", "warnings"}, ...]}``, the core first, then by name."""
    manager = get_plugin_manager()
    by_dist: dict[str, dict] = {}

    def entry(distribution: str, version: str, builtin: bool) -> dict:
        return by_dist.setdefault(normalize(distribution), {
            "distribution": distribution, "version": version, "builtin": builtin,
            "plugins": [], "hooks": [], "components": {}, "backends": [], "errors": [], "warnings": [],
        })

    for info in manager.plugins.values():
        e = entry(info.distribution, info.version, info.builtin)
        e["plugins"].append(info.name)
        e["hooks"] = sorted(set(e["hooks"]) | set(info.hooks))
        e["errors"].extend(info.errors)
        e["warnings"].extend(info.warnings)
    unmet: dict[str, list] = {}  # distribution -> its unmet requirements, checked once
    for kind, (group, label, _) in KINDS.items():
        claims: dict[str, list] = {}
        for found in entry_points(group):
            e = entry(found.distribution, found.version, found.builtin)
            e["components"].setdefault(kind, []).append(found.name)
            missing = missing_module(found)
            if missing:  # told without importing it (a healthy component is never imported here)
                e["errors"].append(f"{label} '{found.name}' ({found.name} = {found.value}) cannot be imported: "
                                   f"{missing[0]}. Fix: {missing[1]}.")
            elif found.distribution not in unmet:  # its module is there; what it imports may not be
                unmet[found.distribution] = unmet_requirements(found.distribution)
                for requirement, instead in unmet[found.distribution]:
                    e["errors"].append(f"{found.owner} requires {requirement} ({instead}), so its components may "
                                       f"fail to import. Fix: pip install '{requirement}'.")
            claims.setdefault(found.name, []).append(found)
        for name, founds in claims.items():
            if len(founds) > 1:
                message, fix = claimed_twice(f"{label} '{name}'", " and ".join(f.owner for f in founds))
                for f in founds:
                    entry(f.distribution, f.version, f.builtin)["errors"].append(f"{message}. Fix: {fix}.")
    for info, result in manager.call_each("areal_declare_backends"):
        for support in result or []:
            try:
                entry(info.distribution, info.version, info.builtin)["backends"].append(asdict(support))
            except TypeError:
                pass  # not a BackendSupport: `areal check` reports it
    return {"distributions": sorted(by_dist.values(), key=lambda e: (not e["builtin"], e["distribution"]))}
