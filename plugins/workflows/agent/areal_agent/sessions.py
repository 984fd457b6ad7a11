"""Sessions: one per episode, each with its own API key, its engine and every call it made, token-in / token-out."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Choice:
    """One sampled reply: the engine's ids, logprobs and versions, and what the proxy returned for them."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    text: str  # the decoded output, special tokens removed
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)  # what looked like a tool call and was not returned as one


@dataclass
class CallRecord:
    """One model call of a session: the prompt ids exactly as the engine saw them, and its choices."""

    call_id: str
    endpoint: str
    prompt_ids: list[int]
    choices: list[Choice]
    parent: tuple[str, int] | None = None  # (call_id, choice) whose prompt + output this prompt starts with
    reward: float | None = None  # a per-call reward from /rl/set_reward
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    tools_digest: str = ""  # proxy.tools_key of the tools it was rendered with


class SessionClosed(RuntimeError):
    """The session's episode has ended (finished, timed out or rejected)."""


class Session:
    """What one episode's agent talks to. Calls arrive on the proxy's thread; the episode reads them after."""

    def __init__(self, item: Any, engine: Any, loop: asyncio.AbstractEventLoop, max_calls: int) -> None:
        self.id = uuid.uuid4().hex
        self.key = f"sk-areal-{secrets.token_urlsafe(24)}"
        self.item, self.engine, self.loop, self.max_calls = item, engine, loop, max_calls
        self.records: list[CallRecord] = []
        self.reward: float | None = None
        self.closed = False
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._prefixes: dict[tuple[str, ...], tuple[CallRecord, int]] = {}  # messages + reply -> (call, choice)
        self._texts: list[tuple[str, CallRecord, int]] = []  # (prompt + output text, call, choice) of completions
        self._in_flight: set[Any] = set()  # concurrent.futures.Future, or an asyncio task on the episode's loop
        self._calls_started = 0
        # (call id, choice) -> its prompt and output ids decoded (special tokens kept): the next call's drift check
        # decodes only its new ids
        self.kept_texts: dict[tuple[str, int], str] = {}
        self.responses: dict[str, list[dict]] = {}  # Responses API: id -> its messages + reply (previous_response_id)

    # ------------------------------------------------------------ calls
    def begin_call(self) -> None:
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.id} has ended")
            if self._calls_started >= self.max_calls:
                raise OverflowError(f"session {self.id} made {self._calls_started} calls, the most "
                                    f"workflow.max_calls allows")
            self._calls_started += 1

    async def generate(self, request: Any, timeout_s: float) -> Any:
        """``engine.agenerate(request)`` on the episode's event loop (where the controller's engine lives): awaited
        in place when the proxy serves on that loop, else handed to it from the proxy's thread."""
        if asyncio.get_running_loop() is self.loop:
            future: Any = asyncio.ensure_future(self.engine.agenerate(request))
        else:
            future = asyncio.run_coroutine_threadsafe(self.engine.agenerate(request), self.loop)
        with self._lock:
            if self.closed:
                future.cancel()
                raise SessionClosed(f"session {self.id} has ended")
            self._in_flight.add(future)
        try:
            return await asyncio.wait_for(future if isinstance(future, asyncio.Future) else asyncio.wrap_future(future),
                                          timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            raise TimeoutError(f"waited {timeout_s:.0f} s for the inference engine to answer request "
                               f"{request.rid} of session {self.id}") from None
        finally:
            with self._lock:
                self._in_flight.discard(future)

    def add(self, record: CallRecord, messages: list[str] | None = None, texts: list[str] | None = None) -> None:
        """Keep ``record``; ``messages`` (canonical keys) or ``texts`` index its choices for prefix reuse."""
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.id} has ended")
            self.records.append(record)
            for k in range(len(record.choices)):
                if messages is not None:
                    self._prefixes[(*messages, texts[k])] = (record, k)
                elif texts is not None:
                    self._texts.append((texts[k], record, k))

    def earlier(self, keys: list[str]) -> tuple[int, CallRecord, int] | None:
        """The longest earlier call + reply that ``keys`` (canonical messages) start with: (length, call, choice)."""
        with self._lock:
            for n in range(len(keys) - 1, 0, -1):
                hit = self._prefixes.get(tuple(keys[:n]))
                if hit is not None:
                    return n, *hit
        return None

    def earlier_text(self, prompt: str) -> tuple[str, CallRecord, int] | None:
        """The longest earlier completion call whose prompt + output text ``prompt`` starts with."""
        with self._lock:
            hits = [(t, r, k) for t, r, k in self._texts if prompt.startswith(t)]
        return max(hits, key=lambda h: len(h[0]), default=None)

    def set_reward(self, reward: float, call_id: str | None) -> None:
        with self._lock:
            if call_id is None:
                self.reward = reward
                return
            for record in self.records:
                if record.call_id == call_id:
                    record.reward = reward
                    return
        raise KeyError(f"session {self.id} has no call {call_id!r}")

    def close(self) -> list[CallRecord]:
        """End the session: its key stops working, calls still generating are cancelled. Returns its calls."""
        with self._lock:
            self.closed = True
            in_flight, self._in_flight = list(self._in_flight), set()
            records = list(self.records)
        for future in in_flight:
            if isinstance(future, asyncio.Future) and not on_loop(future.get_loop()):
                future.get_loop().call_soon_threadsafe(future.cancel)
            else:
                future.cancel()
        return records


class SessionStore:
    """Sessions by API key; thread-safe."""

    def __init__(self) -> None:
        self._by_key: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, item: Any, engine: Any, loop: asyncio.AbstractEventLoop, max_calls: int) -> Session:
        session = Session(item, engine, loop, max_calls)
        with self._lock:
            self._by_key[session.key] = session
        return session

    def get(self, key: str | None) -> Session | None:
        if not key:
            return None
        with self._lock:
            session = self._by_key.get(key)
        return session if session is not None and not session.closed else None

    def close(self, session: Session) -> list[CallRecord]:
        with self._lock:
            self._by_key.pop(session.key, None)
        return session.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling code runs on ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
