"""The `areal` command as users type it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "time": 0}\n')  # the launcher double trains no step itself
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


def test_a_moved_or_copied_run_folder_resumes_where_it_now_is(double_stack, tmp_path):
    """output_dir, experiment, trial, launcher.* and metrics.* say where a run lives and reports: they may change at
    --resume (the saved config is updated); a key that changes the training may not."""
    import shutil

    first = tmp_path / "runs"
    assert invoke("run", *double_stack, f"output_dir={first}", "experiment=exp")[0].exit_code == 0
    (first / "exp" / "run0" / "metrics.jsonl").write_text('{"step": 1, "time": 0}\n')
    moved = tmp_path / "elsewhere"
    shutil.copytree(first / "exp" / "run0", moved / "exp2" / "copy")
    resumed, _ = invoke("run", *double_stack, f"output_dir={moved}", "experiment=exp2", "trial=copy", "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert (f"--resume: continuing with experiment ('exp' -> 'exp2'), output_dir ({str(first)!r} -> "
            f"{str(moved)!r}), trial ('run0' -> 'copy'): where the run lives and reports, not what it trains") \
        in resumed.output
    written = yaml.safe_load((moved / "exp2" / "copy" / "config.yaml").read_text())
    assert (written["output_dir"], written["experiment"], written["trial"]) == (str(moved), "exp2", "copy")
    assert json.loads((moved / "exp2" / "copy" / "launched.json").read_text())["resume"] is True
    changed, _ = invoke("run", *double_stack, f"output_dir={moved}", "experiment=exp2", "trial=copy",
                        "rollout.group_size=3", "--resume")
    assert changed.exit_code == 1
    assert "at: rollout.group_size (" in changed.output and "only where the run lives and reports may change" \
        in changed.output


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
    assert out.returncode == 1  # `areal plugins` fails when a plugin is broken; other commands only warn
    assert 'warning: Error importing plugin "broken" (areal-plugin-broken 0.3.0)' in " ".join(out.stderr.split())
    assert out.stderr.rstrip().endswith("broken: areal-plugin-broken (see problems above)")


# --- issue 21, item 3: check refuses what run would refuse or crash on; a failed start does not block its re-run ---

LONG_OVERRIDE = "actor.optimizer.lr=1" + "0" * 400  # longer than a file name may be (255 bytes)


def test_a_long_first_override_is_an_override_not_a_config_path(double_stack, tmp_path):
    for command in ("check", "run"):
        result, _ = invoke(command, LONG_OVERRIDE, *double_stack, f"output_dir={tmp_path / 'runs'}")
        assert result.exit_code == 1 and not isinstance(result.exception, OSError), result.exception
        assert result.output == (
            "1 problem in the built-in demo:\n"
            "  1. [core.range] actor.optimizer.lr: an integer of 401 digits is too large for a number (at most "
            "about 1.8e308)\n         fix: set actor.optimizer.lr to a smaller number\n")
    assert not (tmp_path / "runs").exists()


def test_a_long_config_path_is_a_problem_not_a_traceback(tmp_path):
    result, _ = invoke("check", "x" * 300 + ".yaml")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "[core.config-file] cannot read config xxx" in result.output and "File name too long" in result.output


def test_an_existing_config_file_with_an_equals_sign_in_its_name_is_still_the_config(double_stack, tmp_path):
    path = tmp_path / "lr=1e-5.yaml"
    path.write_text("actor:\n  optimizer:\n    lr: 1.0e-5\n")
    result, _ = invoke("check", str(path), *double_stack)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{path}: OK.")


@pytest.mark.parametrize("override, key", [
    ("rollout.sampling.temperature=.inf", "rollout.sampling.temperature"),
    ('rollout.sampling.stop=[""]', "rollout.sampling.stop"),
    ("eval.success=nan", "eval.success"),
    ("trainer.save_every_s=.inf", "trainer.save_every_s"),
    ("actor.optimizer.eps=.inf", "actor.optimizer.eps"),
    ("rollout.group_size=1e20", "rollout.group_size"),
    ("rollout.group_size=100000000000000000000", "rollout.group_size"),
    ("model.path=/nowhere/at/all", "model.path"),
])
def test_check_refuses_what_the_run_would_refuse(double_stack, override, key):
    result, _ = invoke("check", *double_stack, override)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("1 problem in the built-in demo:\n") and f"] {key}: " in result.output


def test_check_and_run_refuse_an_empty_or_missing_model_folder(double_stack, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.safetensors").write_bytes(b"")
    for path, what in ((tmp_path / "empty", "is an empty folder"), (tmp_path / "weights.safetensors", "is a file")):
        for command in ("check", "run"):
            result, _ = invoke(command, *double_stack, f"model.path={path}", f"output_dir={tmp_path / 'runs'}")
            assert result.exit_code == 1, result.output
            assert f"[core.model] model.path: '{path}' {what}" in result.output
    assert not (tmp_path / "runs").exists()


def test_an_empty_config_file_is_refused_by_check_and_run(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set yet\n")
    for command in ("check", "run"):
        result, _ = invoke(command, str(path), f"output_dir={tmp_path / 'runs'}")
        assert result.exit_code == 1
        assert f"[core.config-file] config {path} is empty" in result.output
    assert not (tmp_path / "runs").exists()


def test_an_output_dir_that_cannot_be_written_is_refused_and_nothing_is_left(double_stack, tmp_path, monkeypatch):
    import errno
    import tempfile

    real_mkdtemp = tempfile.mkdtemp
    parent = tmp_path / "mount"
    parent.mkdir()

    def read_only_below(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).is_relative_to(parent):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", read_only_below)
    for command in ("check", "run"):
        result, _ = invoke(command, *double_stack, f"output_dir={parent / 'runs'}")
        assert result.exit_code == 1, result.output
        assert "[core.output-dir] output_dir:" in result.output and "the file system is read-only" in result.output
    assert list(parent.iterdir()) == []
    ok, _ = invoke("check", *double_stack, f"output_dir={tmp_path / 'elsewhere'}")
    assert ok.exit_code == 0, ok.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mount", "stack"]


@pytest.fixture
def failing_launch(monkeypatch):
    """The launcher double, failing before the first step (as a server that dies at start) until told not to."""
    import stack_doubles

    state = {"fail": True, "launches": []}
    real = stack_doubles.LauncherDouble.launch

    def launch(self, run, run_dir, *, resume=False):
        state["launches"].append(resume)
        if state["fail"]:
            (Path(run_dir) / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n')  # eval before
            (Path(run_dir) / "samples.jsonl").write_text("")
            return 1
        return real(self, run, run_dir, resume=resume)

    monkeypatch.setattr(stack_doubles.LauncherDouble, "launch", launch)
    return state


def test_a_start_that_failed_before_its_first_step_does_not_block_its_re_run(double_stack, tmp_path, failing_launch):
    out = [*double_stack, f"output_dir={tmp_path / 'runs'}"]
    run_dir = tmp_path / "runs" / "demo" / "run0"
    first, _ = invoke("run", *out)
    assert first.exit_code == 1 and (run_dir / "config.yaml").exists()
    failing_launch["fail"] = False
    again, _ = invoke("run", *out, "algorithm.eps_clip=0.4")  # the same trial, its config fixed
    assert again.exit_code == 0, again.output
    assert failing_launch["launches"] == [False, False]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]["extra"]["eps_clip"] == 0.4
    assert not (run_dir / "metrics.jsonl").exists()  # the failed start's rows are gone


def test_resume_of_a_start_that_failed_before_its_first_step_starts_afresh(double_stack, tmp_path, failing_launch):
    out = [*double_stack, f"output_dir={tmp_path / 'runs'}"]
    run_dir = tmp_path / "runs" / "demo" / "run0"
    assert invoke("run", *out)[0].exit_code == 1
    failing_launch["fail"] = False
    resumed, _ = invoke("run", *out, "algorithm.eps_clip=0.4", "--resume")  # a changed config is no obstacle
    assert resumed.exit_code == 0, resumed.output
    assert "holds no completed step" in resumed.output and "nothing to resume from" in resumed.output
    assert failing_launch["launches"] == [False, False]
    assert json.loads((run_dir / "launched.json").read_text())["resume"] is False
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # now it holds a step: a run
    refused, _ = invoke("run", *out, "algorithm.eps_clip=0.4")
    assert refused.exit_code == 1 and "already holds a run" in refused.output
    resumed, _ = invoke("run", *out, "algorithm.eps_clip=0.4", "--resume")
    assert resumed.exit_code == 0 and failing_launch["launches"][-1] is True


def test_a_run_folder_in_use_is_refused(double_stack, tmp_path, failing_launch):
    import fcntl

    out = [*double_stack, f"output_dir={tmp_path / 'runs'}"]
    run_dir = tmp_path / "runs" / "demo" / "run0"
    assert invoke("run", *out)[0].exit_code == 1  # a start that stopped before its first step...
    failing_launch["fail"] = False
    with open(run_dir / "run.lock", "a") as held:  # ...and another `areal run` of the same trial still starting
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        busy, _ = invoke("run", *out)
    assert busy.exit_code == 1 and "is in use by another areal run" in busy.output
    assert failing_launch["launches"] == [False]
    assert invoke("run", *out)[0].exit_code == 0


def test_names_with_colons_print_as_typed_not_as_emoji(tmp_path):
    """rich turns ":m:" into an emoji by default: the fuzzer's config name ":M" was reported as "1 problem in Ⓜ".
    A user's path, key or value is printed as typed."""
    result, _ = invoke("check", ":M")
    assert result.exit_code == 1
    assert "1 problem in :M" in result.output and "config :M does not exist" in result.output
    result, _ = invoke("check", "trial=a:smile:b")  # refused (a trial name has no colons), quoted as typed
    assert result.exit_code == 1 and "a:smile:b" in result.output and "😄" not in result.output


