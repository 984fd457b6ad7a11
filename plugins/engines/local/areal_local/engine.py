"""The ``local`` inference engine as the rollout controller sees it: a client
of one embedded server process (see :mod:`areal_local.server`) over HTTP on
127.0.0.1, and the recipe the launcher uses to start that server."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from areal_core.api import GenerationRequest, GenerationResponse, ServerProcess
from areal_core.remote import RemoteEngine, finite_logprobs, http_ready, run_log_path
from areal_core.server_guard import run_load_roots


@dataclass
class LocalEngineConfig:
    """Keys of ``rollout`` when ``rollout.backend: local``."""

    max_batch: int = field(default=64, metadata={"ge": 1, "help": "requests decoded together per server"})
    startup_timeout_s: float = field(default=600.0, metadata={"gt": 0.0,
                                     "help": "time allowed for a server to load its model"})
    rebuild_in_background: bool = field(default=True, metadata={
        "help": "after a weight update, generation resumes on the new weights while the server rebuilds its "
                "packed copies of them on a load worker, then moves onto those (the parity probe waits for "
                "them); false: the rebuild ends before generation resumes"})


def _model_arg(config: Any) -> str:
    """What the server loads: the demo model by name, anything else as given (the server resolves a hub id into
    the Hugging Face cache itself, on the node it runs on)."""
    return config.model.path or "demo"


class LocalEngine(RemoteEngine):
    """The client of one embedded server, on the HTTP client every remote engine shares
    (:class:`areal_core.remote.RemoteEngine`: timeouts naming the wait, retries on connection errors where a
    call may run twice, keep-alive shorter than the server's, errors quoting the server's log)."""

    capabilities = frozenset({"pause", "seed", "update_weights_from_disk", "update_weights_from_tensors",
                              "update_weights_from_delta", "weight_digest"})
    config_class = LocalEngineConfig

    @classmethod
    def server_process(cls, context: Any, index: int, port: int) -> ServerProcess:
        config, options = context.config, context.options or LocalEngineConfig()
        host = context.extras.get("host") or "127.0.0.1"  # a cluster launcher gives the node's own address
        argv = [sys.executable, "-m", "areal_local.server", "--model", _model_arg(config),
                "--dtype", config.model.dtype, "--host", host, "--port", str(port),
                "--max-batch", str(options.max_batch),
                "--rebuild", "background" if options.rebuild_in_background else "foreground",
                "--max-request-mb", f"{config.rollout.max_request_mb:g}",
                # weights load only from the run's folder (and this user's /dev/shm stages)
                *(f"--run-dir={root}" for root in run_load_roots(config))]
        return ServerProcess(argv, http_ready(port, host=host), f"the /health endpoint of embedded engine {index} "
                             f"on {host}:{port}", startup_timeout_s=options.startup_timeout_s)

    @classmethod
    def create(cls, context: Any) -> LocalEngine:
        address = context.extras.get("address")
        if not address:
            raise ValueError("the local inference engine needs its server's address (context.extras['address']); "
                             "it is set by the launcher, which starts the server from server_process()")
        return cls(context, address)

    def __init__(self, context: Any, address: str, timeout_s: float = 600.0) -> None:
        options = context.options or LocalEngineConfig()
        self.index = context.extras.get("server_index", 0)
        rollout = getattr(context.config, "rollout", None)
        super().__init__(context, address, request_timeout_s=getattr(rollout, "request_timeout_s", timeout_s),
                         startup_timeout_s=options.startup_timeout_s,
                         log_path=context.extras.get("log_path") or run_log_path(context.config, self.index))
        self.backend = f"embedded engine {self.index}"
        # Weights in memory reach a server on the trainer's node through /dev/shm; one on another node reads
        # them from a file in the run's shared storage instead (the launcher checked every node sees it).
        self.same_node = context.extras.get("same_node", True)
        # The mode the integrity gate last asked the digests in: later loads ask the server to take them during
        # the load, beside the rebuild of its derived copies (areal_local.server's "digest")
        self._digest_mode: str | None = None
        self.exchange_dir = context.extras.get("exchange_dir")

    async def start(self) -> None:
        """Take the version the server serves. The launcher waited for it to start, so a server that does not
        answer now has failed: a ConnectionError naming it and quoting its log, not a wait."""
        self._version = (await self.request("GET", "/health", timeout=10.0))["version"]

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        s = request.sampling
        # Not retried: a generation that reached the server before the connection broke must not run twice.
        out = await self.request("POST", "/generate", retries=0, json={
            "rid": request.rid, "input_ids": list(request.input_ids),
            "sampling": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                         "top_k": s.top_k, "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids),
                         "seed": s.seed}})
        versions = out["output_versions"]
        logprobs = finite_logprobs(self.describe(), request.rid, out["output_ids"], out["output_logprobs"],
                                   versions[-1] if versions else self._version)
        return GenerationResponse(request.rid, request.input_ids, out["output_ids"], logprobs, versions,
                                  out["stop_reason"])

    async def pause(self) -> None:
        await self.request("POST", "/pause")

    async def resume(self) -> None:
        await self.request("POST", "/resume")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._load(path, version, adopt=False)

    async def _load(self, path: str, version: int, adopt: bool) -> None:
        health = await self.request("POST", "/update_weights_from_disk", json={
            "path": str(path), "version": version, "adopt": adopt, "digest": self._digest_mode})
        self._version = health["version"]

    async def weight_digest(self, mode: str = "on") -> dict[str, str]:
        """The server's digests of the weights its model holds (``GET /weight_digest``, on its engine thread)."""
        self._digest_mode = mode
        return (await self.request("GET", "/weight_digest", params={"mode": mode}))["digests"]

    def weight_transport(self, weight_sync: str) -> str:
        if weight_sync == "disk":
            return "disk_folder"
        return "shared_memory" if self.same_node or not self.exchange_dir else "shared_storage_file"

    def export_destination(self, version: int) -> Any:
        """On the trainer's node: the free slot of this process's /dev/shm stage (:meth:`areal_local.shm.WeightStage.
        destination`), so the trainer's export is the stage write; None elsewhere and before the first write."""
        from areal_local.shm import stage

        return stage().destination(version) if self.weight_transport("tensors") == "shared_memory" else None

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Hand tensors over through shared memory: a safetensors file in /dev/shm the server maps and serves from
        (no copy), one of two rewritten in place in turn and written once for all the engines of this process
        (:mod:`areal_local.shm`). A server on another node gets the same file in the run's shared storage
        (``exchange_dir``) and copies it in: a mapping of a network file system is no place to serve from."""
        from areal_local.shm import stage

        shared_memory = self.weight_transport("tensors") == "shared_memory"
        root = None if shared_memory else Path(self.exchange_dir)
        await self._load(str(stage(root).write(named_tensors, version)), version, adopt=shared_memory)


    async def update_weights_from_delta(self, delta: Any, version: int) -> None:
        """Hand a delta over (:mod:`areal_core.weight_delta`) as a safetensors file in shared memory (or the run's
        shared storage), written fresh per version: its size changes with every delta. The server applies it
        only on exactly ``delta.base_version`` (HTTP 409 otherwise: DeltaBaseMismatch, then a full update)."""
        import shutil
        import tempfile

        from safetensors.torch import save_file

        from areal_core.remote import RemoteError
        from areal_core.weight_delta import DeltaBaseMismatch, delta_to_named
        from areal_local.shm import DELTA_PREFIX

        if delta.base_version != self._version:
            raise DeltaBaseMismatch(f"the {self.describe()} holds version {self._version}; the delta is from "
                                    f"{delta.base_version}")
        if self.weight_transport("tensors") == "shared_memory":
            root = "/dev/shm" if Path("/dev/shm").is_dir() else None
        else:
            root = str(self.exchange_dir)
            Path(root).mkdir(parents=True, exist_ok=True)
        # named by this process, so a trainer killed mid-update leaves nothing the next stage does not sweep
        folder = Path(tempfile.mkdtemp(prefix=f"{DELTA_PREFIX}{os.getpid()}-", dir=root))
        try:
            save_file({name: t.detach().contiguous().cpu() for name, t in delta_to_named(delta)},
                      str(folder / "model.safetensors"))
            try:
                health = await self.request("POST", "/update_weights_from_delta", json={
                    "path": str(folder), "base_version": delta.base_version, "version": version,
                    "digest": self._digest_mode})
            except RemoteError as exc:
                if "HTTP 409" in str(exc):
                    raise DeltaBaseMismatch(str(exc)) from None
                raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._version = health["version"]
