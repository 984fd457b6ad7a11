"""The plugin template works once copied, renamed and installed as its README says.

The copy is renamed (distribution ``areal-plugin-copied``, package
``areal_copied``, reward ``copied_match``, plugin ``copied``), installed with
pip into a folder of its own, and then used the way a user would: listed by
``areal plugins``, run as ``areal copied score``, resolved by name, and
tested by its own tests, each in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1] / "plugins" / "_template"

# The README's renaming table, applied to every text file of the copy.
RENAMES = [("areal-plugin-example", "areal-plugin-copied"), ("areal_example", "areal_copied"),
           ("exact_match", "copied_match")]


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory) -> tuple[Path, Path]:
    """(copy, site): the renamed template and the folder pip installed it into."""
    root = tmp_path_factory.mktemp("template")
    copy = root / "areal-plugin-copied"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist"))
    (copy / "conftest.py").unlink()  # README: only the monorepo needs it
    (copy / "areal_example").rename(copy / "areal_copied")
    for path in copy.rglob("*"):
        if path.suffix in {".py", ".toml", ".md"}:
            text = path.read_text()
            for old, new in RENAMES:
                text = text.replace(old, new)
            path.write_text(text)
    pyproject = copy / "pyproject.toml"
    pyproject.write_text(re.sub(r"^example = ", "copied = ", pyproject.read_text(), flags=re.M))

    site = root / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "--target", str(site), str(copy)],
        capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return copy, site


def run(site: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"AREAL_LOAD_PLUGINS", "AREAL_DISABLE_PLUGINS"}}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)


def test_areal_plugins_lists_the_copy(installed_copy):
    _, site = installed_copy
    done = run(site, "-m", "areal_cli.app", "plugins", "--json")
    assert done.returncode == 0, done.stderr
    listed = {d["distribution"]: d for d in json.loads(done.stdout)["distributions"]}
    copied = listed["areal-plugin-copied"]
    assert (copied["version"], copied["builtin"], copied["components"], copied["plugins"], copied["hooks"],
            copied["errors"], copied["warnings"]) == (
        "0.1.0", False, {"reward": ["copied_match"]}, ["copied"], ["areal_register_commands"], [], [])
    assert "areal-plugin-example" not in listed


def test_the_copy_adds_its_command(installed_copy):
    _, site = installed_copy
    right = run(site, "-m", "areal_cli.app", "copied", "score", "What is 6 times 7?", "It is 42.", "42")
    wrong = run(site, "-m", "areal_cli.app", "copied", "score", "Capital?", "paris", "Paris", "--case-sensitive")
    assert (right.returncode, right.stdout, wrong.returncode, wrong.stdout) == (0, "1.0\n", 0, "0.0\n"), (
        right.stderr + wrong.stderr)


def test_the_copied_reward_resolves_by_name(installed_copy):
    _, site = installed_copy
    code = ("from areal_core.api import Context, Reward\n"
            "from areal_core.registry import resolve\n"
            "cls = resolve('reward', 'copied_match', expected=Reward)\n"
            "reward = cls.create(Context(options=cls.config_class()))\n"
            "print(cls.__module__, reward('6*7?', 'so: 42', {'answer': 42}), reward('6*7?', '24', {'answer': 42}))\n")
    done = run(site, "-c", code)
    assert (done.returncode, done.stdout) == (0, "areal_copied.reward 1.0 0.0\n"), done.stderr


def test_the_copys_own_tests_pass(installed_copy):
    copy, site = installed_copy
    done = run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=copy)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s", summary), summary
