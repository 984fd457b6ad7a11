"""`areal run --dry-run` (the override launcher.dry_run=true), and a launcher that refuses in ``create``:
neither leaves a run folder behind."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from areal_cli.app import build_app
from areal_core.plugins import get_plugin_manager
from areal_core.testing.distributions import install_fake_distribution


def invoke(*args: str):
    app, errors = build_app(get_plugin_manager(refresh=True))
    return CliRunner().invoke(app, list(args)), errors

DRY_LAUNCHERS = '''
import json
from dataclasses import dataclass, field
from pathlib import Path

from areal_core.api import Launcher
from areal_core.problems import Problem, ProblemsError


@dataclass
class DryConfig:
    dry_run: bool = field(default=False, metadata={"help": "show, start nothing"})


class DryRunLauncherDouble(Launcher):
    """Prints what it was given; returns 3 on a dry run so the test sees the exit status passed on."""

    config_class = DryConfig

    def launch(self, run, run_dir, *, resume=False):
        print(json.dumps({"dry_run": self.context.options.dry_run, "run_dir_exists": Path(run_dir).exists()}))
        return 3 if self.context.options.dry_run else 0


class RefusingLauncherDouble(Launcher):
    @classmethod
    def create(cls, context):
        raise ProblemsError([Problem("double.no-tool", "the tool it needs is not on PATH", "install it",
                                     key="launcher.name")], source="the refusing launcher")

    def launch(self, run, run_dir, *, resume=False):
        raise AssertionError("never launched")
'''


def launchers(tmp_path):
    return install_fake_distribution(tmp_path / "launchers", "areal-test-dry-launchers", "0.0.1", {
        "areal.launchers": {"dry_double": "dry_launchers:DryRunLauncherDouble",
                            "refusing_double": "dry_launchers:RefusingLauncherDouble"}},
        {"dry_launchers.py": DRY_LAUNCHERS})


def test_a_launcher_without_a_dry_run_is_told_in_one_paragraph(double_stack, tmp_path):
    out = tmp_path / "runs"
    result, _ = invoke("run", *double_stack, f"output_dir={out}", "--dry-run")
    assert result.exit_code == 1
    assert result.output.startswith("--dry-run: the 'launcher_double' launcher has no dry run (it declares no "
                                    "launcher.dry_run option)")
    assert "Fix: drop --dry-run" in result.output and "unknown key" not in result.output
    assert not out.exists()


def test_a_dry_run_creates_no_run_folder_and_passes_the_launchers_status_on(double_stack, tmp_path):
    out = tmp_path / "runs"
    with launchers(tmp_path):
        flag, _ = invoke("run", *double_stack, "launcher.name=dry_double", f"output_dir={out}", "--dry-run")
        option, _ = invoke("run", *double_stack, "launcher.name=dry_double", "launcher.dry_run=true",
                           f"output_dir={out}")
        real, _ = invoke("run", *double_stack, "launcher.name=dry_double", f"output_dir={out}")
    for dry in (flag, option):
        assert dry.exit_code == 3, dry.output
        assert json.loads(dry.output) == {"dry_run": True, "run_dir_exists": False}
    assert real.exit_code == 0 and json.loads(real.output) == {"dry_run": False, "run_dir_exists": True}


def test_a_launcher_refusing_in_create_is_reported_before_the_run_folder_is_made(double_stack, tmp_path):
    out = tmp_path / "runs"
    with launchers(tmp_path):
        result, _ = invoke("run", *double_stack, "launcher.name=refusing_double", f"output_dir={out}")
    assert result.exit_code == 1
    assert "1 problem in the refusing launcher:" in result.output
    assert "launcher.name: the tool it needs is not on PATH" in result.output and "fix: install it" in result.output
    assert not out.exists()
