"""Running one episode's agent: in-process (a coroutine function) or as a subprocess, always under a timeout.

An agent ends in one of three ways: it returns (a reward, or None), it fails
(raises, exits non-zero), or it is stopped at ``workflow.agent_timeout_s``.
The last two reject the episode; :class:`AgentOutcome` says why, for the log.
A subprocess runs in a process group of its own and the whole group is
killed on timeout or cancellation, so tools it started die with it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable

# How long a killed agent's process group may take to be reaped.
REAP_TIMEOUT_S = 5.0
# Kept of a subprocess agent's stderr, for the log line naming why it failed.
STDERR_TAIL = 2000


@dataclass
class AgentOutcome:
    """What an agent run came to: ``reward`` (None if it gave none) or ``failure`` (why it is rejected)."""

    reward: float | None = None
    failure: str | None = None
    stdout_tail: str = ""


def _reward_value(value: Any, source: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{source} returned {value!r}; return a number (the episode's reward), a dict with "
                        f"'reward', or None and call /rl/set_reward")
    return float(value)


async def run_in_process(fn: Callable[..., Any], item: Any, base_url: str, api_key: str,
                         timeout_s: float) -> AgentOutcome:
    """``await fn(item, base_url, api_key)`` (a sync ``fn`` runs in a thread) for at most ``timeout_s``."""
    name = getattr(fn, "__qualname__", repr(fn))
    if inspect.iscoroutinefunction(fn):
        call = fn(item, base_url, api_key)
    else:
        call = asyncio.get_running_loop().run_in_executor(None, fn, item, base_url, api_key)
    try:
        value = await asyncio.wait_for(call, timeout_s)
        return AgentOutcome(_reward_value(value, f"agent {name}"))
    except asyncio.TimeoutError:
        return AgentOutcome(failure=f"agent {name} did not finish within workflow.agent_timeout_s = {timeout_s:g} s")
    except Exception as exc:
        return AgentOutcome(failure=f"agent {name} raised {type(exc).__name__}: {exc}")


def _kill_group(process: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_subprocess(argv: list[str], item: Any, base_url: str, api_key: str, timeout_s: float,
                         extra_env: dict | None = None) -> AgentOutcome:
    """Run ``argv`` with the proxy's address and key in its environment and the item on stdin.

    Its reward: the last line of its stdout if that is a number (or JSON with
    ``reward``), else whatever it sent to ``/rl/set_reward`` (the caller reads that).
    """
    item_json = json.dumps(item, ensure_ascii=False, default=str)
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "AREAL_ITEM": item_json,
           **(extra_env or {})}
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, start_new_session=True)
    except OSError as exc:
        return AgentOutcome(failure=f"workflow.agent_command {argv!r} cannot start: {exc}")
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(item_json.encode()), timeout_s)
    except asyncio.TimeoutError:
        _kill_group(process)
        await _reap(process)
        return AgentOutcome(failure=f"agent command {argv!r} (pid {process.pid}) did not finish within "
                                    f"workflow.agent_timeout_s = {timeout_s:g} s; its process group was killed")
    except BaseException:  # the episode is cancelled (the run stops): take the agent down with it
        _kill_group(process)
        await _reap(process)
        raise
    _kill_group(process)  # whatever it left running in its group
    out = stdout.decode(errors="replace")
    if process.returncode != 0:
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:].strip()
        return AgentOutcome(failure=f"agent command {argv!r} (pid {process.pid}) exited with status "
                                    f"{process.returncode}; its stderr ends: {tail!r}", stdout_tail=out[-200:])
    lines = [line for line in out.strip().splitlines() if line.strip()]
    reward = None
    if lines:
        try:
            reward = _reward_value(json.loads(lines[-1]), f"agent command {argv!r} (last stdout line)")
        except (ValueError, TypeError):
            reward = None  # not a reward line: the agent reports through /rl/set_reward
    return AgentOutcome(reward, stdout_tail=out[-200:])


async def _reap(process: asyncio.subprocess.Process) -> None:
    try:
        await asyncio.wait_for(process.wait(), REAP_TIMEOUT_S)
    except asyncio.TimeoutError:
        pass
