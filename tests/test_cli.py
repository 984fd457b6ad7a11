"""The `areal` command as users type it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from areal_cli.app import build_app
from areal_core.plugins import get_plugin_manager
from areal_core.testing.distributions import install_fake_distribution

runner = CliRunner()
FIRST_PARTY = {"areal-plugin-fsdp", "areal-plugin-megatron", "areal-plugin-vllm", "areal-plugin-sglang",
               "areal-plugin-local"}


def invoke(*args: str):
    app, errors = build_app(get_plugin_manager(refresh=True))
    result = runner.invoke(app, list(args))
    return result, errors


def test_import_core_does_not_import_torch():
    code = "import sys, areal_core, areal_core.api, areal_core.config.validate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plugins_json_lists_first_party_plugins_without_importing_torch():
    code = ("import sys, io, contextlib\nfrom areal_cli.app import main\nbuf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n    try:\n        main(['plugins', '--json'])\n"
            "    except SystemExit as e:\n        assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nprint(buf.getvalue())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    dists = {d["distribution"]: d for d in listing["distributions"]}
    assert FIRST_PARTY <= set(dists)
    assert dists["areal-core"]["builtin"] is True
    fsdp = dists["areal-plugin-fsdp"]
    assert fsdp["version"] == "0.1.0" and fsdp["errors"] == []
    assert "areal_validate_parallelism" in fsdp["hooks"]
    assert [b["backend"] for b in fsdp["backends"]] == ["fsdp"]


def test_check_reports_three_independent_mistakes_and_exits_1(double_stack, tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text("rollout:\n  group_size: 0\ntrainer:\n  sav_every: 5\nallocation: 'infer_double:cpu+train_double:d2x'\n")
    result, _ = invoke("check", str(path), *double_stack)
    assert result.exit_code == 1
    assert result.output == (
        f"3 problems in {path}:\n"
        "  1. [core.range] rollout.group_size: 0 is out of range; it must be >= 1\n"
        "         fix: set rollout.group_size to a value >= 1\n"
        "  2. [core.unknown-key] trainer.sav_every: unknown key\n"
        "         fix: did you mean trainer.save_every?\n"
        "  3. [core.allocation-syntax] allocation: unknown dimension 'x' (allowed: d, p, t, c, e) at character 33\n"
        "           infer_double:cpu+train_double:d2x\n"
        "           " + " " * 32 + "^\n"
        "         fix: see docs/engines.md for the allocation grammar\n"
    )


def test_check_ok(double_stack):
    result, _ = invoke("check", *double_stack)
    assert result.exit_code == 0, result.output
    assert result.output == ("the built-in demo: OK. allocation infer_double:cpu+train_double:cpu "
                             "(0 accelerator(s), 2 process(es))\n")


def test_without_a_config_the_built_in_demo_is_checked_and_its_mistakes_named():
    result, _ = invoke("check")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("the built-in demo: OK. allocation local:cpu+fsdp:cpu")
    bad, _ = invoke("run", "rollout.group_size=0")  # nothing is launched
    assert bad.exit_code == 1
    assert bad.output.splitlines()[0] == "1 problem in the built-in demo:"
    assert "rollout.group_size: 0 is out of range" in bad.output


def test_run_writes_the_resolved_config_then_launches(double_stack, tmp_path):
    out = tmp_path / "runs"
    result, _ = invoke("run", *double_stack, f"output_dir={out}", "experiment=exp", "algorithm.eps_clip=0.5")
    assert result.exit_code == 0, result.output
    run_dir = out / "exp" / "run0"
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["algorithm"] == {"name": "algo_double", "extra": {"eps_clip": 0.5, "group_norm": True}}
    assert written["allocation"] == "infer_double:cpu+train_double:cpu"
    assert json.loads((run_dir / "launched.json").read_text()) == {"allocation": "infer_double:cpu+train_double:cpu",
                                                                   "resume": False}
    again, _ = invoke("run", *double_stack, f"output_dir={out}", "experiment=exp")
    assert again.exit_code == 1
    assert "already holds a run. Fix: continue it with --resume" in again.output
    resumed, _ = invoke("run", *double_stack, f"output_dir={out}", "experiment=exp", "algorithm.eps_clip=0.5",
                        "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((run_dir / "launched.json").read_text())["resume"] is True
    changed, _ = invoke("run", *double_stack, f"output_dir={out}", "experiment=exp", "algorithm.eps_clip=0.6",
                        "--resume")
    assert changed.exit_code == 1
    assert "the config differs from the one" in changed.output and "algorithm.extra.eps_clip (0.5 -> 0.6)" in changed.output


def test_run_with_problems_writes_nothing(double_stack, tmp_path):
    out = tmp_path / "runs"
    result, _ = invoke("run", *double_stack, f"output_dir={out}", "rollout.group_size=0")
    assert result.exit_code == 1
    assert not out.exists()


PLUGIN_CLI = '''
import typer
from areal_core import hookimpl

app = typer.Typer()

@app.command()
def hello(name: str):
    print(f"hello {name}")

def run():
    print("shadowed!")

@hookimpl
def areal_register_commands(registrar):
    registrar.add_group(app)
    registrar.add_command(run, "run")
'''


def test_plugin_adds_a_command_group_but_cannot_shadow_a_builtin(tmp_path):
    with install_fake_distribution(tmp_path, "areal-plugin-greet", "0.5.0", {"areal": {"greet": "greet_cli"}},
                                   {"greet_cli.py": PLUGIN_CLI}):
        result, errors = invoke("greet", "hello", "world")
        shadow, _ = invoke("run", "--help")
    assert result.exit_code == 0 and result.output == "hello world\n"
    assert errors == [
        'plugin "greet" (areal-plugin-greet 0.5.0) tried to add the command \'areal run\', which is a '
        "built-in command; it was not added. Fix: register it under another name "
        "(e.g. registrar.add_group(app, name='greet-run'))."
    ]
    assert "shadowed" not in shadow.output and "built-in demo" in shadow.output


def test_console_script_prints_plugin_warnings_on_stderr(tmp_path):
    with install_fake_distribution(tmp_path, "areal-plugin-broken", "0.3.0", {"areal": {"broken": "broken_mod"}},
                                   {"broken_mod.py": "raise ImportError('missing thing')\n"}) as site:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([str(Path(sys.executable).with_name("areal")), "plugins"], capture_output=True,
                             text=True, env=env)
    assert out.returncode == 0
    assert 'warning: Error importing plugin "broken" (areal-plugin-broken 0.3.0)' in " ".join(out.stderr.split())