def test_areal_plugins_flags_a_component_whose_module_is_missing_and_exits_1(tmp_path):
    eps = {"areal.rewards": {"ghost": "ghost_mod:score"}}
    with install_fake_distribution(tmp_path, "areal-plugin-ghost", "0.1.0", eps, {}):
        result, _ = invoke("plugins", "--json")
    assert result.exit_code == 1
    listed = {d["distribution"]: d for d in json.loads(result.stdout)["distributions"]}
    assert listed["areal-plugin-ghost"]["errors"] == [
        "reward 'ghost' (ghost = ghost_mod:score) cannot be imported: areal-plugin-ghost 0.1.0 does not ship "
        "module ghost_mod. Fix: its entry point is wrong, so reinstalling will not help: the maintainers of "
        "areal-plugin-ghost must name a module the distribution contains (uninstall it, or block it with "
        "AREAL_DISABLE_PLUGINS=areal-plugin-ghost)."]


def test_areal_plugins_flags_a_plugin_whose_requirements_are_not_installed_without_importing_it(tmp_path):
    """The module is there, so only importing it would fail: the declared requirements tell without importing."""
    eps = {"areal.rewards": {"needy": "needy_mod:score"}}
    files = {"needy_mod.py": "raise RuntimeError('imported')\n"}  # importing it would fail the listing loudly
    requires = ["no-such-dist-xyz>=1.0", "pytest>=1", "pluggy<0.1", "colorama; sys_platform == 'nonexistent'",
                "rich; extra == 'fancy'"]
    with install_fake_distribution(tmp_path, "areal-plugin-needy", "0.2.0", eps, files, requires=requires):
        result, _ = invoke("plugins", "--json")
    assert result.exit_code == 1
    listed = {d["distribution"]: d for d in json.loads(result.stdout)["distributions"]}
    pluggy = importlib.metadata.version("pluggy")
    assert listed["areal-plugin-needy"]["errors"] == [
        "areal-plugin-needy 0.2.0 requires no-such-dist-xyz>=1.0 (not installed), so its components may fail to "
        "import. Fix: pip install 'no-such-dist-xyz>=1.0'.",
        f"areal-plugin-needy 0.2.0 requires pluggy<0.1 ({pluggy} is installed), so its components may fail to "
        f"import. Fix: pip install 'pluggy<0.1'."]
    assert "needy_mod" not in sys.modules


