"""A real ``areal run`` (launcher, trainer, rollout controller) with the agent workflow and an agent program, the
engines and algorithm being the core's doubles: agent-command lists come through config overrides, every
step trains agent trajectories, and the run ends cleanly."""

from __future__ import annotations

import sys
import textwrap

import pytest

AGENT = textwrap.dedent("""
    import json, os, sys
    import openai
    item = json.loads(sys.stdin.read())
    client = openai.OpenAI(max_retries=0, timeout=60)
    messages = [{"role": "user", "content": f"item {item['id']}"}]
    for turn in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=item["length"])
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    print(item["id"] % 2)
""")


@pytest.mark.slow
def test_areal_run_trains_agent_trajectories(tmp_path, tiny_model_dir):
    from areal_core.testing.processes import read_jsonl
    from areal_core.testing.rl_doubles import areal_run

    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    proc, run_dir = areal_run(tmp_path, "agent", [
        "workflow.name=agent", f"workflow.agent_command=[{sys.executable}, {agent}]", "workflow.agent_timeout_s=60",
        f"model.path={tiny_model_dir}", "trainer.total_steps=3", "rollout.max_head_offpolicyness=1"], timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r]
    assert len(rows) >= 3, rows
    resolved = (run_dir / "config.yaml").read_text()
    assert "agent_command" in resolved and str(agent) in resolved
    assert all(r["rollout/rejected"] == 0 and r["staleness/episode_lag/max"] <= 1 for r in rows)
    assert {r["reward/min"] for r in rows} | {r["reward/max"] for r in rows} <= {0.0, 1.0}  # item id % 2
