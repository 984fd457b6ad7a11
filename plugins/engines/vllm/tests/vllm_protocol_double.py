"""TEST DOUBLE of the few vLLM server endpoints the engine's start and weight loading use, as an
in-process httpx transport (no server process, no model): ``/health``, ``/version``, ``/v1/models``,
``/collective_rpc`` ``reload_weights`` (and ``areal_extension_version`` when ``extension``: a server started
with areal's worker extension; any other method answers 500, as vLLM does) and ``/v1/completions``
(which records the body and answers one fixed token). It is not vLLM and generates nothing; the real-server
tests (test_vllm_server.py) cover generation.

For each ``reload_weights`` of a bucket folder ``.../bucket-<k>`` it records the tensor names it
holds and whether the next bucket (``bucket-<k+1>/model.safetensors``) appeared while this reload
was still being answered, waiting up to ``next_bucket_wait_s`` (default ``scaled(3)``) for it: how a test sees
that the engine prepares the next bucket while the current one is loaded.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from areal_core.testing import scaled


@dataclass
class Reload:
    folder: Path
    names: list[str]
    next_ready: bool | None  # None: the folder is not a bucket (a disk update)


class VLLMProtocolDouble:
    def __init__(self, version: str = "0.32.0", next_bucket_wait_s: float | None = None,
                 extension: bool = True) -> None:
        self.version = version
        self.extension = extension
        self.next_bucket_wait_s = scaled(3.0) if next_bucket_wait_s is None else next_bucket_wait_s
        self.reloads: list[Reload] = []
        self.completions: list[dict] = []  # the body of each /v1/completions request
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/version":
            return httpx.Response(200, json={"version": self.version})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "double-model", "object": "model"}]})
        if path == "/v1/completions" and request.method == "POST":
            body = json.loads(request.content)  # answered with one token: the double generates nothing real
            self.completions.append(body)
            return httpx.Response(200, json={"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]},
                                                          "finish_reason": "length"}]})
        if path == "/collective_rpc" and request.method == "POST":
            body = json.loads(request.content)
            if body.get("method") == "areal_extension_version" and self.extension:
                return httpx.Response(200, json={"results": ["1"]})
            if body.get("method") != "reload_weights":  # vLLM's answer to a method its workers lack
                return httpx.Response(500, json={"error": {"message": "Call to collective_rpc method failed: Worker "
                                                           f"failed with error ''CPUWorker' object has no attribute "
                                                           f"'{body.get('method')}''"}})
            await self._reload(Path(body["kwargs"]["weights_path"]))
            return httpx.Response(200, json={"results": [None]})
        return httpx.Response(404, json={"detail": "Not Found"})

    async def _reload(self, folder: Path) -> None:
        from safetensors import safe_open

        names = []
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                names += list(f.keys())
        next_ready = None
        if folder.name.startswith("bucket-"):
            following = folder.with_name(f"bucket-{int(folder.name.split('-')[1]) + 1}") / "model.safetensors"
            deadline = time.monotonic() + self.next_bucket_wait_s
            while not following.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            next_ready = following.exists()
        self.reloads.append(Reload(folder, names, next_ready))
