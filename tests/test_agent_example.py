"""The agent plugin's example (examples/agent_calculator.yaml) run end to end: it needs the embedded engine and the
fsdp trainer beside the agent plugin, so it lives with the repository's tests, not the plugin's (a plugin's tests
import no other plugin)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing.waits import scaled


@pytest.mark.slow
def test_the_example_config_runs_end_to_end_on_the_demo_model(tmp_path):
    """examples/agent_calculator.yaml as the README runs it, shortened: 2 steps of 4 episodes, 2 validation items.
    The agent's tool loop runs against the real SmolLM2 through the embedded engine and the FSDP trainer trains
    its trajectories (several calls each). Whether it learns: the README's figures, not this test."""
    root = Path(__file__).resolve().parents[1]
    overrides = [f"output_dir={tmp_path}", "trainer.total_steps=2", "trainer.save_every=0", "eval.size=2",
                 "rollout.group_size=4", "rollout.batch_size=1", "rollout.max_head_offpolicyness=1"]
    proc = subprocess.run([str(Path(sys.executable).with_name("areal")), "run", "examples/agent_calculator.yaml",
                           *overrides], cwd=root, capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "agent_calculator" / "run0"
    assert "agent: areal_agent.examples.calculator:run" in (run_dir / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/items"] == rows[-1]["eval/items"] == 2 and rows[-1]["eval/after_step"] == 2
    for row in rows[1:]:
        assert row["rollout/rejected"] == 0  # no agent failed or timed out
        assert {row["reward/min"], row["reward/max"]} <= {0.0, 1.0}
        # the model's own tokens (tool calls, answers) were trained; the prompts and tool results were masked
        assert 0 < row["train/n_loss_tokens"] < row["train/n_tokens"]
    assert "eval before training: accuracy" in proc.stderr and "eval after step 2: accuracy" in proc.stderr
