"""Every plugin stands alone: its code and its tests import nothing from another first-party plugin, so
each plugin's tests run with only the core and that plugin installed, and the core imports no plugin.

Read from the source with ``ast`` (nothing is imported): every ``import`` / ``from ... import``, and the
module names handed to ``pytest.importorskip``, ``importlib.import_module``, ``importlib.util.find_spec``
and ``__import__``, anywhere in a file (inside functions too). A plugin is a folder under ``plugins/`` with
a ``pyproject.toml``; its import packages are the wheel's ``packages`` (hatch), else the package folders
beside the ``pyproject.toml``. What a test needs from another plugin at run time it asks for by entry point
(``areal_core.testing.requires_plugin``, ``areal_core.registry.resolve``).
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
# Calls whose first argument is a module name that gets imported (or looked for, to import it).
IMPORTING_CALLS = {"importorskip", "import_module", "find_spec", "__import__"}
SKIPPED_FOLDERS = {"__pycache__", "build", "dist", ".venv", "node_modules"}


@dataclass(frozen=True)
class Plugin:
    distribution: str
    folder: Path
    packages: frozenset[str]


@dataclass(frozen=True)
class CrossImport:
    file: Path
    line: int
    module: str
    owner: str  # the distribution the module belongs to

    def __str__(self) -> str:
        return f"{self.file.relative_to(ROOT) if self.file.is_relative_to(ROOT) else self.file}:{self.line}: " \
               f"imports {self.module} of {self.owner}"


def find_plugins(plugins_root: Path) -> list[Plugin]:
    """Every distribution under ``plugins_root`` (a ``pyproject.toml`` with a ``[project]`` name)."""
    found = []
    for pyproject in sorted(plugins_root.rglob("pyproject.toml")):
        if SKIPPED_FOLDERS & set(pyproject.relative_to(plugins_root).parts):
            continue
        data = tomllib.loads(pyproject.read_text())
        name = data.get("project", {}).get("name")
        if not name:
            continue
        wheel = data.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {})
        packages = {Path(p).name for p in wheel.get("packages", [])}
        if not packages:  # no hatch list: the package folders beside pyproject.toml
            packages = {p.name for p in pyproject.parent.iterdir()
                        if (p / "__init__.py").is_file() and p.name not in {"tests", "test"}}
        found.append(Plugin(name, pyproject.parent, frozenset(packages)))
    return found


def imported_modules(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, absolute module name) for each import in ``source``; relative imports are left out."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            first = node.args[0]
            if name in IMPORTING_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append((node.lineno, first.value))
    return sorted(out)


def python_files(folder: Path) -> list[Path]:
    """The ``*.py`` files under ``folder``, build folders and virtual environments left out."""
    files = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).parts
        if SKIPPED_FOLDERS & set(parts) or any(p.endswith(".egg-info") for p in parts):
            continue
        files.append(path)
    return files


def cross_imports(files: list[Path], own: frozenset[str], owners: dict[str, str]) -> list[CrossImport]:
    """Imports in ``files`` of a package in ``owners`` (package -> distribution) that is not in ``own``."""
    found = []
    for path in files:
        for line, module in imported_modules(path.read_text(), str(path)):
            top = module.split(".")[0]
            if top in owners and top not in own:
                found.append(CrossImport(path, line, module, owners[top]))
    return found


def plugin_cross_imports(plugins_root: Path) -> dict[str, list[CrossImport]]:
    """Distribution -> the imports of another plugin's packages in its files (code, tests, conftest)."""
    plugins = find_plugins(plugins_root)
    owners = {package: p.distribution for p in plugins for package in p.packages}
    folders = {p.folder for p in plugins}
    result = {}
    for plugin in plugins:
        # A plugin folder holding another plugin's folder (none today) leaves that one to its own check.
        files = [f for f in python_files(plugin.folder)
                 if not any(other != plugin.folder and other.is_relative_to(plugin.folder) and f.is_relative_to(other)
                            for other in folders)]
        result[plugin.distribution] = cross_imports(files, plugin.packages, owners)
    return result


