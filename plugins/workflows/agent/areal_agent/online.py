"""Online mode: agents deployed elsewhere talk to the proxy; their finished sessions become training episodes.

A client holding one of ``workflow.online_keys`` opens a session
(``POST /rl/sessions``: a session id and a session key), calls the model with
the session key like any agent, and ends it (``POST /rl/end_session``,
optionally with the reward). A reward may also come later through
``/rl/set_reward`` with the session key, for up to
``workflow.online_reward_timeout_s``. A session that is ended and rewarded is
finished: the next episode the rollout controller runs takes it (each
``arun_episode`` waits up to ``workflow.online_wait_s`` for one, else rejects
its item), so online sessions are admitted, batched and trained like any
episode.

Staleness: a finished session is trained only if every token it generated was
sampled at the version the engines serve when its episode takes it (or
later). The controller hands that episode to a batch trained at most
``rollout.max_head_offpolicyness`` versions on, so every trained token keeps
the run's staleness bound; older sessions are dropped and counted
(``dropped_stale``). Calls reach the engine the controller handed the most
recent episode; until the first episode starts, ``/rl/sessions`` answers 503.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from areal_agent.sessions import CallRecord, Session, SessionStore

# How often a waiting episode looks for a finished session.
POLL_S = 0.02


@dataclass
class Finished:
    session: Session
    records: list[CallRecord]
    reward: float


class NotReady(RuntimeError):
    """No episode has started yet, so there is no engine to serve an online session."""


class OnlineHub:
    """Online sessions between their client and the episode that trains them; thread-safe."""

    def __init__(self, sessions: SessionStore, keys: list[str], max_calls: int, reward_timeout_s: float) -> None:
        self.sessions, self.keys = sessions, frozenset(keys)
        self.max_calls, self.reward_timeout_s = max_calls, reward_timeout_s
        self.engine: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._finished: deque[Finished] = deque()
        self._awaiting_reward: dict[str, tuple[Session, list[CallRecord], float]] = {}  # key -> (.., ended at)
        self.counts = {"opened": 0, "finished": 0, "trained": 0, "dropped_stale": 0, "dropped_no_reward": 0}

    def attach(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Serve online calls with the engine (and loop) the controller handed the latest episode."""
        with self._lock:
            self.engine, self.loop = engine, loop

    def open(self, client_key: str | None, item: Any) -> Session:
        if not client_key or client_key not in self.keys:
            raise PermissionError("missing or unknown client key: open an online session with one of "
                                  "workflow.online_keys as the bearer token")
        with self._lock:
            engine, loop = self.engine, self.loop
            self.counts["opened"] += 1
        if engine is None or loop is None or loop.is_closed():
            raise NotReady("training has not started an episode yet, so no engine serves online sessions; "
                           "retry shortly")
        return self.sessions.open(item, engine, loop, self.max_calls)

    def end(self, session: Session, reward: float | None) -> None:
        records = self.sessions.close(session)
        with self._lock:
            if reward is not None:
                self._finish(session, records, reward)
            else:
                self._awaiting_reward[session.key] = (session, records, time.monotonic())

    def set_reward(self, key: str, reward: float) -> bool:
        """The reward of an ended session that has none yet; False when ``key`` names no such session."""
        with self._lock:
            waiting = self._awaiting_reward.pop(key, None)
            if waiting is None:
                return False
            self._finish(waiting[0], waiting[1], reward)
            return True

    def _finish(self, session: Session, records: list[CallRecord], reward: float) -> None:
        self._finished.append(Finished(session, records, reward))
        self.counts["finished"] += 1

    def _expire(self) -> None:
        now = time.monotonic()
        for key, (_, _, ended) in list(self._awaiting_reward.items()):
            if now - ended > self.reward_timeout_s:
                del self._awaiting_reward[key]
                self.counts["dropped_no_reward"] += 1

    async def next_finished(self, timeout_s: float, version: int) -> tuple[Finished | None, list[str]]:
        """The oldest finished session whose tokens are all at ``version`` or newer, waiting up to
        ``timeout_s``; with what was dropped on the way (one line each)."""
        dropped: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._expire()
                while self._finished:
                    done = self._finished.popleft()
                    oldest = min((v for r in done.records for c in r.choices for v in c.versions), default=version)
                    if oldest >= version:
                        self.counts["trained"] += 1
                        return done, dropped
                    self.counts["dropped_stale"] += 1
                    dropped.append(f"online session {done.session.id} dropped: its oldest token is version "
                                   f"{oldest}, the engines serve {version}, so training it would break the "
                                   f"staleness bound")
            if time.monotonic() >= deadline:
                return None, dropped
            await asyncio.sleep(POLL_S)
