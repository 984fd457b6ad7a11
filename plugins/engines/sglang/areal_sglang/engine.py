"""The ``sglang`` inference engine: a client of one SGLang server's native HTTP API.

What SGLang adds to :class:`areal_core.remote.RemoteEngine`:

- generation through ``/generate`` with ``input_ids``, ``return_logprob``
  (per-token logprobs in ``meta_info.output_token_logprobs``) and the request id
  as ``rid``;
- pause through ``/pause_generation`` (mode ``abort``: in-flight requests end
  with ``finish_reason.type == "abort"`` and their tokens so far, which the
  controller continues), resume through ``/continue_generation``;
- weights from a safetensors folder through ``/update_weights_from_disk``;
  from tensors over a process group (``/init_weights_update_group`` once,
  then per bucket ``/update_weights_from_distributed`` while the trainer
  broadcasts the bucket's tensors; the next bucket is prepared meanwhile);
- the recipe the launcher uses to start a server from its own interpreter.

SGLang serves on GPUs only (its CPU kernels are not on PyPI). This engine is
tested against a test double of that HTTP protocol (tests/sglang_server_double.py);
the version check at start refuses releases outside :data:`SUPPORTED`.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Iterable

from areal_core.api import GenerationRequest, GenerationResponse, ServerProcess
from areal_core.launch.supervisor import free_port
from areal_core.remote import (RemoteEngine, attach_addresses, check_server_version, http_ready, layer_buckets,
                               send_pipelined)
from areal_sglang.weight_group import WeightGroup

SUPPORTED = ">=0.5.0,<0.6"
SUPPORTED_TEXT = "SGLang >=0.5.0,<0.6 (its /pause_generation takes a mode from 0.5)"
PYTHON_ENV = "AREAL_SGLANG_PYTHON"


@dataclass
class SGLangEngineConfig:
    """Keys of ``rollout`` when ``rollout.backend: sglang``."""

    python: str = field(default="", metadata={"help": "interpreter that runs the SGLang servers; '' = "
                        "$AREAL_SGLANG_PYTHON, else the trainer's"})
    startup_timeout_s: float = field(default=900.0, metadata={"gt": 0.0,
                                     "help": "time allowed for a server to load its model"})
    mem_fraction_static: float = field(default=0.8, metadata={"gt": 0.0, "le": 1.0,
                                       "help": "share of GPU memory for weights and KV cache"})
    retries: int = field(default=2, metadata={"ge": 0, "help": "retries of a request after a connection error"})
    addresses: list = field(default_factory=list, metadata={"help": "attach to servers already running (host:port, "
                            "one per d of the allocation) instead of starting them; [] = start them here"})
    extra_args: list = field(default_factory=list, metadata={"help": "more sglang.launch_server arguments"})
    weight_bucket_mb: int = field(default=512, metadata={"ge": 1, "help": "size of the buckets "
                                  "update_weights_from_tensors broadcasts (whole layers), in MiB"})
    weight_group_backend: str = field(default="nccl", metadata={"choices": ["nccl", "gloo"], "help": "process-group "
                                      "backend of tensor weight updates: nccl (GPU servers) or gloo"})
    weight_group_host: str = field(default="127.0.0.1", metadata={"help": "address of the trainer the servers "
                                   "connect to for tensor weight updates (this machine's address when they run "
                                   "elsewhere)"})

    def __post_init__(self) -> None:
        if self.weight_group_backend not in ("nccl", "gloo"):
            raise ValueError(f"rollout.weight_group_backend is {self.weight_group_backend!r}; use 'nccl' (GPU "
                             "servers) or 'gloo'")


def check_version(found: str) -> None:
    """Raise naming the supported range when ``found`` is outside it."""
    check_server_version("SGLang server", found, SUPPORTED, f"areal-plugin-sglang supports {SUPPORTED_TEXT}; "
                         "install a supported release, or point rollout.python at one")


def server_argv(python: str, model: str, port: int, options: SGLangEngineConfig,
                dtype: str = "auto", tensor_parallel: int = 1) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--tp-size", str(tensor_parallel),
            "--mem-fraction-static", str(options.mem_fraction_static), *map(str, options.extra_args)]


_groups = count()  # weight-update group names are unique in this process


class SGLangEngine(RemoteEngine):
    backend = "SGLang server"
    capabilities = frozenset({"pause", "seed", "update_weights_from_disk", "update_weights_from_tensors"})
    config_class = SGLangEngineConfig

    @classmethod
    def server_process(cls, context: Any, index: int, port: int) -> ServerProcess | None:
        config, options = context.config, context.options or SGLangEngineConfig()
        if attach_addresses(options):
            return None  # rollout.addresses: the servers run already; the engines attach to them
        python = options.python or os.environ.get(PYTHON_ENV) or sys.executable
        placement = getattr(context, "placement", None)
        tensor_parallel = getattr(getattr(placement, "parallel", None), "t", 1) or 1
        argv = server_argv(python, config.model.path, port, options, getattr(config.model, "dtype", "auto"),
                           tensor_parallel)
        return ServerProcess(argv, http_ready(port), f"the /health endpoint of SGLang server {index} on 127.0.0.1:{port}",
                             startup_timeout_s=options.startup_timeout_s)

    @classmethod
    def create(cls, context: Any) -> SGLangEngine:
        options = context.options or SGLangEngineConfig()
        placement = getattr(context, "placement", None)
        tensor_parallel = getattr(getattr(placement, "parallel", None), "t", 1) or 1
        return cls.from_context(context, options, weight_bucket_mb=options.weight_bucket_mb,
                                weight_group_backend=options.weight_group_backend,
                                weight_group_host=options.weight_group_host, tensor_parallel=tensor_parallel)

    def __init__(self, context: Any = None, address: str = "", *, weight_bucket_mb: float = 512,
                 weight_group_backend: str = "nccl", weight_group_host: str = "127.0.0.1", tensor_parallel: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(context, address, **kwargs)
        self.server_version = ""
        self.weight_bucket_mb = weight_bucket_mb
        self.weight_group_backend = weight_group_backend
        self.weight_group_host = weight_group_host
        self.tensor_parallel = tensor_parallel
        self._group: WeightGroup | None = None

    async def start(self) -> None:
        await self.wait_ready()
        info = await self.request("GET", "/get_server_info")
        self.server_version = str(info.get("version", ""))
        check_version(self.server_version)

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        s = request.sampling
        sampling: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                                    "top_p": s.top_p, "top_k": s.top_k, "skip_special_tokens": False}
        if s.stop:
            sampling["stop"] = list(s.stop)
        if s.stop_token_ids:
            sampling["stop_token_ids"] = list(s.stop_token_ids)
        if s.seed is not None:
            sampling["sampling_seed"] = s.seed
        version = self._version
        out = await self.request("POST", "/generate", json={
            "input_ids": list(request.input_ids), "sampling_params": sampling, "return_logprob": True,
            "rid": request.rid}, retries=0)
        meta = out.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []  # [[logprob, token_id, text-or-null], ...]
        ids = [int(p[1]) for p in pairs]
        if "output_ids" in out and list(out["output_ids"]) != ids:
            raise RuntimeError(f"the {self.describe()} returned output_ids that differ from the token ids of its "
                               f"logprobs for request {request.rid}")
        finish = (meta.get("finish_reason") or {}).get("type")
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(finish)
        if reason is None:
            raise RuntimeError(f"the {self.describe()} ended request {request.rid} with finish_reason {finish!r}, "
                               "not stop, length or abort")
        return GenerationResponse(request.rid, request.input_ids, ids, [float(p[0]) for p in pairs],
                                  [version] * len(ids), reason)

    async def pause(self) -> None:
        await self.request("POST", "/pause_generation", json={"mode": "abort"})

    async def resume(self) -> None:
        await self.request("POST", "/continue_generation", json={})

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        out = await self.request("POST", "/update_weights_from_disk", json={"model_path": str(path)})
        self._succeeded(out, f"load weights from {path}")
        self._version = version

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Broadcast the tensors to the server's ranks in buckets of whole layers (about ``weight_bucket_mb``).

        Per bucket, ``/update_weights_from_distributed`` names the tensors
        (names, dtypes, shapes) while this process broadcasts them over the
        weight-update group; the next bucket is made contiguous (and moved to
        the GPU for nccl) meanwhile. A failed update drops the group: the next
        update makes a fresh one, since a broadcast cut half-way leaves it
        unusable.
        """
        group = self._group or await self._join_group()
        device = "cuda" if self.weight_group_backend == "nccl" else "cpu"

        def ready(bucket: dict[str, Any]) -> dict[str, Any]:
            return {name: t.to(device).contiguous() for name, t in bucket.items()}

        async def prepare(bucket: dict[str, Any]) -> dict[str, Any]:
            return await asyncio.to_thread(ready, bucket)

        async def send(bucket: dict[str, Any]) -> None:
            body = {"names": list(bucket), "dtypes": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
                    "shapes": [list(t.shape) for t in bucket.values()], "group_name": group.name,
                    "flush_cache": True}
            await self._together(
                self.request("POST", "/update_weights_from_distributed", json=body, retries=0),
                asyncio.to_thread(group.broadcast, list(bucket.values())),
                f"load a weight bucket ({len(bucket)} tensors, the first {body['names'][0]!r})")

        try:
            await send_pipelined(layer_buckets(named_tensors, int(self.weight_bucket_mb * 2**20)), prepare, send)
        except BaseException:
            self._group = None  # never reused after a broadcast that may have stopped half-way
            raise
        self._version = version

    async def _join_group(self) -> WeightGroup:
        """Make the weight-update group with the server (``/init_weights_update_group``), waiting for both sides."""
        group = WeightGroup(f"areal-weights-{os.getpid()}-{next(_groups)}", self.weight_group_host,
                            free_port(self.weight_group_host), 1 + self.tensor_parallel, self.weight_group_backend,
                            self.request_timeout_s)
        await self._together(
            self.request("POST", "/init_weights_update_group", json={
                "master_address": group.host, "master_port": group.port, "rank_offset": 1,
                "world_size": group.world_size, "group_name": group.name, "backend": group.backend}, retries=0),
            asyncio.to_thread(group.connect), f"join weight-update group {group.name!r}")
        self._group = group
        return group

    async def _together(self, answer: Any, work: Any, what: str) -> None:
        """Await a request to the server and the local ``work`` that pairs with it (a broadcast, joining the
        group). A refusal is raised at once: the local side would wait for a server that gave up."""
        answer, work = asyncio.ensure_future(answer), asyncio.ensure_future(work)
        try:
            await asyncio.wait({answer, work}, return_when=asyncio.FIRST_EXCEPTION)
            if answer.done():
                self._succeeded(answer.result(), what)
            await work
            self._succeeded(await answer, what)
        finally:
            answer.cancel()  # when the local side failed first
            # When the server refused first, the local side ends by its own timeout, later: its failure is
            # expected then, and retrieved here so that it is not reported as never retrieved.
            work.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _succeeded(self, out: Any, what: str) -> None:
        if not (isinstance(out, dict) and out.get("success", False)):
            message = out.get("message") if isinstance(out, dict) else out
            raise RuntimeError(f"the {self.describe()} could not {what}: {message}")

    async def aclose(self) -> None:
        if self._group is not None:
            group, self._group = self._group, None
            try:
                await self.request("POST", "/destroy_weights_update_group", json={"group_name": group.name},
                                   retries=0, timeout=30)
            except (ConnectionError, TimeoutError, RuntimeError, ValueError):
                pass  # the server is gone or already forgot the group; nothing to release on its side
            group.close()
        await super().aclose()
