"""The plugin's tests: the areal conformance kit, plus what is particular to it.

Run them against the installed plugin: ``pip install -e '.[test]'`` then ``pytest``.
"""

from __future__ import annotations

from importlib import metadata

from typer.testing import CliRunner

from areal_cli.app import build_app
from areal_core.api import Context
from areal_core.plugins import get_plugin_manager
from areal_core.testing import RewardConformance

from areal_example.reward import ExactMatchConfig, ExactMatchReward

SIX_SEVENS = "What is 6 times 7?"


class TestExactMatchReward(RewardConformance):
    """Every check the kit makes of a reward, on this plugin's entry point."""

    component_name = "exact_match"
    examples = [
        (SIX_SEVENS, "6 times 7 is 42.", {"answer": "42"}, 1.0),
        (SIX_SEVENS, "It is 41... no: 42", {"answer": 42}, 1.0),
        (SIX_SEVENS, "42, or maybe 43", {"answer": "42"}, 0.0),
        (SIX_SEVENS, "I don't know", {"answer": "42"}, 0.0),
        ("A billion?", "1,000,000,000", {"answer": "1000000000"}, 1.0),
        ("Capital of France?", "  Paris\n", {"answer": "paris"}, 1.0),
        ("Capital of France?", "Lyon", {"answer": "Paris"}, 0.0),
    ]


def test_case_sensitive_option():
    reward = ExactMatchReward.create(Context(options=ExactMatchConfig(case_sensitive=True)))
    assert reward("Capital of France?", "paris", {"answer": "Paris"}) == 0.0
    assert reward("Capital of France?", "Paris", {"answer": "Paris"}) == 1.0


def plugin_name() -> str:
    """This plugin's name: its entry point in the ``areal`` group (renaming it renames the command)."""
    return next(ep.name for ep in metadata.entry_points(group="areal") if ep.value == "areal_example.hooks")


def test_score_command_prints_the_reward():
    app, errors = build_app(get_plugin_manager(refresh=True))
    result = CliRunner().invoke(app, [plugin_name(), "score", SIX_SEVENS, "It is 42.", "42"])
    assert result.exit_code == 0, result.output
    assert result.output == "1.0\n"
    assert not [e for e in errors if plugin_name() in e]
