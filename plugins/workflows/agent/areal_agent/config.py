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
    reward_from: str = spec("agent", choices=["agent", "run"],
                            help="agent: the reward the agent returns or posts to /rl/set_reward; run: the run's "
                                 "reward component scores the episode's last reply against the item, and what the "
                                 "agent returns or posts is only logged (an agent cannot forge its reward)")
    missing_reward: str = spec("reject", choices=["reject", "zero"],
                               help="an episode whose agent neither returned a reward nor called /rl/set_reward: "
                                    "reject it, or give it 0")
    online: bool = spec(False, help="serve agents deployed elsewhere instead of running one per episode: clients "
                                     "open sessions with a key of online_keys, episodes train their finished "
                                     "sessions (see docs/workflows.md)")
    online_keys: list = spec(factory=list, help="online mode: the client keys allowed to open sessions, one per client "
                                                "(16 characters or more)")
    online_wait_s: float = spec(60.0, gt=0.0, help="online mode: how long an episode waits for a finished session "
                                                   "before its item is rejected")
    online_reward_timeout_s: float = spec(600.0, gt=0.0, help="online mode: an ended session whose reward has not "
                                                              "come after this is dropped")
    model_aliases: list = spec(factory=list, help="model names the proxy also serves besides 'policy' and model.path "
                                                  "(an agent hard-wired to another name); others get HTTP 404")
    max_calls: int = spec(64, ge=1, help="model calls per episode at most; later calls get HTTP 429")
    start_timeout_s: float = spec(30.0, gt=0.0, help="how long the proxy may take to start listening")
    proxy_loop: str = spec("episodes", choices=["episodes", "thread"],
                           help="where the proxy serves: 'episodes' = on the rollout controller's event loop, so a "
                                "call generates without changing threads; 'thread' = on a thread and loop of its own")


def config_problems(options: Any) -> list[tuple[str, str, str]]:
    """(key, message, fix) for each problem spanning several keys (field types and ranges the core checks)."""
    problems = []
    agent, command, online = options.agent, options.agent_command, options.online
    if online and options.reward_from == "run":
        problems.append(("workflow.reward_from", "workflow.reward_from is 'run' with workflow.online: an online "
                         "session answers its client's own item, which the run's reward cannot check",
                         "set workflow.reward_from=agent for online mode (the client posts the reward)"))
    if bool(agent) + bool(command) + bool(online) != 1:
        problems.append((
            "workflow.agent",
            f"workflow.agent is {agent!r}, workflow.agent_command is {command!r} and workflow.online is {online!r}: "
            f"exactly one must be set",
            "name an in-process agent (workflow.agent=my_pkg.agents:run), or a program "
            "(workflow.agent_command='[python, my_agent.py]'), or serve agents deployed elsewhere "
            "(workflow.online=true with workflow.online_keys)"))
    keys = options.online_keys
    if online and (not isinstance(keys, list) or not keys
                   or not all(isinstance(k, str) and len(k) >= 16 for k in keys)):
        problems.append(("workflow.online_keys", f"workflow.online is true but workflow.online_keys is "
                         f"{['<hidden>'] * len(keys) if isinstance(keys, list) else keys!r} (each needs 16 "
                         f"characters or more)", "give each client a key of its own: "
                         "workflow.online_keys='[a-long-random-key-1, ...]' (python -c 'import secrets; "
                         "print(secrets.token_urlsafe(24))')"))
    if command and (not isinstance(command, list) or not all(isinstance(a, str) and a for a in command)):
        problems.append(("workflow.agent_command", f"workflow.agent_command is {command!r}, not a list of "
                         f"non-empty strings", "write it as a list: [python, my_agent.py, --flag]"))
    return problems
