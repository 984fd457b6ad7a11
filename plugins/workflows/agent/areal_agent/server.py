"""The HTTP side: a FastAPI app served by uvicorn on its own thread and event loop.

Endpoints: ``/v1/chat/completions`` (streamed as server-sent events when
asked), ``/v1/completions``, ``/v1/responses`` (items, function tools, streaming: :mod:`areal_agent.responses`),
``/v1/models``, ``/rl/set_reward`` (also under ``/v1``), ``/health``; in online
mode also ``/rl/sessions`` and ``/rl/end_session`` (:mod:`areal_agent.online`). Every other call needs
``Authorization: Bearer <the session's key>`` (``/rl/sessions``: a client key); a missing, unknown
or ended key gets 401. Errors come back in OpenAI's shape
(``{"error": {"message", "type", "code"}}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from areal_agent.online import NotReady, OnlineHub
from areal_agent.proxy import BadRequest, ChatRequest, CompletionRequest, Proxy, UnknownModel
from areal_agent.responses import chat_request, conversation_before, response_body, response_events
from areal_agent.sessions import Session, SessionClosed, SessionStore, on_loop

log = logging.getLogger("areal.agent")


class RewardRequest(BaseModel):
    reward: float
    call_id: str | None = None


class OpenRequest(BaseModel):
    item: dict | None = None  # what the client says the session is about; kept in the trajectories' info


class EndRequest(BaseModel):
    reward: float | None = None


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def bearer(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def build_app(proxy: Proxy, sessions: SessionStore, hub: OnlineHub | None = None) -> FastAPI:
    app = FastAPI(title="areal agent proxy", docs_url=None, redoc_url=None, openapi_url=None)

    def session_of(request: Request) -> Session | None:
        return sessions.get(bearer(request))

    def unauthorized() -> JSONResponse:
        return error(401, "missing or invalid API key: each episode's agent gets its own key in OPENAI_API_KEY "
                          "(or the api_key argument), valid until its episode ends", "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, f"invalid request: {exc.errors()}", "invalid_request_error")

    async def serve(request: Request, work: Any) -> Any:
        session = session_of(request)
        if session is None:
            return None, unauthorized()
        try:
            session.begin_call()
            return await work(session), None
        except SessionClosed:
            return None, unauthorized()
        except OverflowError as exc:
            return None, error(429, str(exc), "rate_limit_error")
        except UnknownModel as exc:
            return None, error(404, str(exc), "model_not_found")
        except BadRequest as exc:
            return None, error(400, str(exc), "invalid_request_error")
        except TimeoutError as exc:
            return None, error(504, str(exc), "timeout")
        except asyncio.CancelledError:
            return None, error(409, "the session's episode ended while this call was generating", "cancelled")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "sessions": len(sessions)}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if session_of(request) is None:
            return unauthorized()
        return {"object": "list", "data": [{"id": proxy.model_name, "object": "model", "created": 0,
                                            "owned_by": "areal"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        result, failure = await serve(request, lambda s: proxy.chat_completion(s, body))
        if failure is not None:
            return failure
        record, answer = result
        if not body.stream:
            return JSONResponse(answer)  # as built: no jsonable_encoder pass over every logprob
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(chat_events(answer, include_usage), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        result, failure = await serve(request, lambda s: proxy.completion(s, body))
        if failure is not None:
            return failure
        answer = result[1]
        if not body.stream:
            return JSONResponse(answer)
        return StreamingResponse(completion_events(answer), media_type="text/event-stream")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        try:
            data = await request.json()
        except ValueError:
            return error(400, "the body is not JSON", "invalid_request_error")

        async def work(session: Session) -> dict:
            conversation = conversation_before(session.responses, data.get("previous_response_id"))
            body = chat_request(data, conversation)
            _, answer = await proxy.chat_completion(session, body)
            response, reply = response_body(data, answer)
            # kept without this request's instructions: as the Responses API defines previous_response_id, a later
            # request's instructions replace them (the Agents SDK resends them on every call)
            kept = body.messages[1:] if data.get("instructions") else body.messages
            session.responses[response["id"]] = [*kept, reply]
            return response

        if not isinstance(data, dict):
            return error(400, "the body must be a JSON object", "invalid_request_error")
        response, failure = await serve(request, work)
        if failure is not None:
            return failure
        if not data.get("stream"):
            return JSONResponse(response)
        return StreamingResponse((f"event: {e['type']}\n{sse(e)}" for e in response_events(response)),
                                 media_type="text/event-stream")

    @app.post("/rl/set_reward")
    @app.post("/v1/rl/set_reward")  # under the base URL too: client.post("/rl/set_reward") from an OpenAI client
    async def set_reward(body: RewardRequest, request: Request) -> Any:
        if not math.isfinite(body.reward):
            return error(400, f"reward is {body.reward}; send a finite number", "invalid_request_error")
        session = session_of(request)
        if session is None:
            if hub is not None and body.call_id is None and hub.set_reward(bearer(request) or "", body.reward):
                return {"ok": True}  # an online session that ended without its reward
            return unauthorized()
        try:
            session.set_reward(body.reward, body.call_id)
        except KeyError as exc:
            return error(404, str(exc.args[0]), "invalid_request_error")
        return {"ok": True, "session": session.id}

    if hub is not None:
        @app.post("/rl/sessions")
        @app.post("/v1/rl/sessions")
        async def open_session(request: Request, body: OpenRequest | None = None) -> Any:
            try:
                session = hub.open(bearer(request), (body.item if body else None) or {})
            except PermissionError as exc:
                return error(401, str(exc), "invalid_request_error")
            except NotReady as exc:
                return JSONResponse({"error": {"message": str(exc), "type": "unavailable", "code": 503}},
                                    status_code=503, headers={"Retry-After": "1"})
            return {"session_id": session.id, "api_key": session.key}

        @app.post("/rl/end_session")
        @app.post("/v1/rl/end_session")
        async def end_session(request: Request, body: EndRequest | None = None) -> Any:
            session = session_of(request)
            if session is None:
                return unauthorized()
            reward = body.reward if body else None
            if reward is not None and not math.isfinite(reward):
                return error(400, f"reward is {reward}; send a finite number", "invalid_request_error")
            hub.end(session, reward)
            return {"ok": True, "session": session.id, "rewarded": reward is not None}

    return app


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def chat_events(answer: dict, include_usage: bool):
    """A finished chat completion as OpenAI's chunks: role, content, tool calls, finish, [usage], [DONE]."""
    head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}
    for c in answer["choices"]:
        message, k = c["message"], c["index"]
        yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]})
        if message.get("content"):
            yield sse({**head, "choices": [{"index": k, "delta": {"content": message["content"]},
                                            "logprobs": c["logprobs"], "finish_reason": None}]})
        for j, call in enumerate(message.get("tool_calls") or []):
            yield sse({**head, "choices": [{"index": k, "delta": {"tool_calls": [{"index": j, **call}]},
                                            "finish_reason": None}]})
        yield sse({**head, "choices": [{"index": k, "delta": {}, "finish_reason": c["finish_reason"]}]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"


async def completion_events(answer: dict):
    for c in answer["choices"]:
        yield sse({**answer, "choices": [c]})
    yield "data: [DONE]\n\n"


class ProxyServer:
    """uvicorn serving :func:`build_app` on a thread of its own, on ``host``:``port`` (0 = a free port)."""

    def __init__(self, proxy: Proxy, sessions: SessionStore, host: str = "127.0.0.1", port: int = 0,
                 hub: OnlineHub | None = None) -> None:
        self.proxy, self.sessions, self.host, self.port, self.hub = proxy, sessions, host, port, hub
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None  # serving on an episode loop (serve_here), and that loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _bind(self) -> socket.socket:
        import uvicorn

        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it every response
        # (headers, then body) waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"the agent proxy cannot listen on {self.host}:{self.port} ({exc}). Fix: set "
                          f"workflow.port to a free port, or 0 for any free one") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.proxy, self.sessions, self.hub), log_level="warning", lifespan="off",
                                access_log=False, timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        return sock

    @property
    def on_thread(self) -> bool:
        return self._thread is not None

    def serving_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self._task is not None and not self._task.done() and self._loop is loop

    async def serve_here(self, timeout_s: float) -> ProxyServer:
        """Serve on the running event loop (the episodes' loop: a call then generates without changing threads)."""
        if self._thread is not None or self._task is not None:
            return self
        sock = self._bind()
        loop = asyncio.get_running_loop()
        self._task, self._loop = loop.create_task(self._server.serve(sockets=[sock])), loop
        self._task.add_done_callback(lambda _: sock.close())
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                failure = None if self._task.cancelled() else self._task.exception()
                self._task = None
                raise RuntimeError(f"the agent proxy on {self.host}:{self.port} failed to start: {failure!r}")
            if time.monotonic() > deadline:
                self._server.should_exit = True
                raise TimeoutError(f"waited {timeout_s:.0f} s for the agent proxy (uvicorn) to listen on "
                                   f"{self.host}:{self.port}; raise workflow.start_timeout_s on a loaded machine")
            await asyncio.sleep(0.005)
        log.info("agent proxy listening on %s (on the episodes' event loop)", self.base_url)
        return self

    def start(self, timeout_s: float) -> ProxyServer:
        if self._thread is not None or self._task is not None:
            return self
        sock = self._bind()

        def run() -> None:
            try:
                asyncio.run(self._server.serve(sockets=[sock]))
            except BaseException as exc:  # reported by start() / noticed by the episodes
                self._failure = exc
            finally:
                sock.close()

        self._thread = threading.Thread(target=run, name=f"areal-agent-proxy-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._failure is not None or not self._thread.is_alive():
                raise RuntimeError(f"the agent proxy on {self.host}:{self.port} failed to start: {self._failure!r}")
            if time.monotonic() > deadline:
                self.stop(1.0)
                raise TimeoutError(f"waited {timeout_s:.0f} s for the agent proxy (uvicorn) to listen on "
                                   f"{self.host}:{self.port}; raise workflow.start_timeout_s on a loaded machine")
            time.sleep(0.005)
        log.info("agent proxy listening on %s", self.base_url)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and join the thread (or wait for the task on the episodes' loop); idempotent."""
        if self._task is not None:
            task, loop, self._task = self._task, self._loop, None
            self._server.should_exit = True  # uvicorn's main loop looks at it every 0.1 s
            if loop is not None and not loop.is_closed() and not task.done() and not on_loop(loop):
                try:
                    asyncio.run_coroutine_threadsafe(asyncio.wait({task}), loop).result(timeout_s)
                except Exception:
                    log.warning("the agent proxy on %s:%s did not stop within %.0f s", self.host, self.port,
                                timeout_s)
            return
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the agent proxy thread on %s:%s did not stop within %.0f s", self.host, self.port,
                        timeout_s)
        self._thread = None
