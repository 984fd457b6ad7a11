"""Keys of ``workflow`` when ``workflow.name: agent``, and the checks that span several of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_core.config.schema import spec
from areal_agent.tools import PARSERS

TRAJECTORY_MODES = ("concat", "per_call")


@dataclass
class AgentConfig:
    """Keys of ``workflow`` when ``workflow.name: agent``."""

    agent: str = spec("", help="'package.module:function' of an in-process agent, "
                               "async def run(item, base_url, api_key) -> reward (or None)")
    agent_command: list = spec(factory=list, help="argv of an agent program run once per episode, with "
                                                  "OPENAI_BASE_URL and OPENAI_API_KEY in its environment and the "
                                                  "item as JSON on stdin and in AREAL_ITEM")
    agent_timeout_s: float = spec(600.0, gt=0.0, help="an agent still running after this is stopped (a subprocess "
                                                      "killed with its process group) and its episode rejected")
    trajectory: str = spec("concat", choices=list(TRAJECTORY_MODES),
                           help="concat: one trajectory per chain of calls (agent tokens trained, tool / user "
                                "tokens masked); per_call: one trajectory per call")
    discount: float = spec(1.0, gt=0.0, le=1.0, help="per-turn discount of the episode reward (see docs/workflows.md)")
    tool_parser: str = spec("auto", choices=list(PARSERS),
                            help="model text -> tool_calls: hermes (<tool_call>{json}</tool_call>), llama3 "
                                 "({name, parameters}), auto (both), none")
    host: str = spec("127.0.0.1", help="address the proxy listens on")
    port: int = spec(0, ge=0, le=65535, help="port of the proxy; 0 = a free one")
    agent_sampling: bool = spec(False, help="honour temperature / top_p / seed sent by the agent; by default "
                                            "rollout.sampling applies (max_tokens and stop are always honoured, "
                                            "max_tokens capped at rollout.sampling.max_new_tokens)")
    missing_reward: str = spec("reject", choices=["reject", "zero"],
                               help="an episode whose agent neither returned a reward nor called /rl/set_reward: "
                                    "reject it, or give it 0")
    max_calls: int = spec(64, ge=1, help="model calls per episode at most; later calls get HTTP 429")
    start_timeout_s: float = spec(30.0, gt=0.0, help="how long the proxy may take to start listening")


def config_problems(options: Any) -> list[tuple[str, str, str]]:
    """(key, message, fix) for each problem spanning several keys (field types and ranges the core checks)."""
    problems = []
    agent, command = options.agent, options.agent_command
    if bool(agent) == bool(command):
        problems.append((
            "workflow.agent",
            f"workflow.agent is {agent!r} and workflow.agent_command is {command!r}: exactly one must be set",
            "name an in-process agent (workflow.agent=my_pkg.agents:run) or a program "
            "(workflow.agent_command='[python, my_agent.py]'), not both"))
    if command and (not isinstance(command, list) or not all(isinstance(a, str) and a for a in command)):
        problems.append(("workflow.agent_command", f"workflow.agent_command is {command!r}, not a list of "
                         f"non-empty strings", "write it as a list: [python, my_agent.py, --flag]"))
    return problems
