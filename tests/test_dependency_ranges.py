"""Every first-party distribution bounds the libraries that break their APIs between releases, and what this
environment installed is inside every range (so the tests ran against a release the ranges allow)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/*/pyproject.toml"))]
# Libraries whose next major (or 0.x minor series) has broken APIs areal uses: each needs an upper bound.
FAST_MOVERS = {"torch", "transformers", "wandb", "mlflow-skinny", "typer", "trackio", "ray", "datasets", "fastapi",
               "uvicorn", "httpx", "huggingface-hub", "megatron-core", "math-verify", "reasoning-gym"}


def requirements(path: Path) -> list[Requirement]:
    project = tomllib.loads(path.read_text())["project"]
    return [Requirement(r) for r in project.get("dependencies", [])]


@pytest.mark.parametrize("path", PYPROJECTS, ids=[str(p.parent.relative_to(ROOT)) or "core" for p in PYPROJECTS])
def test_fast_movers_have_upper_bounds_and_the_installed_release_is_inside(path):
    for req in requirements(path):
        name = req.name.lower().replace("_", "-")
        if name in FAST_MOVERS:
            assert any(spec.operator in ("<", "<=", "~=", "==") for spec in req.specifier), \
                f"{path.relative_to(ROOT)}: {req} has no upper bound"
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional plugin's dependency this environment lacks
        assert req.specifier.contains(installed.split("+")[0], prereleases=True), \
            f"{path.relative_to(ROOT)}: installed {req.name} {installed} is outside {req.specifier}"
