"""Entry-point discovery shared by hook plugins and named components.

Listing entry points reads installed metadata only; nothing is imported until
an entry point is loaded. This is the stevedore pattern done with
``importlib.metadata`` alone, because we also need each entry point's
distribution and version for error messages, and the allow / block lists
below, which stevedore does not offer.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from importlib import metadata

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

    def load(self) -> object:
        return metadata.EntryPoint(self.name, self.value, self.group).load()


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {normalize(x) for x in raw.split(",") if x.strip()}


def _hook_plugin_names() -> dict[str, set[str]]:
    """Distribution -> its plugin names in the ``areal`` group, so a plugin name
    enables or blocks the distribution's components too."""
    names: dict[str, set[str]] = {}
    for ep in metadata.entry_points(group="areal"):
        if ep.dist is not None:
            names.setdefault(normalize(ep.dist.metadata["Name"]), set()).add(normalize(ep.name))
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
    """Every entry point in ``group``, deduplicated, in a stable order."""
    seen: dict[tuple[str, str, str], Found] = {}
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        found = Found(
            group=group,
            name=ep.name,
            value=ep.value,
            distribution=dist.metadata["Name"] if dist is not None else "<unknown>",
            version=dist.version if dist is not None else "?",
        )
        # The same distribution can be visible twice on sys.path (an editable
        # install plus a stale egg-info); count it once.
        seen.setdefault((normalize(found.distribution), found.name, found.value), found)
    result = sorted(seen.values(), key=lambda f: (f.name, normalize(f.distribution)))
    if include_disabled:
        return result
    aliases = _hook_plugin_names()
    return [f for f in result if is_enabled(f, aliases)]


def closest(name: str, candidates: list[str]) -> str | None:
    """The candidate a typo most likely meant, or None (YAML keys may be numbers: compared as text)."""
    matches = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: list[str]) -> str:
    guess = closest(name, candidates)
    return f" Did you mean '{guess}'?" if guess else ""