def escapes(source: str, depth: int, filename: str = "<source>") -> list[int]:
    """Lines of ``source`` (a file ``depth`` folders below its plugin's folder) that climb out of the plugin
    with ``Path(__file__).parents[k]`` (k >= depth) or ``.parent`` chains as long: a test that reads the
    repository's own files (its test doubles, say) cannot run from the plugin's distribution. A line that
    looks outside on purpose, for something optional, says so with ``# isolation: ok (why)``."""
    allowed = {i for i, text in enumerate(source.splitlines(), 1) if "# isolation: ok" in text}
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parents" and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, int) and node.slice.value >= depth:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "parent":
            chain, inner = 1, node.value
            while isinstance(inner, ast.Attribute) and inner.attr == "parent":
                chain, inner = chain + 1, inner.value
            if chain > depth and not (isinstance(inner, ast.Attribute) and inner.attr == "parent"):
                lines.append(node.lineno)
    return sorted(set(lines) - allowed)


# ---------------------------------------------------------------------- the tree as it is

PLUGINS = find_plugins(ROOT / "plugins")


@functools.lru_cache(maxsize=None)
def tree_cross_imports() -> dict[str, list[CrossImport]]:
    return plugin_cross_imports(ROOT / "plugins")


def test_every_plugin_is_found_with_its_packages():
    by_name = {p.distribution: p for p in PLUGINS}
    assert len(PLUGINS) >= 10, sorted(by_name)
    assert by_name["areal-plugin-local"].packages == {"areal_local"}
    assert by_name["areal-plugin-fsdp"].packages == {"areal_fsdp"}
    assert all(p.packages for p in PLUGINS), [p.distribution for p in PLUGINS if not p.packages]
    owners = [package for p in PLUGINS for package in p.packages]
    assert len(owners) == len(set(owners)), "two plugins ship the same package"


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.distribution for p in PLUGINS])
def test_a_plugin_imports_no_other_plugin(plugin):
    found = tree_cross_imports()[plugin.distribution]
    assert not found, (
        f"{plugin.distribution} must run with only areal-core and itself installed, but:\n"
        + "\n".join(f"  {c}" for c in found)
        + "\nFix: shared test helpers belong in areal_core.testing (tiny_model, ...); a test that drives another "
          "plugin skips without it (areal_core.testing.requires_plugin) and gets its classes by entry point "
          "(areal_core.registry.resolve)."
    )


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.distribution for p in PLUGINS])
def test_entry_points_name_only_the_plugins_own_packages(plugin):
    data = tomllib.loads((plugin.folder / "pyproject.toml").read_text())
    groups = data.get("project", {}).get("entry-points", {})
    wrong = [f"[{group}] {name} = {value}" for group, entries in groups.items() for name, value in entries.items()
             if value.split(":")[0].split(".")[0] not in plugin.packages]
    assert not wrong, f"{plugin.distribution} declares entry points outside its packages: {wrong}"


def test_the_core_imports_no_plugin():
    owners = {package: p.distribution for p in PLUGINS for package in p.packages}
    files = python_files(ROOT / "areal_core") + python_files(ROOT / "cli")
    found = cross_imports(files, frozenset(), owners)
    assert not found, "the core must not import a plugin:\n" + "\n".join(f"  {c}" for c in found)


def test_the_core_never_imports_the_cli():
    """The CLI renders what the core gathers (the plugin listing, problems); a core module that imports it
    would make every plugin's tests and every trainer process depend on the command line."""
    found = cross_imports(python_files(ROOT / "areal_core"), frozenset(), {"areal_cli": "areal (the CLI)"})
    assert not found, "the core must not import the CLI:\n" + "\n".join(f"  {c}" for c in found)


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.distribution for p in PLUGINS])
def test_a_plugin_reads_no_file_outside_its_folder(plugin):
    found = [f"{path.relative_to(ROOT)}:{line}" for path in python_files(plugin.folder)
             for line in escapes(path.read_text(), len(path.relative_to(plugin.folder).parts), str(path))]
    assert not found, (f"{plugin.distribution} reaches outside its folder (its distribution would not hold "
                       f"what it reads): {found}. Fix: helpers several plugins' tests share go into "
                       f"areal_core.testing")


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.distribution for p in PLUGINS])
def test_a_plugin_follows_the_template(plugin):
    """As plugins/_template: a `test` extra, `pytest` finding `tests/` from the plugin's folder, and the `slow`
    marker declared where its tests use it (pytest refuses unknown markers under --strict-markers)."""
    data = tomllib.loads((plugin.folder / "pyproject.toml").read_text())
    assert "test" in data["project"].get("optional-dependencies", {}), f"{plugin.distribution}: no `test` extra"
    ini = data.get("tool", {}).get("pytest", {}).get("ini_options", {})
    assert ini.get("testpaths") == ["tests"] and (plugin.folder / "tests").is_dir(), plugin.distribution
    uses_slow = any("mark.slow" in f.read_text() for f in python_files(plugin.folder / "tests"))
    assert not uses_slow or any(m.startswith("slow:") for m in ini.get("markers", [])), (
        f"{plugin.distribution}: its tests use the slow marker; declare it in [tool.pytest.ini_options] markers")


