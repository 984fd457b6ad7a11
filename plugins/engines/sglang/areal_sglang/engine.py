"""The ``sglang`` inference engine: a client of one SGLang server's native HTTP API.

What SGLang adds to :class:`areal_core.remote.RemoteEngine`:

- generation through ``/generate`` with ``input_ids``, ``return_logprob``
  (per-token logprobs in ``meta_info.output_token_logprobs``) and the request id
  as ``rid``;
- pause through ``/pause_generation`` (mode ``abort``: in-flight requests end
  with ``finish_reason.type == "abort"`` and their tokens so far, which the
  controller continues), resume through ``/continue_generation`` after cutting
  off the requests SGLang held while paused (see :meth:`SGLangEngine.resume`);
- weights from a safetensors folder through ``/update_weights_from_disk``;
  from tensors over ONE process group shared by every routed server
  (:class:`areal_core.rollout.weight_group.FleetWeightGroup`: the trainer is
  rank 0, each server's ``t`` workers join at their ``rank_offset``; rebuilt at
  every topology version): this engine only makes the HTTP calls
  (``/init_weights_update_group``, per bucket ``/update_weights_from_distributed``
  while the trainer broadcasts, ``/destroy_weights_update_group``);
- the integrity gate's digests (``weight_digest``): SGLang's own
  ``/weights_checker`` (action ``checksum``) hashes every tensor each rank holds,
  in SGLang's layout; :meth:`SGLangEngine.sent_digests` computes on the trainer
  what it will report from the tensors sent (:mod:`areal_sglang.weight_layout`);
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
from pathlib import Path
from typing import Any, Iterable

from areal_core import server_guard
from areal_core.api import GenerationRequest, GenerationResponse, ServerProcess
from areal_core.remote import RemoteEngine, attach_addresses, check_server_version, finite_logprobs, http_ready
from areal_core.rollout.elastic import Member
from areal_core.processes.nodes import NODE_ADDRESS_ENV
from areal_core.rollout.weight_group import FleetWeightGroup, GroupLayout, GroupMemberFailed

SUPPORTED = ">=0.5.0,<0.6"
# areal's launcher of SGLang (the run's secret and guard): a standalone module the server's interpreter imports
SERVER_PATH = Path(__file__).resolve().parent / "server_path"
LAUNCHER = "areal_sglang_launch"
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


def server_python(chosen: str = "") -> str:
    """The interpreter servers run under: ``chosen`` (``rollout.python``), else $AREAL_SGLANG_PYTHON, else this
    Python."""
    return chosen or os.environ.get(PYTHON_ENV) or sys.executable


def server_argv(python: str, model: str, port: int, options: SGLangEngineConfig,
                dtype: str = "auto", tensor_parallel: int = 1, host: str = "127.0.0.1") -> list[str]:
    """The command of one SGLang server: SGLang's own launcher, run by ``areal_sglang_launch`` (importable
    from :data:`SERVER_PATH`, see :func:`server_env`), which gives it the run's secret without putting it on
    the command line and puts the run's guard in front of it."""
    return [python, "-m", LAUNCHER, "--model-path", model, "--host", host,
            "--port", str(port), "--dtype", dtype, "--tp-size", str(tensor_parallel),
            "--mem-fraction-static", str(options.mem_fraction_static), *map(str, options.extra_args)]


def server_env(host: str = "127.0.0.1", max_request_mb: float = server_guard.DEFAULT_MAX_BODY_BYTES / 2**20,
               load_roots: Iterable[str] = ()) -> dict[str, str]:
    """The environment :func:`server_argv` needs beside this process's own: the launcher on ``PYTHONPATH``
    (first), the guard's file, the bound host, the body cap and where weights may load from (``load_roots``,
    the run folder; none given: from anywhere). The run's secret reaches the server as every process of the
    run gets it, in the environment it inherits (``AREAL_RUN_TOKEN``)."""
    paths = [str(SERVER_PATH), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths), "AREAL_SERVER_GUARD_FILE": server_guard.__file__,
            "AREAL_SERVER_HOST": host, "AREAL_SERVER_MAX_BODY_BYTES": str(int(max_request_mb * 2**20)),
            "AREAL_SERVER_LOAD_ROOTS": os.pathsep.join(map(str, load_roots))}


