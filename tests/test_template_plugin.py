"""The plugin template works when its README's steps are followed literally.

The shell block under "Make it yours" in ``plugins/_template/README.md`` runs as written in a temporary
folder (the template's path put in for ``/path/to/areal/plugins/_template``), inside a throwaway virtual
environment that sees this checkout's packages, so ``pip install -e '.[test]'`` installs the copy there
(offline: its build backend and dependencies are already installed) and nothing in ``.venv`` changes. The
copy is then used the way a user would: listed by ``areal plugins``, run as ``areal mine score``, resolved by
name, and tested by its own tests (``-m slow``: about 30 s). The copy and rename alone (steps 1 and 2, no
install) run in the default suite.
"""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing.waits import scaled

TEMPLATE = Path(__file__).resolve().parents[1] / "plugins" / "_template"
README = TEMPLATE / "README.md"


def readme_steps() -> str:
    """The shell block of the README's "Make it yours" section."""
    notes = re.split(r"^<!-- end of template notes -->$", README.read_text().split("## Make it yours", 1)[1],
                     maxsplit=1, flags=re.M)[0]
    blocks = re.findall(r"```sh\n(.*?)```", notes, flags=re.S)
    assert len(blocks) == 1, "the README's template notes should hold one ```sh block of steps"
    return blocks[0]


def throwaway_venv(folder: Path) -> dict[str, str]:
    """A venv that sees this interpreter's packages (through a .pth), with ``pip``, ``pytest`` and ``areal`` on
    its PATH as an installed environment has them; returns the environment to run the steps in."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    bin_dir = folder / "bin"
    (purelib,) = (folder / "lib").glob("python3*/site-packages")
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_parent_env.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in parents) + "\n")
    for command, module in (("pip", "pip"), ("pytest", "pytest"), ("areal", "areal_cli.app")):
        shim = bin_dir / command
        shim.write_text(f'#!/bin/sh\nexec "{bin_dir / "python"}" -m {module} "$@"\n')
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in {"AREAL_LOAD_PLUGINS", "AREAL_DISABLE_PLUGINS", "PYTHONPATH", "VIRTUAL_ENV"}}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(folder),
               # offline: hatchling and areal-core are already installed where the venv looks
               PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def run_steps(root: Path, env: dict[str, str] | None = None, *, until: str | None = None) -> subprocess.CompletedProcess:
    """The README's steps, in ``root``, as ``bash -e`` runs them (those before the line ``until`` only)."""
    script = readme_steps().replace("/path/to/areal/plugins/_template", str(TEMPLATE))
    if until is not None:
        assert until in script, f"the README's steps have no line {until!r}"
        script = script.split(until, 1)[0]
    return subprocess.run(["bash", "-e", "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=scaled(600))


@pytest.fixture(scope="module")
def followed(tmp_path_factory) -> tuple[Path, dict[str, str], subprocess.CompletedProcess]:
    """(the copy, its environment, the run of every step)."""
    root = tmp_path_factory.mktemp("template")
    env = throwaway_venv(root / "venv")
    return root / "areal-plugin-mine", env, run_steps(root, env)


@pytest.mark.slow
def test_the_readme_steps_run_and_the_copys_tests_pass(followed):
    copy, _, done = followed
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1.0\n" in done.stdout  # areal mine score
    summary = re.findall(r"^=+ (.*) in [\d.]+s =+$", done.stdout, flags=re.M)
    assert summary and re.fullmatch(r"\d+ passed", summary[-1]), done.stdout + done.stderr
    assert (copy / "areal_mine").is_dir() and not (copy / "conftest.py").exists()


def test_copying_and_renaming_leave_nothing_named_example_and_the_readme_describes_the_copy(tmp_path):
    done = run_steps(tmp_path, until="# 3.")
    assert done.returncode == 0, done.stdout + done.stderr
    copy = tmp_path / "areal-plugin-mine"
    left = [f"{path.relative_to(copy)}: {line}" for path in copy.rglob("*") if path.is_file()
            and "__pycache__" not in path.parts and ".pytest_cache" not in path.parts
            for line in path.read_text(errors="replace").splitlines() if re.search(r"\bexample\b", line)]
    assert not left, left
    readme = (copy / "README.md").read_text()
    assert readme.startswith("# areal-plugin-mine\n") and "`my_reward`" in readme and "areal mine score" in readme
    assert "Make it yours" not in readme and "template notes" not in readme


@pytest.mark.slow
def test_areal_plugins_lists_the_copy(followed):
    _, env, _ = followed
    done = subprocess.run(["areal", "plugins", "--json"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    listed = {d["distribution"]: d for d in json.loads(done.stdout)["distributions"]}
    mine = listed["areal-plugin-mine"]
    assert (mine["version"], mine["builtin"], mine["components"], mine["plugins"], mine["hooks"],
            mine["errors"], mine["warnings"]) == (
        "0.1.0", False, {"reward": ["my_reward"]}, ["mine"], ["areal_register_commands"], [], [])
    assert "areal-plugin-example" not in listed


@pytest.mark.slow
def test_the_copied_reward_resolves_by_name(followed):
    _, env, _ = followed
    code = ("from areal_core.api import Context, Reward\n"
            "from areal_core.registry import resolve\n"
            "cls = resolve('reward', 'my_reward', expected=Reward)\n"
            "reward = cls.create(Context(options=cls.config_class()))\n"
            "print(cls.__module__, reward('6*7?', 'so: 42', {'answer': 42}), reward('6*7?', '24', {'answer': 42}))\n")
    done = subprocess.run(["python", "-c", code], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "areal_mine.reward 1.0 0.0\n"), done.stderr