def test_the_escape_check_finds_climbs_out_of_a_plugin():
    source = "\n".join([
        "from pathlib import Path",
        "HERE = Path(__file__).parents[0]",            # the tests folder: inside
        "ROOT = Path(__file__).parents[1]",            # the plugin folder: inside
        "DOUBLES = Path(__file__).parents[4] / 'x'",  # out
        "UP = Path(__file__).parent.parent.parent",    # out (three levels from a file two deep)
        "OK = Path(__file__).parent.parent",           # the plugin folder
        "VENV = Path(__file__).parents[4]  # isolation: ok (an optional checkout-level venv)",
    ])
    assert escapes(source, depth=2) == [4, 5]


# ---------------------------------------------------------------------- the check itself

def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_check_finds_every_kind_of_import_of_another_plugin(tmp_path):
    root = tmp_path / "plugins"
    write(root / "kind" / "a" / "pyproject.toml",
          '[project]\nname = "areal-plugin-a"\n[tool.hatch.build.targets.wheel]\npackages = ["areal_a"]\n')
    write(root / "kind" / "a" / "areal_a" / "__init__.py", "from . import util\nimport areal_a.util\n")
    write(root / "kind" / "b" / "pyproject.toml", '[project]\nname = "areal-plugin-b"\n')  # no hatch list
    write(root / "kind" / "b" / "areal_b" / "__init__.py", "")
    write(root / "kind" / "b" / "tests" / "__init__.py", "")  # not a package of b
    write(root / "kind" / "b" / "tests" / "test_b.py", "\n".join([
        "import os",
        "import areal_a",
        "from areal_a.models import tiny",
        "import pytest",
        "pytest.importorskip('areal_a')",
        "def f():",
        "    import importlib",
        "    importlib.import_module('areal_a.engine')",
        "    from areal_b import x",  # its own package
        "    import areal_core.testing",
        "    import areal_abc",  # not a plugin's package: only whole names count
    ]) + "\n")
    write(root / "kind" / "b" / "conftest.py", "def fixture():\n    from areal_a import helper\n")
    assert {p.distribution: set(p.packages) for p in find_plugins(root)} == {
        "areal-plugin-a": {"areal_a"}, "areal-plugin-b": {"areal_b"}}

    found = plugin_cross_imports(root)
    assert found["areal-plugin-a"] == []
    assert [(c.file.name, c.line, c.module, c.owner) for c in found["areal-plugin-b"]] == [
        ("conftest.py", 2, "areal_a", "areal-plugin-a"),
        ("test_b.py", 2, "areal_a", "areal-plugin-a"),
        ("test_b.py", 3, "areal_a.models", "areal-plugin-a"),
        ("test_b.py", 5, "areal_a", "areal-plugin-a"),
        ("test_b.py", 8, "areal_a.engine", "areal-plugin-a"),
    ]


def test_no_module_outside_the_local_launcher_imports_it():
    """Process machinery (supervisor, node contract, server fleet, following a run) is areal_core.processes; the
    controller, evaluation, the engines, the tests and the other launchers use that, so a third-party launcher
    can replace `local` without the rest depending on it. Only areal_core/launch/ itself imports
    areal_core.launch (its two shims there keep the old names for plugins written against them)."""
    files = [f for root in (ROOT / "areal_core", ROOT / "cli", ROOT / "plugins", ROOT / "tests", ROOT / "benchmarks")
             for f in python_files(root) if not f.is_relative_to(ROOT / "areal_core" / "launch")]
    found = [f"{path.relative_to(ROOT)}:{line}: {module}" for path in files
             for line, module in imported_modules(path.read_text(), str(path))
             if module == "areal_core.launch" or module.startswith("areal_core.launch.")]
    assert not found, "import areal_core.processes instead of the local launcher:\n" + "\n".join(found)
