"""The catalogue of what the project ships (areal_core.catalogue) agrees with what is built: every first-party
pyproject, the meta-distribution's dependencies and extras, and every component and backend each installed
plugin declares; and the messages about a missing component name its distribution, never an invented one."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from areal_core import catalogue

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_PROJECTS = sorted(p for p in ROOT.glob("plugins/*/*/pyproject.toml"))


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def test_every_first_party_plugin_is_in_the_catalogue_at_its_folder():
    found = {_project(p)["name"]: str(p.parent.relative_to(ROOT)) for p in PLUGIN_PROJECTS}
    assert found == {d: folder for d, (folder, _) in catalogue.DISTRIBUTIONS.items()}
    assert _project(ROOT / "pyproject.toml")["name"] == catalogue.CORE


def test_the_meta_distribution_brings_the_default_set_and_one_extra_per_optional_part():
    meta = _project(ROOT / "meta" / "pyproject.toml")
    assert meta["name"] == catalogue.META
    assert meta["version"] == _project(ROOT / "pyproject.toml")["version"]
    names = [d.split(">")[0].split("=")[0] for d in meta["dependencies"]]
    assert names == [catalogue.CORE, *catalogue.default_set()]
    extras = meta["optional-dependencies"]
    expected = catalogue.extras()
    assert sorted(extras) == sorted(expected)
    for extra, dists in expected.items():
        if extra == "all":
            assert sorted(extras["all"]) == sorted(f"{catalogue.META}[{e}]" for e in expected if e != "all")
        else:
            assert [d.split(">")[0] for d in extras[extra]] == dists
    for text in [*meta["dependencies"], *(d for e in extras.values() for d in e if not d.startswith("areal-rl["))]:
        assert text.endswith(">=0.1,<0.2"), f"{text}: the meta-distribution pins the same minor line as the core"


def test_every_component_and_backend_a_first_party_plugin_declares_is_in_the_catalogue():
    from areal_core.listing import collect_listing

    declared: dict[tuple[str, str], str] = {}
    for entry in collect_listing()["distributions"]:
        if entry["distribution"] not in catalogue.DISTRIBUTIONS:
            continue
        for kind, names in entry["components"].items():
            for name in names:
                declared[(kind, name)] = entry["distribution"]
        for backend in entry["backends"]:
            declared[("backend", backend["backend"])] = entry["distribution"]
    installed = {e["distribution"] for e in collect_listing()["distributions"]}
    expected = {k: d for k, d in catalogue.PROVIDERS.items() if d in installed}
    assert declared == expected


@pytest.mark.parametrize("distribution", sorted(catalogue.DISTRIBUTIONS))
def test_an_install_line_names_the_meta_extra_the_checkout_folder_and_where_wheels_come_from(distribution):
    line = catalogue.install_line(distribution)
    folder, extra = catalogue.DISTRIBUTIONS[distribution]
    assert f"pip install -e {folder}" in line
    assert (f"'{catalogue.META}[{extra}]'" if extra else f"'{catalogue.META}'") in line
    assert ("--find-links dist" in line) is not catalogue.PUBLISHED


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_cli.app", "check", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_a_missing_first_party_component_names_its_distribution_and_extra():
    """With the vLLM plugin blocked (as if not installed), `allocation: vllm` and `algorithm.name: grpo` (the
    PPO plugin blocked too) are answered with the distribution, the extra and the checkout folder."""
    import os

    env = {**os.environ, "AREAL_DISABLE_PLUGINS": "areal-plugin-vllm,areal-plugin-ppo"}
    result = subprocess.run([sys.executable, "-m", "areal_cli.app", "check", "allocation=vllm:d1@cpu+fsdp:d1@cpu"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "install areal-plugin-vllm, which provides it" in out and "'areal-rl[vllm]'" in out, out
    assert "pip install -e plugins/engines/vllm" in out
    assert "install areal-plugin-ppo, which provides it" in out and "pip install -e plugins/algorithms/ppo" in out


def test_an_unknown_backend_is_not_answered_with_an_invented_distribution_name():
    result = _check("allocation=foo:d1@cpu+fsdp:d1@cpu")
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "backend 'foo'" in out
    assert "areal-plugin-foo" not in out, out
    assert "areal plugins" in out


def test_the_release_workflow_builds_with_the_script_and_refuses_while_unpublished():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    steps = workflow["jobs"]["build"]["steps"]
    text = "\n".join(str(s.get("run", "")) for s in steps)
    assert "bash scripts/build_wheels.sh" in text
    assert "grep -q '^PUBLISHED = True' areal_core/catalogue.py" in text
    assert "'areal-rl[all]'" in text.replace('"', "'")
    assert (ROOT / "areal_core" / "catalogue.py").read_text().count(f"\nPUBLISHED = {catalogue.PUBLISHED}\n") == 1
    publish = workflow["jobs"]["publish"]
    assert publish["permissions"] == {"id-token": "write"}
    assert any(str(s.get("uses", "")).startswith("pypa/gh-action-pypi-publish") for s in publish["steps"])


def test_no_doc_or_message_sends_users_to_the_index_for_a_name_not_published_there():
    """While PUBLISHED is False, every `pip install` of one of our names says where it comes from (the wheels'
    folder or a checkout's editable install); a bare `pip install areal-plugin-ray` would fetch whatever someone
    registered under that name."""
    import re

    if catalogue.PUBLISHED:
        pytest.skip("the names are published: a plain pip install is right")
    ours = re.compile(r"pip install((?:(?!pip install)[^\n])*?)['\"]?(areal-core|areal-rl|areal-plugin-[a-z-]+)")
    files = [p for p in ROOT.rglob("*") if p.suffix in (".md", ".py", ".sh", ".yaml", ".yml", ".toml")
             and not any(part.startswith(".venv") or part in ("tests", "node_modules", "runs") for part in p.parts)
             and p.name != "CHANGELOG.md" and "_template" not in p.parts]
    offenders = []
    for path in files:
        for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in ours.finditer(line):
                between = match.group(1)
                name = match.group(2).rstrip("-")
                if name not in (catalogue.CORE, catalogue.META, *catalogue.DISTRIBUTIONS):
                    continue  # a third party's name (the template's areal-plugin-example)
                if "--find-links" not in between and " -e" not in between and "-e " not in between:
                    offenders.append(f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
