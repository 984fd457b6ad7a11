"""The ``agent`` workflow: any agent program written against the OpenAI API, trained unchanged.

Per episode (``rollout.group_size`` per item) the workflow opens a session on
its proxy (an id and an API key), runs the agent against
``http://127.0.0.1:<port>/v1`` with that key, and when the agent ends (or is
stopped at ``workflow.agent_timeout_s``) closes the session and turns its
recorded calls into trajectories (:mod:`areal_agent.trajectories`). The proxy
generates through the engine ``arun_episode`` was given, so agent traffic goes
through the rollout controller like any workflow's. In online mode
(``workflow.online``) no agent is run: each episode trains the next session
an agent deployed elsewhere finished (:mod:`areal_agent.online`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

from areal_core.api import InferenceEngine, Trajectory, Workflow, group_size_of, sampling_params
from areal_agent import trajectories
from areal_agent.config import AgentConfig, config_problems
from areal_agent.online import OnlineHub
from areal_agent.proxy import Proxy
from areal_agent.runner import AgentOutcome, run_in_process, run_subprocess
from areal_agent.server import ProxyServer
from areal_agent.sessions import SessionStore

log = logging.getLogger("areal.agent")


class AgentWorkflow(Workflow):
    """Episodes run by an agent through the OpenAI-compatible proxy; needs the run's tokenizer."""

    config_class = AgentConfig

    def __init__(self, context: Any = None, tokenizer: Any = None) -> None:
        super().__init__(context)
        o = self.options = self.context.options if self.context.options is not None else AgentConfig()
        problems = config_problems(o)
        if problems:
            raise ValueError("; ".join(f"{key}: {message}. Fix: {fix}" for key, message, fix in problems))
        self.run_reward = (self.context.extras or {}).get("reward")
        if o.reward_from == "run" and self.run_reward is None:
            raise ValueError("workflow.reward_from is 'run' but the workflow was given no reward component "
                             "(context.extras['reward']); the trainer passes the run's `reward`. Fix: set reward.name, "
                             "or workflow.reward_from=agent")
        self.agent = None
        if o.agent:
            from areal_core.rewards import load_target

            self.agent = load_target(o.agent, "workflow.agent")
        config = self.context.config
        self.group_size = group_size_of(config)
        if tokenizer is None:
            from areal_core.models import load_tokenizer

            tokenizer = load_tokenizer(config)
        self.tokenizer = tokenizer
        model_name = config.model.path if config is not None and config.model.path else "areal-policy"
        self.sessions = SessionStore()
        self.proxy = Proxy(tokenizer, sampling_params(config, {}), o, model_name)
        self.hub = OnlineHub(self.sessions, list(o.online_keys), o.max_calls, o.online_reward_timeout_s) \
            if o.online else None
        self.server = ProxyServer(self.proxy, self.sessions, o.host, o.port, self.hub)
        self._start_lock = threading.Lock()
        self._started = False

    # ------------------------------------------------------------ the proxy's life
    def start(self) -> ProxyServer:
        """Start the proxy (once); every wait has ``workflow.start_timeout_s``."""
        with self._start_lock:
            if not self._started:
                self.server.start(self.options.start_timeout_s)
                self._started = True
        return self.server

    @property
    def base_url(self) -> str:
        return self.start().base_url

    def close(self) -> None:
        """Stop the proxy; idempotent."""
        with self._start_lock:
            self.server.stop()
            self._started = False
            self.server = ProxyServer(self.proxy, self.sessions, self.options.host, self.options.port, self.hub)

    def __del__(self) -> None:
        try:
            self.server.stop(0.5)
        except Exception:
            pass

    # ------------------------------------------------------------ episodes
    async def run_agent(self, item: Any, base_url: str, api_key: str, session_id: str) -> AgentOutcome:
        o = self.options
        if self.agent is not None:
            return await run_in_process(self.agent, item, base_url, api_key, o.agent_timeout_s)
        return await run_subprocess(list(o.agent_command), item, base_url, api_key, o.agent_timeout_s,
                                    {"AREAL_SESSION_ID": session_id,
                                     "AREAL_REWARD_URL": base_url.removesuffix("/v1") + "/rl/set_reward"})

    async def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._started and (self.server.on_thread or self.server.serving_on(loop)):
            return
        # Online mode serves clients that come before and between episodes: on a thread of its own, as does a
        # proxy started by start() before the first episode.
        if self.options.proxy_loop != "episodes" or self.hub is not None:
            await loop.run_in_executor(None, self.start)
            return
        async with self._serving_lock():
            if self._started and not self.server.serving_on(loop):  # its loop has ended (a new controller)
                self.close()
            if not self._started:
                await self.server.serve_here(self.options.start_timeout_s)
                self._started = True

    def _serving_lock(self) -> asyncio.Lock:
        """One start at a time among the episodes of this loop (they all find the proxy not yet started)."""
        loop = asyncio.get_running_loop()
        if getattr(self, "_serving", (None, None))[0] is not loop:
            self._serving = (loop, asyncio.Lock())
        return self._serving[1]

    async def _online_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        """Train the next finished online session (see :mod:`areal_agent.online`), or reject ``item``."""
        await self._ensure_started()
        self.hub.attach(engine, asyncio.get_running_loop())
        done, dropped = await self.hub.next_finished(self.options.online_wait_s, engine.version)
        for line in dropped:
            log.warning("%s", line)
        if done is None:
            log.info("no online session finished within workflow.online_wait_s = %g s; item %r rejected",
                     self.options.online_wait_s, _item_id(item))
            return None
        if not done.records:
            log.warning("online session %s rejected: it made no model call", done.session.id)
            return None
        info = {"id": done.session.id, "online": True, "session": done.session.id, "client_item": done.session.item,
                "episode_reward": done.reward}
        build = trajectories.concat if self.options.trajectory == "concat" else trajectories.per_call
        return build(done.records, float(done.reward), self.options.discount, info)

    async def _episode(self, engine: InferenceEngine, item: Any, k: int) -> list[Trajectory] | None:
        await self._ensure_started()
        o = self.options
        session = self.sessions.open(item, engine, asyncio.get_running_loop(), o.max_calls)
        try:
            outcome = await self.run_agent(item, self.server.base_url, session.key, session.id)
        finally:
            records = self.sessions.close(session)
        label = f"agent episode (item {_item_id(item)!r}, sample {k}, session {session.id})"
        if outcome.failure is not None:
            log.warning("%s rejected: %s", label, outcome.failure)
            return None
        reward = outcome.reward if outcome.reward is not None else session.reward
        if o.reward_from == "run" and records:  # the agent's claim is kept for the record, not trained on
            claimed = {"agent_reward": reward, "agent_call_rewards": [r.reward for r in records]}
            for record in records:
                record.reward = None
            reward, scored = await self._score(records, item)
            info = {"id": _item_id(item), "sample": k, "session": session.id, "episode_reward": reward,
                    "reward_from": "run", "reward_info": scored, **claimed}
            build = trajectories.concat if o.trajectory == "concat" else trajectories.per_call
            return build(records, float(reward), o.discount, info)
        if reward is None:
            if o.missing_reward == "reject":
                log.warning("%s rejected: the agent returned no reward and did not call /rl/set_reward "
                            "(workflow.missing_reward = reject)", label)
                return None
            reward = 0.0
        if not records:
            log.warning("%s rejected: the agent made no model call", label)
            return None
        info = {"id": _item_id(item), "sample": k, "session": session.id, "episode_reward": reward}
        build = trajectories.concat if o.trajectory == "concat" else trajectories.per_call
        return build(records, float(reward), o.discount, info)

    async def _score(self, records: list, item: Any) -> tuple[float, dict]:
        """The run's reward for the episode: its last reply (the last call's first choice: content, and tool calls
        as JSON when it ended on one) against ``item``, the first call's prompt as the prompt."""
        from areal_core.api.reward import call_reward

        last = records[-1].choices[0]
        completion = last.content or ""
        if last.tool_calls:
            completion += json.dumps(last.tool_calls, ensure_ascii=False)
        prompt = self.proxy.chat.decode(records[0].prompt_ids)
        result = await call_reward(self.run_reward, prompt, completion, item)
        return float(result.reward), dict(result.info or {})

    async def arun_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        if self.hub is not None:
            return await self._online_episode(engine, item)
        results = await asyncio.gather(*(self._episode(engine, item, k) for k in range(self.group_size)))
        kept = [t for group in results if group for t in group]
        return kept or None


def _item_id(item: Any) -> Any:
    return item.get("id") if isinstance(item, dict) else None
