"""Installing from the built wheels, as a user without a checkout would (issue 41, part 4).

`scripts/build_wheels.sh` builds every distribution into a folder; a fresh virtual environment (no system site
packages, nothing from this checkout) gets the CPU torch first, as scripts/install.sh pins it on CPU machines,
then `pip install --find-links DIST 'areal-rl[all]'`. In that environment `areal --version`, `areal plugins`,
`areal check` (the demo and a GPU recipe's allocation) answer, and a three-step `areal run` on a tiny model
writes its run folder: so the wheels hold every file the code reads, not only what the checkout has beside it.
Slow: ~2 minutes of installs (pip's cache and the machine's local package folders make them fast here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from areal_core import catalogue
from areal_core.testing.waits import scaled

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(args, timeout, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=scaled(timeout), **kwargs)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheels")
    dist = base / "dist"
    _run(["bash", ROOT / "scripts" / "build_wheels.sh"], 300, cwd=ROOT,
         env={**os.environ, "DIST": str(dist), "AREAL_VENV": str(Path(sys.prefix))})
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", venv], 120)
    python = venv / "bin" / "python"
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    _run([*pip, "torch==2.13.0"], 600)
    _run([*pip, "--find-links", dist, f"{catalogue.META}[all]"], 900)
    return dist, venv


def test_build_wheels_builds_one_wheel_per_distribution(wheel_env):
    dist, _ = wheel_env
    names = {p.name.split("-")[0] for p in dist.glob("*.whl")}
    expected = {d.replace("-", "_") for d in [catalogue.CORE, catalogue.META, *catalogue.DISTRIBUTIONS]}
    assert names == expected


def test_the_clean_environment_holds_only_the_wheels_not_the_checkout(wheel_env):
    _, venv = wheel_env
    python = venv / "bin" / "python"
    where = _run([python, "-c", "import areal_core, areal_local, areal_cli; print(areal_core.__file__); "
                                "print(areal_local.__file__); print(areal_cli.__file__)"], 120, cwd=venv)
    for line in where.stdout.split():
        assert str(venv) in line and str(ROOT) not in line, where.stdout
    installed = json.loads(_run([python, "-m", "pip", "list", "--format", "json"], 120).stdout)
    versions = {row["name"]: row["version"] for row in installed}
    core_version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for distribution in [catalogue.CORE, catalogue.META, *catalogue.DISTRIBUTIONS]:
        assert versions.get(distribution) == core_version, (distribution, versions.get(distribution))


def test_areal_answers_from_the_wheels(wheel_env, tmp_path):
    _, venv = wheel_env
    areal = venv / "bin" / "areal"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    version = _run([areal, "--version"], 60, cwd=tmp_path, env=env).stdout
    assert "areal-core 0.1.0" in version and "areal-plugin-vllm 0.1.0" in version, version
    plugins = _run([areal, "plugins"], 120, cwd=tmp_path, env={**env, "COLUMNS": "200"}).stdout
    for distribution in catalogue.DISTRIBUTIONS:
        assert distribution in plugins, (distribution, plugins)
    assert "error" not in plugins.lower(), plugins
    check = _run([areal, "check"], 120, cwd=tmp_path, env=env)
    assert "the built-in demo: OK" in check.stdout + check.stderr
    # the 8-GPU recipe's split, judged by the vLLM plugin's own rules from its wheel: no vLLM in this environment
    # (it runs in one of its own), and the fix says how to make one without a checkout's scripts
    check = subprocess.run([str(areal), "check", "allocation=vllm:d4+fsdp:d4", "rollout.backend=vllm"],
                           capture_output=True, text=True, timeout=scaled(120), cwd=tmp_path, env=env)
    out = check.stdout + check.stderr
    assert check.returncode != 0 and "1 problem" in out and "[vllm.python]" in out, out
    assert "elsewhere: python -m venv V && V/bin/pip install 'vllm>=0.32.0,<0.33'" in out, out


def test_a_short_run_from_the_wheels_writes_its_run_folder(wheel_env, tmp_path):
    _, venv = wheel_env
    areal = venv / "bin" / "areal"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    from areal_core.testing import tiny_model  # written by the checkout: a folder of files, as a hub model is

    model = tiny_model(tmp_path / "tiny", seed=0)
    _run([areal, "run", f"output_dir={tmp_path / 'runs'}", f"model.path={model}", "model.dtype=float32",
          "trainer.total_steps=3", "eval.size=4", "rollout.batch_size=2", "rollout.group_size=2",
          "rollout.dynamic_filtering=false"], 900, cwd=tmp_path, env=env)
    run_dir = tmp_path / "runs" / "demo" / "run0"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert (run_dir / "completions.jsonl").stat().st_size > 0
