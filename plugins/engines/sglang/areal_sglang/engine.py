"""The ``sglang`` inference engine: a client of one SGLang server's native HTTP API.

What SGLang adds to :class:`areal_core.remote.RemoteEngine`:

- generation through ``/generate`` with ``input_ids``, ``return_logprob``
  (per-token logprobs in ``meta_info.output_token_logprobs``) and the request id
  as ``rid``;
- pause through ``/pause_generation`` (mode ``abort``: in-flight requests end
  with ``finish_reason.type == "abort"`` and their tokens so far, which the
  controller continues), resume through ``/continue_generation``;
- weights from a safetensors folder through ``/update_weights_from_disk``;
- the recipe the launcher uses to start a server from its own interpreter.

SGLang serves on GPUs only (its CPU kernels are not on PyPI). This engine is
tested against a test double of that HTTP protocol (tests/sglang_server_double.py);
the version check at start refuses releases outside :data:`SUPPORTED`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from areal_core.api import GenerationRequest, GenerationResponse, ServerProcess
from areal_core.remote import RemoteEngine, check_server_version, http_ready

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
    extra_args: list = field(default_factory=list, metadata={"help": "more sglang.launch_server arguments"})


def check_version(found: str) -> None:
    """Raise naming the supported range when ``found`` is outside it."""
    check_server_version("SGLang server", found, SUPPORTED, f"areal-plugin-sglang supports {SUPPORTED_TEXT}; "
                         "install a supported release, or point rollout.python at one")


def server_argv(python: str, model: str, port: int, options: SGLangEngineConfig,
                dtype: str = "auto", tensor_parallel: int = 1) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--tp-size", str(tensor_parallel),
            "--mem-fraction-static", str(options.mem_fraction_static), *map(str, options.extra_args)]


class SGLangEngine(RemoteEngine):
    backend = "SGLang server"
    capabilities = frozenset({"pause", "seed", "update_weights_from_disk"})
    config_class = SGLangEngineConfig

    @classmethod
    def server_process(cls, context: Any, index: int, port: int) -> ServerProcess:
        config, options = context.config, context.options or SGLangEngineConfig()
        python = options.python or os.environ.get(PYTHON_ENV) or sys.executable
        placement = getattr(context, "placement", None)
        tensor_parallel = getattr(getattr(placement, "parallel", None), "t", 1) or 1
        argv = server_argv(python, config.model.path, port, options, getattr(config.model, "dtype", "auto"),
                           tensor_parallel)
        return ServerProcess(argv, http_ready(port), f"the /health endpoint of SGLang server {index} on 127.0.0.1:{port}",
                             startup_timeout_s=options.startup_timeout_s)

    @classmethod
    def create(cls, context: Any) -> SGLangEngine:
        return cls.from_context(context, context.options or SGLangEngineConfig())

    def __init__(self, context: Any = None, address: str = "", **kwargs: Any) -> None:
        super().__init__(context, address, **kwargs)
        self.server_version = ""

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
        if not out.get("success", False):
            raise RuntimeError(f"the {self.describe()} could not load weights from {path}: {out.get('message')}")
        self._version = version