def _group_host(options: SGLangEngineConfig) -> str:
    """Where the servers reach the trainer for tensor updates: the option, or, left at its default under a
    cluster launcher, the trainer's node address (``AREAL_NODE_ADDRESS``)."""
    if options.weight_group_host == "127.0.0.1":
        return os.environ.get(NODE_ADDRESS_ENV) or options.weight_group_host
    return options.weight_group_host


class SGLangEngine(RemoteEngine):
    backend = "SGLang server"
    capabilities = frozenset({"pause", "seed", "update_weights_from_disk", "update_weights_from_tensors",
                              "weight_digest"})
    config_class = SGLangEngineConfig

    @classmethod
    def server_process(cls, context: Any, index: int, port: int) -> ServerProcess | None:
        config, options = context.config, context.options or SGLangEngineConfig()
        if attach_addresses(options):
            return None  # rollout.addresses: the servers run already; the engines attach to them
        python = server_python(options.python)
        placement = getattr(context, "placement", None)
        tensor_parallel = getattr(getattr(placement, "parallel", None), "t", 1) or 1
        host = context.extras.get("host") or "127.0.0.1"  # a cluster launcher gives the node's address
        # a hub id goes to SGLang as it is (it downloads into the inherited Hugging Face cache, on its node)
        argv = server_argv(python, config.model.path, port, options, getattr(config.model, "dtype", "auto"),
                           tensor_parallel, host)
        env = server_env(host, config.rollout.max_request_mb, server_guard.run_load_roots(config))
        return ServerProcess(argv, http_ready(port, host=host), f"the /health endpoint of SGLang server {index} on "
                             f"{host}:{port}", env=env, startup_timeout_s=options.startup_timeout_s)

    @classmethod
    def create(cls, context: Any) -> SGLangEngine:
        options = context.options or SGLangEngineConfig()
        placement = getattr(context, "placement", None)
        tensor_parallel = getattr(getattr(placement, "parallel", None), "t", 1) or 1
        return cls.from_context(context, options, weight_bucket_mb=options.weight_bucket_mb,
                                weight_group_backend=options.weight_group_backend,
                                weight_group_host=_group_host(options), tensor_parallel=tensor_parallel,
                                model_path=getattr(getattr(context.config, "model", None), "path", "") or "")

    def __init__(self, context: Any = None, address: str = "", *, weight_bucket_mb: float = 512,
                 weight_group_backend: str = "nccl", weight_group_host: str = "127.0.0.1", tensor_parallel: int = 1,
                 model_path: str = "", **kwargs: Any) -> None:
        super().__init__(context, address, **kwargs)
        self.model_path = model_path  # the model the server was started from: its config.json gives the layout
        self._server_info: dict = {}
        self.server_version = ""
        self.weight_bucket_mb = weight_bucket_mb
        self.weight_group_backend = weight_group_backend
        self.weight_group_host = weight_group_host
        self.tensor_parallel = tensor_parallel
        self._server_tp: int | None = None  # the server's own tp_size (/get_server_info), once started
        self._own_group: FleetWeightGroup | None = None  # this engine alone, for calls outside a controller
        self._own_member: Member | None = None
        self._generating: set[asyncio.Future] = set()  # /generate calls not answered yet
        self._dropped: set[asyncio.Future] = set()  # of those, the ones resume() cut off (see resume)
        self._paused = False

    async def start(self) -> None:
        await self.wait_ready()
        info = await self.request("GET", "/get_server_info")
        self.server_version = str(info.get("version", ""))
        check_version(self.server_version)
        tp = info.get("tp_size")
        self._server_tp = int(tp) if isinstance(tp, int) and tp >= 1 else None
        self._server_info = info

    # -------------------------------------------------------------- the integrity gate
    def _hash_kind(self) -> str:
        """SGLang hashes a CUDA tensor with its triton kernel, any other on the CPU with SHA-256."""
        return "gpu" if str(self._server_info.get("device", "cuda")).startswith("cuda") else "sha256-8"

    def sent_digests(self, weights: str | list, mode: str = "on") -> dict[str, str]:
        """What this server's ``/weights_checker`` reports once ``weights`` (a folder's path, or (name, tensor)
        pairs) are loaded: the tensors laid out and hashed as SGLang does (:mod:`areal_sglang.weight_layout`),
        for its ``tp_size``, dtype and device (``/get_server_info``) and the model's ``config.json`` (``model.path``,
        else the server's ``model_path``, else the folder's). ``mode`` changes nothing: SGLang hashes every byte.
        The tensors that have no place in the layout are marked not checkable here, with why (the server cannot
        name tensors it never placed): the controller's check skips them and the run log names them."""
        from areal_core.weight_check import NOT_CHECKABLE, check_mode

        from areal_sglang.weight_layout import expected_checksums, folder_tensors, read_config, server_dtype

        check_mode(mode)
        folder = weights if isinstance(weights, (str, os.PathLike)) else None
        config = next((c for c in (read_config(p) for p in (self.model_path, self._server_info.get("model_path"),
                                                               folder) if p) if c), {})
        named = folder_tensors(folder) if folder is not None else weights
        tp = self._server_tp or self.tensor_parallel
        dtype = server_dtype(str(self._server_info.get("dtype", "auto")), config)
        expected, unmapped = expected_checksums(named, config, tp, dtype, self._hash_kind())
        return {**expected, **{name: f"{NOT_CHECKABLE}: {why}" for name, why in unmapped.items()}}

    async def weight_digest(self, mode: str = "on") -> dict[str, str]:
        """Per tensor, the checksum SGLang's ``/weights_checker`` (action ``checksum``) reports, each of its
        ranks hashing what it holds in its own layout; named as SGLang names it, ``@tp<rank>`` appended on a
        server of several ranks, as :meth:`sent_digests` names them. SGLang hashes every byte whatever ``mode``
        (``sample`` included). A name two ranks of one tp rank (data or pipeline parallel copies) report with
        different checksums gets both, which fails the check."""
        from areal_core.remote import RemoteError
        from areal_core.weight_check import check_mode

        check_mode(mode)
        try:
            out = await self.request("POST", "/weights_checker", json={"action": "checksum", "selector": "target"},
                                     retries=0)
        except RemoteError as missing:
            if "HTTP 404" not in str(missing):
                raise
            raise RuntimeError(f"the {self.describe()} has no /weights_checker endpoint (SGLang {self.server_version}"
                               "): its weights cannot be checked by digest. Use an SGLang release that has it "
                               "(0.5.23 does), or rollout.weight_check=off") from None
        if not (isinstance(out, dict) and out.get("success", False) and isinstance(out.get("ranks"), list)):
            message = out.get("message") if isinstance(out, dict) else out
            raise RuntimeError(f"the {self.describe()} could not compute the checksums of its weights "
                               f"(/weights_checker action checksum): {message}")
        kind, seen = self._hash_kind(), {}
        for rank in out["ranks"]:
            info = rank.get("parallelism_info") or {}
            tp, tp_rank = int(info.get("tp_size", 1)), int(info.get("tp_rank", 0))
            for name, value in (rank.get("checksums") or {}).items():
                key = name if tp == 1 else f"{name}@tp{tp_rank}"
                seen.setdefault(key, {})[int(info.get("rank", tp_rank))] = f"{kind}:{value}"
        held = {key: values.popitem()[1] if len(set(values.values())) == 1 else
                ", ".join(f"rank {r} {v}" for r, v in sorted(values.items())) for key, values in seen.items()}
        return held

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
        call = asyncio.ensure_future(self.request("POST", "/generate", json={
            "input_ids": list(request.input_ids), "sampling_params": sampling, "return_logprob": True,
            "rid": request.rid}, retries=0))
        self._generating.add(call)
        try:
            out = await call
        except asyncio.CancelledError:
            if call not in self._dropped:
                raise  # the caller itself was cancelled
            # cut off by resume(): nothing generated that may be trusted; the controller continues it
            return GenerationResponse(request.rid, request.input_ids, [], [], [], "abort")
        finally:
            self._generating.discard(call)
            self._dropped.discard(call)
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
        return GenerationResponse(request.rid, request.input_ids, ids,
                                  finite_logprobs(self.describe(), request.rid, ids, [p[0] for p in pairs], version),
                                  [version] * len(ids), reason)

    async def pause(self) -> None:
        self._paused = True
        await self.request("POST", "/pause_generation", json={"mode": "abort"})

    async def resume(self) -> None:
        """``/continue_generation``, after cutting off every /generate call still unanswered.

        SGLang holds a request that reaches it while paused (its tokenizer
        manager's ``generate_request`` waits on ``is_pause_cond`` until
        ``continue_generation``) and then runs it under the new weights, while
        this client would stamp its tokens with the version it was sent at.
        ``/abort_request`` cannot reach it (it is not in the scheduler yet), so
        the client drops the HTTP call instead: it comes back as an empty
        ``abort`` and the controller continues it at the new version. SGLang
        aborts a request whose client has gone. Any call still unanswered now
        was sent before this resume, and mode ``abort`` ended everything that
        was running, so only such held calls (or an abort answer still in
        transit, whose tokens are simply generated again) are cut off.
        """
        if self._paused:
            for call in list(self._generating):
                self._dropped.add(call)
                call.cancel()
        await self.request("POST", "/continue_generation", json={})
        self._paused = False

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        out = await self.request("POST", "/update_weights_from_disk", json={"model_path": str(path)})
        self._succeeded(out, f"load weights from {path}")
        self._version = version

    # -------------------------------------------------------------- weights over a process group
    @classmethod
    def fleet_weight_group(cls, engines: list[SGLangEngine]) -> FleetWeightGroup:
        """The rollout controller's hook: one weight-update group for all of ``engines`` (every routed SGLang
        server), rank 0 on this machine, rebuilt by the controller at each topology version."""
        first = engines[0]
        return FleetWeightGroup(host=first.weight_group_host, backend=first.weight_group_backend,
                                bucket_bytes=int(first.weight_bucket_mb * 2**20), timeout_s=first.request_timeout_s)

    @property
    def weight_group_ranks(self) -> int:
        """The ranks this server joins a weight-update group with: its tensor-parallel workers."""
        return self._server_tp or self.tensor_parallel

    def weight_transport(self, weight_sync: str) -> str:
        return "disk_folder" if weight_sync == "disk" else "process_group"

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Broadcast the tensors to this server alone, in buckets of whole layers (about ``weight_bucket_mb``).

        Under a rollout controller every routed server shares one group
        instead (:meth:`fleet_weight_group`); this call keeps a group of its
        own (1 + t ranks), made at the first call and destroyed at
        :meth:`aclose` or after a failed update.
        """
        if self._own_group is None:
            self._own_group = type(self).fleet_weight_group([self])
            self._own_member = Member(self, self.address)
        try:
            await self._own_group.update([self._own_member], 0, named_tensors, version)
        except GroupMemberFailed as failed:
            raise failed.cause from None  # the one member is this engine: its own error names the server

    async def join_weight_group(self, layout: GroupLayout, rank_offset: int) -> None:
        out = await self.request("POST", "/init_weights_update_group", json={
            "master_address": layout.host, "master_port": layout.port, "rank_offset": rank_offset,
            "world_size": layout.world_size, "group_name": layout.name, "backend": layout.backend}, retries=0)
        self._succeeded(out, f"join weight-update group {layout.name!r}")

    async def receive_weight_bucket(self, layout: GroupLayout, names: list[str], dtypes: list[str],
                                    shapes: list[list[int]]) -> None:
        out = await self.request("POST", "/update_weights_from_distributed", json={
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": layout.name, "flush_cache": True},
            retries=0)
        self._succeeded(out, f"load a weight bucket ({len(names)} tensors, the first {names[0]!r}) over "
                             f"{layout.name!r}")

    async def leave_weight_group(self, layout: GroupLayout) -> None:
        out = await self.request("POST", "/destroy_weights_update_group", json={"group_name": layout.name},
                                 retries=0, timeout=30)
        self._succeeded(out, f"destroy weight-update group {layout.name!r}")

    def _succeeded(self, out: Any, what: str) -> None:
        if not (isinstance(out, dict) and out.get("success", False)):
            message = out.get("message") if isinstance(out, dict) else out
            raise RuntimeError(f"the {self.describe()} could not {what}: {message}")

    async def aclose(self) -> None:
        if self._own_group is not None:
            group, self._own_group = self._own_group, None
            await group.drop([self._own_member])
        await super().aclose()
