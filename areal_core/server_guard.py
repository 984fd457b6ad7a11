"""Inference servers that obey only their run: a per-run secret, the bound host, no web page, bounded bodies.

An inference server listens on 127.0.0.1, where every local user and every
web page the machine's browser opens can reach it. :class:`RunGuard` wraps a
server's ASGI app and refuses, before the app sees the request:

- **no secret** (401): when the run has a secret (``AREAL_RUN_TOKEN`` in the
  server's environment, drawn by ``areal run`` for each run and handed to its
  servers and trainers the way it hands them the rest of their environment),
  every route but ``GET /health`` needs ``Authorization: Bearer <secret>``;
  the comparison takes the same time whatever the guess;
- **another host** (421): the ``Host`` header must name the address the
  server is bound to, ``127.0.0.1``, ``localhost`` or ``[::1]`` (a DNS-rebinding
  page sends its own name);
- **a web page** (403): a ``POST`` that carries an ``Origin`` header comes from
  a browser (no client of areal sends one); even a page that cannot read the
  answer could pause a server or load weights with a bodiless form post;
- **a large body** (413): more than ``max_body_bytes`` (``Content-Length``,
  and counted as it arrives when the length is not given).

What it does not do: it does not hide the server from a process of the same
user, which can read the secret from the run's processes (``/proc/PID/environ``
is readable by the same user only). Starlette's ``TrustedHostMiddleware`` does
the host check alone; the rest has no ready-made ASGI middleware, so this one
is written out, as plain ASGI so that any server framework can use it.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from typing import Any, Awaitable, Callable

RUN_TOKEN_ENV = "AREAL_RUN_TOKEN"
DEFAULT_MAX_BODY_BYTES = 16 * 1024**2
OPEN_PATHS = frozenset({"/health"})  # GET only: what a launcher polls before it knows anything else
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def new_run_token() -> str:
    """A fresh secret for one run (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def run_token() -> str | None:
    """The run's secret from this process's environment; None when the run has none."""
    return os.environ.get(RUN_TOKEN_ENV) or None


def ensure_run_token() -> str:
    """The run's secret, drawn now (and put in this process's environment, which every process the run starts
    inherits) unless the environment has one already: what a launcher calls before it starts any server."""
    token = run_token()
    if token is None:
        token = os.environ[RUN_TOKEN_ENV] = new_run_token()
    return token


def auth_headers(token: str | None = None) -> dict[str, str]:
    """The header a client of the run's servers sends (none when the run has no secret)."""
    token = run_token() if token is None else token
    return {"Authorization": f"Bearer {token}"} if token else {}


def run_load_roots(config: Any) -> tuple[str, ...]:
    """Where a run's servers may load weights from besides the trainer's /dev/shm stages: the run folder
    (``output_dir/experiment/trial``, resolved); () for a config that names no run."""
    from pathlib import Path

    try:
        return (str(Path(config.output_dir).expanduser().resolve() / config.experiment / config.trial),)
    except (AttributeError, TypeError):
        return ()


def may_load(path: str, roots: tuple[str, ...] | list[str], stage_root: str | None = None,
             stage_prefixes: tuple[str, ...] = ()) -> bool:
    """Whether a server may load weights from ``path`` (links resolved): it lies under one of ``roots`` (the run
    folder), or inside a folder of ``stage_root`` (``/dev/shm``) whose name starts with one of
    ``stage_prefixes`` and that this server's user owns (the trainer's weight stages)."""
    from pathlib import Path

    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        return False
    for root in roots:
        try:
            if real.is_relative_to(Path(root).resolve(strict=True)):
                return True
        except (OSError, RuntimeError):
            continue
    if stage_root is None or not stage_prefixes:
        return False
    stages = Path(stage_root).resolve()
    for part in [real, *real.parents]:
        if part.parent == stages:
            return part.name.startswith(tuple(stage_prefixes)) and part.stat().st_uid == os.getuid()
    return False


# A check of a request's JSON body, for the paths it is given for: (status, detail) to refuse, None to pass
BodyCheck = Callable[[str, Any], "tuple[int, str] | None"]


class RunGuard:
    """ASGI middleware: refuse what is not from this run (see the module docstring). ``body_checks``: per path,
    a check of a POST's JSON body (the body is read whole, within the cap, before the app sees it), for what a
    server framework's own routes do not check (vLLM's ``/collective_rpc`` loads any folder it is given)."""

    def __init__(self, app: Any, *, token: str | None, bound_host: str = "127.0.0.1",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_checks: dict[str, BodyCheck] | None = None) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"RunGuard: max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app, self.token, self.max_body_bytes = app, token or None, max_body_bytes
        self.hosts = LOCAL_HOSTS | {bound_host.lower()}
        self.body_checks = dict(body_checks or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        method, path = scope.get("method", "GET"), scope.get("path", "")
        refusal = self._refusal(headers, method, path)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _answer(send, 413, f"the request body has {length} bytes; this server takes at most "
                                     f"{self.max_body_bytes} (rollout.max_request_mb)")
            return
        answered = False

        async def sent_once(message: dict) -> None:  # after a 413 sent from here, what the app answers is dropped
            if not answered:
                await send(message)

        async def counted() -> dict:
            """``receive``, stopping a body that did not say its length once it grows past the cap: the 413 goes
            out from here and the app is told the client left."""
            nonlocal seen, answered
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes and not answered:
                    await _answer(send, 413, f"the request body grew past {self.max_body_bytes} bytes; this server "
                                             f"takes at most {self.max_body_bytes} (rollout.max_request_mb)")
                    answered = True
                    return {"type": "http.disconnect"}
            return message

        seen = 0
        check = self.body_checks.get(path) if method == "POST" else None
        if check is not None:
            body = b""
            while True:
                message = await counted()
                if message["type"] == "http.disconnect":
                    return  # the client left, or the body passed the cap (answered 413 already)
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
            try:
                parsed = json.loads(body or b"null")
            except ValueError:
                parsed = None  # not JSON: the app answers it as it would
            refusal = check(path, parsed)
            if refusal is not None:
                await _answer(send, *refusal)
                return
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, sent_once)
            return
        await self.app(scope, counted, sent_once)

    def _refusal(self, headers: dict[str, str], method: str, path: str) -> tuple[int, str] | None:
        host = headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if name.lower() not in self.hosts:
            return 421, (f"the Host header {host!r} is not this server's address; it answers only requests for "
                         f"{', '.join(sorted(self.hosts))}")
        if method != "GET" and "origin" in headers:
            return 403, (f"a {method} from a web page (Origin: {headers['origin']}) is refused: only the run's own "
                         f"processes send requests here")
        if self.token and not (method == "GET" and path in OPEN_PATHS):
            given = headers.get("authorization", "")
            expected = f"Bearer {self.token}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return 401, (f"{method} {path} needs the run's secret (Authorization: Bearer ..., from "
                             f"{RUN_TOKEN_ENV} in the environment of the run's processes)")
        return None


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
