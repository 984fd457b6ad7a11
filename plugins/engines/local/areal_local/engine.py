"""The ``local`` inference engine as the rollout controller sees it: a client
of one embedded server process (see :mod:`areal_local.server`) over HTTP on
127.0.0.1, and the recipe the launcher uses to start that server."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from areal_core.api import GenerationRequest, GenerationResponse, InferenceEngine, ServerProcess
from areal_core.remote import log_tail, run_log_path


@dataclass
class LocalEngineConfig:
    """Keys of ``rollout`` when ``rollout.backend: local``."""

    max_batch: int = field(default=64, metadata={"ge": 1, "help": "requests decoded together per server"})
    startup_timeout_s: float = field(default=600.0, metadata={"gt": 0.0,
                                     "help": "time allowed for a server to load its model"})


def _model_arg(config: Any) -> str:
    return config.model.path or "demo"


def _log_tail(config: Any, index: int) -> str:
    """The server's own last log lines, for errors seen from the trainer."""
    return log_tail(run_log_path(config, index))


class LocalEngine(InferenceEngine):
    capabilities = frozenset({"pause", "seed", "update_weights_from_disk", "update_weights_from_tensors"})
    config_class = LocalEngineConfig

    @classmethod
    def server_process(cls, context: Any, index: int, port: int) -> ServerProcess:
        import httpx

        config, options = context.config, context.options or LocalEngineConfig()
        argv = [sys.executable, "-m", "areal_local.server", "--model", _model_arg(config),
                "--dtype", config.model.dtype, "--port", str(port), "--max-batch", str(options.max_batch)]

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:  # not listening yet
                return False

        return ServerProcess(argv, ready, f"the /health endpoint of embedded engine {index} on 127.0.0.1:{port}",
                             startup_timeout_s=options.startup_timeout_s)

    @classmethod
    def create(cls, context: Any) -> LocalEngine:
        address = context.extras.get("address")
        if not address:
            raise ValueError("the local inference engine needs its server's address (context.extras['address']); "
                             "it is set by the launcher, which starts the server from server_process()")
        return cls(context, address)

    def __init__(self, context: Any, address: str, timeout_s: float = 600.0) -> None:
        super().__init__(context)
        self.address = address
        self.index = context.extras.get("server_index", 0)
        config = context.config
        self.timeout_s = getattr(getattr(config, "rollout", None), "request_timeout_s", timeout_s)
        self._version = 0
        self._client: Any = None

    @property
    def version(self) -> int:
        return self._version

    def _http(self) -> Any:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(base_url=f"http://{self.address}", timeout=self.timeout_s,
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    async def _post(self, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            response = await self._http().post(path, json=body or {})
        except httpx.TimeoutException:
            raise TimeoutError(f"waited {self.timeout_s:.0f} s (rollout.request_timeout_s) for embedded engine "
                               f"{self.index} at {self.address} to answer {path}") from None
        except httpx.TransportError as exc:
            raise ConnectionError(f"embedded engine {self.index} at {self.address} is unreachable during {path} "
                                  f"({type(exc).__name__}: {exc}); it has probably crashed"
                                  f"{_log_tail(self.context.config, self.index)}") from None
        if response.status_code == 400:
            raise ValueError(response.json()["detail"])
        if response.status_code != 200:
            raise RuntimeError(f"embedded engine {self.index} answered {path} with HTTP {response.status_code}: "
                               f"{response.text[:500]}{_log_tail(self.context.config, self.index)}")
        return response.json()

    async def start(self) -> None:
        health = await self._get_health()
        self._version = health["version"]

    async def _get_health(self) -> dict:
        import httpx

        try:
            response = await self._http().get("/health", timeout=10)
        except httpx.TransportError as exc:
            raise ConnectionError(f"embedded engine {self.index} at {self.address} is unreachable "
                                  f"({type(exc).__name__}: {exc}){_log_tail(self.context.config, self.index)}") from None
        response.raise_for_status()
        return response.json()

    async def health(self) -> bool:
        try:
            return (await self._get_health())["status"] == "ok"
        except Exception:
            return False

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        s = request.sampling
        out = await self._post("/generate", {
            "rid": request.rid, "input_ids": list(request.input_ids),
            "sampling": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                         "top_k": s.top_k, "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids),
                         "seed": s.seed}})
        return GenerationResponse(request.rid, request.input_ids, out["output_ids"], out["output_logprobs"],
                                  out["output_versions"], out["stop_reason"])

    async def pause(self) -> None:
        await self._post("/pause")

    async def resume(self) -> None:
        await self._post("/resume")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        health = await self._post("/update_weights_from_disk", {"path": str(path), "version": version})
        self._version = health["version"]

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Hand tensors over through shared memory: a safetensors file in /dev/shm the server maps, rewritten in
        place for every version and written once for all the engines of this process (:mod:`areal_local.shm`)."""
        from areal_local.shm import stage

        await self.update_weights_from_disk(str(stage().write(named_tensors, version)), version)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
