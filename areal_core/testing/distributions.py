"""Install a plugin distribution for the length of a test, without pip.

:func:`install_fake_distribution` writes what pip would leave behind (a
``*.dist-info`` folder with ``METADATA`` and ``entry_points.txt``, plus the
module files) into a folder, puts that folder first on ``sys.path`` and makes
``importlib.metadata`` see it. Entry points are then discovered exactly as for
a real install, so a test exercises the packaging too. Everything is undone on
exit: the distribution's metadata, the path, the modules imported from it,
importlib's caches, the entry points cached by :mod:`areal_core.discovery`
and the plugin manager cached by :mod:`areal_core.plugins`.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["install_fake_distribution", "interpreter_with"]


def _dist_info_name(name: str, version: str) -> str:
    # The wheel spec's escaping: runs of -_. become one underscore.
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"


def _entry_points_txt(entry_points: dict[str, dict[str, str]]) -> str:
    blocks = []
    for group, entries in entry_points.items():
        lines = [f"[{group}]", *(f"{name} = {value}" for name, value in entries.items())]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _forget_caches() -> None:
    importlib.invalidate_caches()  # also clears importlib.metadata's path cache
    import areal_core.discovery
    import areal_core.plugins

    areal_core.discovery.invalidate_cache()
    areal_core.plugins._cached = None


@contextmanager
def install_fake_distribution(
    tmp_path: Path | str,
    name: str,
    version: str,
    entry_points: dict[str, dict[str, str]],
    files: dict[str, str],
    requires: tuple[str, ...] | list[str] = (),
) -> Iterator[Path]:
    """Make distribution ``name`` ``version`` look installed inside the ``with`` block.

    ``tmp_path``: the folder to write into (created if missing); it becomes a
    ``sys.path`` entry, like a ``site-packages``, and is what the block gets
    (``as site``), so a subprocess can see the distribution through
    ``PYTHONPATH=site``. ``entry_points``: group -> {entry-point name ->
    ``"module:attr"``}, e.g. ``{"areal.rewards": {"mine": "my_reward:MyReward"}}``.
    ``files``: path relative to ``tmp_path`` -> source text
    (``{"my_reward.py": "..."}``, ``{"my_pkg/__init__.py": ""}``). ``requires``:
    its declared dependencies (``Requires-Dist`` lines, e.g. ``"wandb>=0.17"``).

    Several distributions may share one folder. On exit the distribution is
    uninstalled (its ``*.dist-info`` removed; module files stay for
    inspection), the folder leaves ``sys.path`` (if this call added it), every
    module imported from it is dropped from ``sys.modules`` and the plugin
    manager is rebuilt on next use.
    """
    site = Path(tmp_path).resolve()
    site.mkdir(parents=True, exist_ok=True)
    for relpath, source in files.items():
        target = site / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    info = site / _dist_info_name(name, version)
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "entry_points.txt").write_text(_entry_points_txt(entry_points))
    (info / "INSTALLER").write_text("areal_core.testing\n")
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in files))

    entry = str(site)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    _forget_caches()
    try:
        yield site
    finally:
        if added:
            while entry in sys.path:
                sys.path.remove(entry)
        prefix = entry + os.sep
        for mod_name, module in list(sys.modules.items()):
            origin = getattr(module, "__file__", None)
            if isinstance(origin, str) and origin.startswith(prefix):
                del sys.modules[mod_name]
        sys.path_importer_cache.pop(entry, None)
        shutil.rmtree(info, ignore_errors=True)  # uninstalled, even if the folder is on sys.path again
        _forget_caches()


def interpreter_with(folder: Path | str, module: str, version: str, distribution: str | None = None) -> Path:
    """A STAND-IN interpreter (a shell script running this Python) on whose path distribution ``distribution``
    (default ``module``) ``version`` provides the empty top-level package ``module``: for checks that ask a
    server's interpreter what it has (``areal_core.remote.server_python_problem``) without installing the real
    package. Returns the script's path."""
    folder = Path(folder)
    site = folder / "site"
    (site / module).mkdir(parents=True, exist_ok=True)
    (site / module / "__init__.py").write_text(f"# a stand-in of {module} {version} for tests\n")
    info = site / _dist_info_name(distribution or module, version)
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution or module}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{module}\n")
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return script
