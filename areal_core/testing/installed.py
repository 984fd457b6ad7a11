"""Tests that need another plugin at run time: skipped, saying which, when it is not installed.

A plugin's tests import nothing from another plugin, so they run with only the
core and that plugin installed. A test that really drives another plugin (an
``areal run`` with the embedded inference engine as the rollout backend, say)
asks for it by entry point, as ``areal run`` finds it::

    from areal_core.testing import requires_plugin

    pytestmark = requires_plugin("areal.engines.inference", "local")

and gets its classes through the registry, never by importing its package::

    from areal_core.registry import resolve

    LocalEngine = resolve("inference_engine", "local")

Whether a plugin is there is read from installed metadata only (nothing is
imported), with ``AREAL_LOAD_PLUGINS`` / ``AREAL_DISABLE_PLUGINS`` applied as
for a run.
"""

from __future__ import annotations

import pytest

from areal_core.discovery import ALLOW_ENV, BLOCK_ENV, entry_points
from areal_core.registry import KINDS


def _group(group_or_kind: str) -> str:
    return KINDS[group_or_kind][0] if group_or_kind in KINDS else group_or_kind


def plugin_installed(group: str, name: str) -> bool:
    """Whether an enabled installed distribution has entry point ``name`` in ``group``.

    ``group`` is an entry-point group (``areal.engines.inference``, ``areal`` for hook
    plugins) or a component kind (``inference_engine``)."""
    return any(found.name == name for found in entry_points(_group(group)))


def requires_plugin(group: str, name: str) -> pytest.MarkDecorator:
    """A ``skipif`` marker: skip unless :func:`plugin_installed` (``group``, ``name``).

    Use it on a test, a class, a ``pytest.param`` (``marks=``) or a whole module
    (``pytestmark``); the reason names the entry point and how to get it."""
    entry_group = _group(group)
    return pytest.mark.skipif(
        not plugin_installed(entry_group, name),
        reason=f"needs the plugin providing '{name}' in entry-point group {entry_group}: "
               f"not installed (or left out by {ALLOW_ENV} / {BLOCK_ENV}); install it to run this test",
    )