def test_version_names_the_core_and_every_plugin_distribution(tmp_path):
    with install_fake_distribution(tmp_path, "areal-plugin-thirdparty", "2.3.4",
                                   {"areal.rewards": {"third_reward": "third_mod:Reward"}}, {}):
        result, _ = invoke("--version")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"areal-core {importlib.metadata.version('areal-core')} (")
    assert "areal-plugin-thirdparty 2.3.4 (third_reward)" in lines
    assert any(line.startswith("areal-plugin-fsdp 0.1.0 (fsdp)") for line in lines)
    out = subprocess.run([str(Path(sys.executable).with_name("areal")), "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("areal-core "), out.stderr


def test_shell_completion_is_offered_and_completes_commands():
    areal = str(Path(sys.executable).with_name("areal"))
    assert "--install-completion" in invoke("--help")[0].output
    # the script `--install-completion` writes for bash (asked through click's protocol: `--show-completion`
    # detects the shell from the parent processes, which a test does not control)
    script = subprocess.run([areal], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "_AREAL_COMPLETE": "source_bash"})
    assert "complete" in script.stdout and "_AREAL_COMPLETE" in script.stdout, script.stdout + script.stderr
    # what bash asks the command when the user presses tab after `areal ch`
    asked = subprocess.run([areal], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "_AREAL_COMPLETE": "complete_bash", "COMP_WORDS": "areal ch",
                                "COMP_CWORD": "1"})
    assert "check" in asked.stdout.split(), asked.stdout + asked.stderr


@pytest.mark.parametrize("columns", [80, 60])
def test_the_plugins_listing_never_cuts_a_name_on_a_narrow_terminal(columns):
    from areal_core.listing import collect_listing

    out = subprocess.run([str(Path(sys.executable).with_name("areal")), "plugins"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": str(columns)})
    assert out.returncode == 0, out.stderr
    listing = collect_listing()
    names = {h.removeprefix("areal_") for e in listing["distributions"] for h in e["hooks"]}
    names |= {e["distribution"] for e in listing["distributions"]}
    for name in names:
        assert name in out.stdout, f"{name!r} is cut at {columns} columns"
    assert max(len(line) for line in out.stdout.splitlines()) <= columns or columns < 80  # blocks wrap softly
