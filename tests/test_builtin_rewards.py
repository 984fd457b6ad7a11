"""The core's built-in rewards: ``function`` (a callable named in config) and ``weighted``."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from areal_core.api import call_reward
from areal_core.config.validate import validate_run
from areal_core.problems import ProblemsError
from areal_core.trainer import build

MODULE = '''
import asyncio, threading

def exact(prompt, completion, item):
    return {"reward": float(completion.strip() == item["answer"]), "thread": threading.current_thread().name}

async def length(prompt, completion, item):
    await asyncio.sleep(0)
    return {"reward": len(completion) / 10, "thread": threading.current_thread().name}

class Shouty:
    def __call__(self, prompt, completion, item):
        return 1.0 if completion.isupper() else 0.0

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_user_rewards"
    sys.modules.pop("my_user_rewards", None)


def reward_problems(run):
    return [p for p in run.problems if p.key.startswith("reward")]


def built(*overrides):
    run = validate_run(overrides=list(overrides))
    assert not reward_problems(run), reward_problems(run)
    return build(run, "reward")


def score(fn, completion, item=None):
    async def main():
        return await call_reward(fn, "q", completion, item or {"answer": "42"}), threading.current_thread().name
    return asyncio.run(main())


def test_function_reward_from_config_sync_runs_off_the_loop(user_module):
    fn = built("reward.name=function", f"reward.target={user_module}:exact")
    result, loop_thread = score(fn, "42")
    assert result.reward == 1.0
    assert result.info["thread"] != loop_thread  # a sync reward never blocks the event loop


def test_function_reward_from_config_async_is_awaited_on_the_loop(user_module):
    fn = built("reward.name=function", f"reward.target={user_module}:length")
    result, loop_thread = score(fn, "12345")
    assert result.reward == 0.5 and result.info["thread"] == loop_thread


def test_function_reward_target_may_be_a_class(user_module):
    fn = built("reward.name=function", f"reward.target={user_module}:Shouty")
    assert score(fn, "YES")[0].reward == 1.0 and score(fn, "no")[0].reward == 0.0


@pytest.mark.parametrize(("target", "words"), [
    ("", "is not 'package.module:attribute'"),
    ("no_such_module_xyz:f", "cannot be imported: ModuleNotFoundError"),
    ("{m}:missing", "has no attribute 'missing'"),
    ("{m}:NOT_CALLABLE", "is 3, which is not callable"),
])
def test_bad_targets_are_reported_with_key_and_fix(user_module, target, words):
    run = validate_run(overrides=["reward.name=function", f"reward.target='{target.format(m=user_module)}'"])
    problems = reward_problems(run)
    assert [p.key for p in problems] == ["reward.target"], problems
    assert words in problems[0].message and problems[0].hint


def test_weighted_combines_parts_resolved_by_name(user_module):
    parts = (f"reward.parts=[{{name: function, target: '{user_module}:exact', weight: 1.0}},"
             f" {{name: function, target: '{user_module}:length', weight: -0.5}}]")
    fn = built("reward.name=weighted", parts)
    result, _ = score(fn, "42")
    assert result.reward == pytest.approx(1.0 - 0.5 * 0.2)
    assert (result.info["function_0"], result.info["function_1"]) == (1.0, pytest.approx(0.2))


def test_weighted_reports_every_bad_part(user_module):
    parts = ("reward.parts=[{name: function}, {name: nosuchreward, weight: 1}, {weight: 2},"
             f" {{name: function, target: '{user_module}:exact', weight: inf}}, {{name: weighted, parts: []}}]")
    run = validate_run(overrides=["reward.name=weighted", parts])
    keys = [p.key for p in reward_problems(run)]
    assert keys == ["reward.parts[0].target", "reward.parts[1].name", "reward.parts[2]",
                    "reward.parts[3].weight", "reward.parts[4].parts"], reward_problems(run)
    with pytest.raises(ProblemsError, match=r"reward.parts\[1\].name"):
        build(run, "reward")


def test_weighted_needs_parts():
    run = validate_run(overrides=["reward.name=weighted"])
    assert [p.key for p in reward_problems(run)] == ["reward.parts"]


def test_a_reward_module_in_the_folder_areal_runs_from_is_found_by_check_and_run(tmp_path):
    """`reward.target=my_reward:score` beside the config, no PYTHONPATH: the console script's path does not hold
    the current folder, yet the run's trainer (`python -m`, started from it) does; check and run agree."""
    import subprocess
    from pathlib import Path

    from areal_core.testing import rl_doubles

    (tmp_path / "here_reward.py").write_text("def score(prompt, completion, item):\n    return 1.0\n")
    areal = str(Path(sys.executable).with_name("areal"))
    with rl_doubles.installed(tmp_path / "doubles") as (config, env):
        assert "" not in env["PYTHONPATH"].split(os.pathsep)  # an empty entry would be the current folder

        def areal_in_here(command, *overrides):
            return subprocess.run([areal, command, str(config), f"output_dir={tmp_path / 'runs'}", "trial=here",
                                   "reward.name=function", *overrides], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=120)

        checked = areal_in_here("check", "reward.target=here_reward:score")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        missing = areal_in_here("check", "reward.target=not_here_reward:score")
        said = missing.stdout + missing.stderr
        assert missing.returncode == 1 and f"put it in the folder you run areal from ({tmp_path})" in said, said
        ran = areal_in_here("run", "reward.target=here_reward:score", "trainer.total_steps=2")
    assert ran.returncode == 0, ran.stdout + ran.stderr
