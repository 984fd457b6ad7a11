"""The core works at the lower end of every range it declares (issue 41, part 6): a clean venv gets the core's
wheel with each dependency pinned to its floor (`name>=X` -> `name==X`), and the CLI answers there: `--version`,
`plugins`, `check` (which, with the core alone, names the plugins to install, and nothing fails to import).
It found two floors that did not hold (typer 0.12 with today's click ran `--version` on every command; stevedore
before 5.6 lacks `on_missing_entrypoints_callback`). Slow: ~30 s of installs. The plugins' floors (torch,
transformers, ...) are not tested here: each needs a multi-GB install."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from areal_core.testing.waits import scaled

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def floors() -> list[str]:
    """``name==X`` for each of the core's dependencies, X its declared lower bound."""
    pins = []
    for text in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(text)
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert lower, f"{text}: every dependency of the core declares a lower bound"
        pins.append(f"{requirement.name}=={lower[0]}")
    return pins


def run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=scaled(600), **kwargs)


def test_the_core_at_its_dependency_floors(tmp_path):
    dist = tmp_path / "dist"
    built = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, ROOT])
    assert built.returncode == 0, built.stderr
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", venv]).returncode == 0
    pins = floors()
    installed = run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                     "--find-links", dist, "areal-core", *pins])
    assert installed.returncode == 0, installed.stderr[-3000:]
    versions = run([venv / "bin" / "python", "-m", "pip", "list", "--format", "freeze"]).stdout.lower()
    for pin in pins:
        assert pin.lower().replace("_", "-") in versions.replace("_", "-"), (pin, versions)
    areal = venv / "bin" / "areal"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    version = run([areal, "--version"], cwd=tmp_path, env=env)
    assert version.returncode == 0 and version.stdout.startswith("areal-core "), version.stdout + version.stderr
    listed = run([areal, "plugins"], cwd=tmp_path, env={**env, "COLUMNS": "200"})
    assert listed.returncode == 0 and "areal-core" in listed.stdout and "jsonl" in listed.stdout, listed.stdout
    assert not listed.stdout.startswith("areal-core 0.1.0 ("), "the --version callback ran instead of the command"
    checked = run([areal, "check"], cwd=tmp_path, env=env)
    out = checked.stdout + checked.stderr
    assert checked.returncode == 1 and "install areal-plugin-local, which provides it" in out, out
    assert "failed to import" not in out and "Traceback" not in out, out
