"""The embedded engine's server process: ``python -m areal_local.server --model DIR --port N``.

One process per inference server of the allocation. An engine thread owns
the :class:`~areal_local.generator.Generator` and runs decode steps; the HTTP
side (FastAPI on 127.0.0.1) only queues commands for it, so everything that
touches the model happens between two decode steps of one thread:

- ``POST /generate``: token ids in, token ids out, each with its behaviour
  logprob and the policy version that sampled it.
- ``POST /pause``: every request in flight returns what it has with
  ``stop_reason="abort"``; requests arriving while paused return at once,
  empty, with ``abort``. ``POST /resume`` lifts it.
- ``POST /update_weights_from_disk`` (safetensors folder, version, adopt): applied
  between steps; with ``adopt`` and a ``/dev/shm`` stage slot the model serves
  from the slot's mapping instead of copying it (:mod:`areal_local.shm`).
  Requests still running (an update without a pause) are
  stopped, their KV cache dropped, and continued from prompt + output so far
  under the new weights, so their versions change exactly at the swap. A
  seeded request keeps its seed and its random stream goes on (the generator
  keys each draw by the token's position), so its draws after the swap are
  independent of those before.
  ``update_weights_from_tensors`` on the client hands tensors over through
  shared memory (a safetensors folder in /dev/shm) and uses the same route.
- ``POST /update_weights_from_delta`` (folder, base_version, version): the same
  swap for a delta (:mod:`areal_core.weight_delta`: tensors whole, and the
  changed elements of others as flat indices + values); refused with 409,
  nothing changed, when the server does not hold ``base_version``.
- ``GET /weight_digest?mode=on|sample``: the version and, per tensor name, the
  digest (:func:`areal_core.weight_check.tensor_digest`) of the weights the
  model holds now (the integrity gate, ``rollout.weight_check``), taken on a
  digest thread of the server's own: begun by the last load when its request
  named the mode (``digest``; the client does once the gate has asked), as
  soon as the new weights are in place, else when asked. The load answers
  without waiting for it, so generation may resume while it runs (the
  controller's ``rollout.weight_check_holds: training``); nothing writes the
  weights meanwhile (the next load waits for it). The model's own tensors are
  hashed: the copies derived from them for speed (oneDNN-packed linears, the
  lean decoder's fused projections) are checked by the parity probe.
- ``GET /health``: version, running / waiting counts, the tokens each
  unanswered request has produced so far (``progress``: rid -> tokens), paused, the last load's
  phases, whether the derived copies are being rebuilt (``rebuilding``), and
  the last parity probe admitted (``last_probe``: its rid, version, and
  whether it ran on the derived copies, ``derived_live``).
"""


# No "from __future__ import annotations": FastAPI reads the request models from the
# annotations of routes defined inside build_app, which must be real classes.
import argparse
import asyncio
import concurrent.futures
import contextlib
import faulthandler
import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from areal_core.api.inference import SamplingParams
from areal_core.server_guard import DEFAULT_MAX_BODY_BYTES
from areal_core.threads import serial_torch, torch_threads
from areal_core.weight_check import PROBE_RID_PREFIX

log = logging.getLogger("areal.local.server")


@dataclass
class Pending:
    """A request the server owes an answer, with everything it produced so far."""

    rid: str
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def extend(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.output_ids += ids
        self.logprobs += logprobs
        self.versions += [version] * len(ids)

    def answer(self, stop_reason: str) -> None:
        result = {"rid": self.rid, "output_ids": self.output_ids, "output_logprobs": self.logprobs,
                  "output_versions": self.versions, "stop_reason": stop_reason}
        self.loop.call_soon_threadsafe(_set, self.future, result)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.future, exc)


def _set(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


# A weight load is memory copies (into the parameters, then the packed / fused copies): on one thread, which
# the kernel cannot leave waiting for a descheduled second one (areal_core.threads.torch_threads).
# SmolLM2-135M float32 on the 2-core test machine under load 7-9 (benchmarks/weight_sync.py): the load took
# 3.9-4.2 s on the engine thread's two threads, 0.27-0.40 s on one.
LOAD_THREADS = 1
# ... and the derived copies after it (packed / fused weights) on this many Python threads of one torch thread
# each (Generator's load_workers): no OpenMP team, so no barrier waits for a core the trainer holds.
LOAD_WORKERS = 2
# With --rebuild background (the default; rollout.rebuild_in_background), Generator's defer_derived: a load returns
# once the new weights are in place (and digested when the gate asks), generation resumes on them at once, and
# the copies are rebuilt on one load worker and put in use once done. The parity probe waits for them (_add), so
# it checks what the engine serves from then on. benchmarks/weight_sync.py, SmolLM2-135M float32, idle 2-core
# machine: the load 0.21 -> 0.06 s, the whole path to the first token 0.33 -> 0.25 s.


class DeltaBaseError(Exception):
    """A delta whose base is not the version this server holds (answered 409: the client sends the full weights)."""


class EngineLoop:
    """The one thread that touches the model. Commands arrive through a queue."""

    def __init__(self, generator: Any, load_weights: Any, threads: int | None = None,
                 load_threads: int = LOAD_THREADS) -> None:
        """``threads``: torch threads of the engine thread (None: the process's count when it starts);
        ``load_threads``: its torch threads while it copies new weights in (see LOAD_THREADS)."""
        self.gen = generator
        self.load_weights = load_weights
        self.threads = threads
        self.load_threads = load_threads
        # the load workers a background rebuild of the derived copies holds (Generator.background_workers)
        self.background_workers = getattr(generator, "background_workers", 0)
        self.version = 0
        self.paused = False
        self.pending: dict[str, Pending] = {}
        self.last_load_s = 0.0  # the last weight update on this thread: read, copy into the model, derived copies
        # The digests of the weights held, on a thread of their own (the load answers without waiting for them):
        # (mode, future) of those taken since the last load, and the last one begun, which every load waits for
        # before it changes the weights it reads.
        self.digested: tuple[str, concurrent.futures.Future] | None = None
        self._digesting: concurrent.futures.Future | None = None
        self._digest_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="areal-digest",
                                                                   initializer=serial_torch)
        self.commands: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        # The last parity probe admitted: its rid, the version it ran on, and whether the derived copies were in
        # use (they must be: the probe checks what the server serves from then on)
        self.last_probe: dict | None = None
        self.thread = threading.Thread(target=self._run, name="areal-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # -- called from the HTTP loop ---------------------------------------
    def call(self, name: str, *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.commands.put((name, args, future, loop))
        return future

    def health(self) -> dict:
        return {"status": "ok" if self.error is None else "error", "version": self.version,
                "running": self.gen.num_running, "waiting": self.gen.num_waiting, "paused": self.paused,
                "progress": self.progress(),
                "threads": self.threads, "last_load_s": self.last_load_s,
                "last_load_phases": self._load_phases(),
                "digested_during_load": None if self.digested is None else self.digested[0],
                "rebuilding": getattr(self.gen, "rebuilding", False),
                "last_probe": self.last_probe,
                "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}"}

    def progress(self) -> dict[str, int]:
        """Tokens each unanswered request has produced so far, by rid: those kept across a weight update (already
        carrying their version) plus those of its current run in the generator. A snapshot read off the HTTP
        thread while the engine thread steps: copies, never the live containers."""
        running = self.gen.progress() if hasattr(self.gen, "progress") else {}
        return {rid: len(p.output_ids) + running.get(rid, 0) for rid, p in list(self.pending.items())}

    def _load_phases(self) -> dict:
        """The last load's phases (Generator.load_phases), with ``derived_background``: the derived copies'
        rebuild after the load returned, once it has ended (defer_derived)."""
        phases = dict(getattr(self.gen, "load_phases", {}))
        background = getattr(self.gen, "background_rebuild_s", None)
        if background is not None:
            phases["derived_background"] = background
        return phases

    # -- the engine thread -------------------------------------------------
    def _run(self) -> None:
        import torch

        if self.threads is not None:  # main() keeps the HTTP thread serial and gives the cores to this one
            torch.set_num_threads(self.threads)
        self.threads = torch.get_num_threads()  # what generation runs on, for /health
        try:
            with torch_threads(self.load_threads):
                self.gen.warm_weight_loads()  # on the thread that loads, as loads do (see warm_weight_loads)
            while True:
                busy = self.gen.num_running or self.gen.num_waiting
                try:  # idle: block until a command arrives; busy: only take what is queued
                    command = self.commands.get_nowait() if busy else self.commands.get()
                except queue.Empty:
                    command = None
                while command is not None:
                    self._apply(*command)
                    try:
                        command = self.commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self.gen.num_running or self.gen.num_waiting:
                    # While a load worker rebuilds the derived copies, a step leaves it its core: an OpenMP team
                    # of every core would wait at each barrier for the one it holds (one thread on 2 cores).
                    with (torch_threads(max(1, self.threads - self.background_workers))
                          if getattr(self.gen, "rebuilding", False) else contextlib.nullcontext()):
                        for done in self.gen.step():
                            self._finish(done)
        except BaseException as exc:  # the process must not hang with requests waiting forever
            self.error = exc
            traceback.print_exc()
            for pending in self.pending.values():
                pending.fail(RuntimeError(f"the engine thread crashed: {type(exc).__name__}: {exc}"))
            raise

    def _finish(self, done: Any) -> None:
        pending = self.pending.pop(done.rid)
        pending.extend(done.output_ids, done.logprobs, self.version)
        pending.answer(done.stop_reason)

    def _reply(self, future: asyncio.Future, loop: asyncio.AbstractEventLoop, value: Any) -> None:
        loop.call_soon_threadsafe(_set, future, value)

    def _apply(self, name: str, args: tuple, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if name == "generate":
                self._add(*args, future=future, loop=loop)
                return
            if name == "pause":
                self.paused = True
                for done in self.gen.abort_all():
                    self._finish(done)
            elif name == "resume":
                self.paused = False
            elif name == "update":
                self._update_from(*args)
            elif name == "delta":
                self._delta(*args)
            elif name == "digest":
                self._answer_digest(*args, future=future, loop=loop)
                return
            else:
                raise ValueError(f"unknown command {name!r}")
            self._reply(future, loop, self.health())
        except Exception as exc:
            loop.call_soon_threadsafe(_set_exception, future, exc)

    def _add(self, rid: str, input_ids: list[int], sampling: SamplingParams, *, future, loop) -> None:
        pending = Pending(rid, list(input_ids), sampling, future, loop)
        if self.paused:
            pending.answer("abort")
            return
        if rid in self.pending:
            pending.fail(ValueError(f"request {rid}: a request with this id is already running"))
            return
        probe = rid.startswith(PROBE_RID_PREFIX)
        if probe and hasattr(self.gen, "settle"):
            self.gen.settle()  # the probe's tokens come from the packed copies the engine serves from from now on
        self.gen.add(rid, list(input_ids), sampling)  # RequestError: the caller sees it as a 400
        if probe:
            self.last_probe = {"rid": rid, "version": self.version,
                               "derived_live": bool(getattr(self.gen, "derived_live", True))}
        self.pending[rid] = pending

    def _update_from(self, path: str, version: int, adopt: bool = False, digest: str | None = None) -> None:
        options: dict[str, Any] = {}
        if adopt:
            options["adopt"] = True
        beside = self._digest_beside(digest)
        if beside is not None:
            options["beside"] = beside
        self._update(path, version, (lambda: self.load_weights(path, version, **options)) if options else None)

    def _delta(self, path: str, base_version: int, version: int, digest: str | None = None) -> None:
        if base_version != self.version:
            raise DeltaBaseError(f"the server holds version {self.version}; the delta is from version {base_version}")
        beside = self._digest_beside(digest)
        self._update(path, version, lambda: self.gen.load_delta_dir(path, base_version, version, beside=beside))

    def _digest_beside(self, mode: str | None) -> Any:
        """For a load whose client will ask for the digests in ``mode``: begin them on the digest thread once the
        new weights are in place (beside the rebuild of the derived copies); the load does not wait for them."""
        if mode not in ("on", "sample"):
            return None

        def digest() -> None:
            self._begin_digest(mode)

        return digest

    def _begin_digest(self, mode: str) -> concurrent.futures.Future:
        self._digesting = self._digest_pool.submit(self._digest_now, mode)
        self.digested = (mode, self._digesting)
        return self._digesting

    def _answer_digest(self, mode: str, *, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        """Reply to ``GET /weight_digest`` once the digests of the weights held now are taken (those begun by the
        last load when it was asked for this mode: nothing writes the weights between loads, and every load
        drops them first), without holding this thread meanwhile."""
        version = self.version
        pending = self.digested[1] if self.digested is not None and self.digested[0] == mode else None
        if pending is None or (pending.done() and pending.exception() is not None):  # none yet, or it failed
            pending = self._begin_digest(mode)

        def answer(done: concurrent.futures.Future) -> None:
            if done.exception() is not None:
                loop.call_soon_threadsafe(_set_exception, future, done.exception())
            else:
                self._reply(future, loop, {"version": version, "digests": done.result()})

        pending.add_done_callback(answer)

    def _update(self, path: str, version: int, load: Any = None) -> None:
        if version < self.version:  # checked here, on the engine thread, where loads are applied one at a time
            raise ValueError(f"version {version} is older than version {self.version}, which this server serves; "
                             f"a run's versions only grow")
        # The last digests begun read the weights this load replaces (their failure went to the asker); the digest
        # thread is one, so every digest begun before them has ended too.
        if self._digesting is not None:
            concurrent.futures.wait([self._digesting])
        began = time.monotonic()
        self.digested = None  # begun by this load (_digest_beside), or when asked afterwards
        interrupted = []
        for done in self.gen.abort_all():  # nothing runs on stale KV after the swap
            pending = self.pending[done.rid]
            pending.extend(done.output_ids, done.logprobs, self.version)
            interrupted.append(pending)
        with torch_threads(self.load_threads):
            try:
                if load is None:
                    self.load_weights(path, version)
                else:
                    load()
            except BaseException:
                self.digested = None
                raise
        self.version = version
        for pending in interrupted:
            left = pending.sampling.max_new_tokens - len(pending.output_ids)
            if left <= 0:
                self.pending.pop(pending.rid)
                pending.answer("length")
                continue
            # The same seed continues the stream: the generator keys a seeded draw by the token's position in
            # prompt + output, so the continuation's i-th token draws what the uninterrupted request's
            # (len(output_ids) + i)-th would have, never a replay of the first draws.
            self.gen.add(pending.rid, pending.prompt + pending.output_ids,
                         replace(pending.sampling, max_new_tokens=left))
        self.last_load_s = time.monotonic() - began
        log.info("weights v%d from %s in %.3f s (%d requests continued)", version, path, self.last_load_s,
                 len(interrupted))


    def _digest_now(self, mode: str) -> dict[str, str]:
        """Digests of the weights the model holds (its state dict, in HF names); on the digest thread."""
        from areal_core.weight_check import digest_named

        # on every core but the one a background rebuild takes (xxhash releases the GIL): one thread on 2 cores
        workers = max(1, (self.threads or 1) - self.background_workers)
        return digest_named(self.gen.model.state_dict().items(), mode, workers=workers)


def _torch_threads() -> int:
    """The calling thread's torch thread count."""
    import torch

    return torch.get_num_threads()


def build_app(engine: EngineLoop, *, token: str | None = None, host: str = "127.0.0.1",
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, load_roots: tuple[str, ...] = ()) -> Any:
    """The server's routes behind :class:`areal_core.server_guard.RunGuard` (the run's secret, the bound host,
    no request from a web page, bodies up to ``max_body_bytes``). With ``load_roots``, the weight routes load
    only folders under one of them (the run folder) or the weight stages this user's trainer writes in /dev/shm."""
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, Field

    from areal_core.server_guard import RunGuard
    from areal_local.generator import RequestError

    app = FastAPI(title="areal embedded inference engine")

    from areal_local import shm

    def loadable(path: str, version: int) -> None:
        """Refuse (HTTP 400/403) a version below 0 and a folder outside the run's own places."""
        if version < 0:
            raise HTTPException(400, f"version {version} is negative; versions count weight updates from 0")
        if load_roots and not may_load(path, load_roots):
            raise HTTPException(403, f"{path} is neither under the run folder ({', '.join(load_roots)}) nor a "
                                     f"weight stage of this user's trainer in {shm.stage_root()}; this server loads "
                                     f"weights only from there")

    class Sampling(BaseModel):
        max_new_tokens: int = 256
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = -1
        stop: list[str] = Field(default_factory=list)
        stop_token_ids: list[int] = Field(default_factory=list)
        seed: int | None = None

    class Generate(BaseModel):
        rid: str
        input_ids: list[int]
        sampling: Sampling = Field(default_factory=Sampling)

    class Update(BaseModel):
        path: str
        version: int
        adopt: bool = False  # serve from a /dev/shm stage slot as it is (areal_local.shm's rule), no copy
        digest: str | None = None  # the integrity gate will ask for the digests in this mode: take them during the load

    @app.get("/health")
    async def health() -> dict:
        if engine.error is not None:
            raise HTTPException(503, engine.health()["error"])
        return {**engine.health(), "http_threads": _torch_threads()}

    @app.post("/generate")
    async def generate(body: Generate) -> dict:
        s = body.sampling
        sampling = SamplingParams(s.max_new_tokens, s.temperature, s.top_p, s.top_k, tuple(s.stop),
                                  tuple(s.stop_token_ids), s.seed)
        try:
            return await engine.call("generate", body.rid, body.input_ids, sampling)
        except (RequestError, ValueError) as exc:
            raise HTTPException(400, str(exc)) from None

    @app.post("/pause")
    async def pause() -> dict:
        return await engine.call("pause")

    @app.post("/resume")
    async def resume() -> dict:
        return await engine.call("resume")

    @app.get("/weight_digest")
    async def weight_digest(mode: str = "on") -> dict:
        if mode not in ("on", "sample"):
            raise HTTPException(400, f"mode {mode!r}: choose 'on' or 'sample'")
        return await engine.call("digest", mode)

    class Delta(BaseModel):
        path: str
        base_version: int
        version: int
        digest: str | None = None

    @app.post("/update_weights_from_delta")
    async def update_delta(body: Delta) -> dict:
        loadable(body.path, body.version)
        try:
            return await engine.call("delta", body.path, body.base_version, body.version, body.digest)
        except DeltaBaseError as exc:
            raise HTTPException(409, f"delta refused: {exc}") from None
        except (OSError, ValueError, KeyError) as exc:
            raise HTTPException(400, f"cannot apply the delta in {body.path}: {type(exc).__name__}: {exc}") from None

    @app.post("/update_weights_from_disk")
    async def update(body: Update) -> dict:
        loadable(body.path, body.version)
        try:
            return await engine.call("update", body.path, body.version, body.adopt, body.digest)
        except (OSError, ValueError, KeyError) as exc:
            raise HTTPException(400, f"cannot load weights from {body.path}: {type(exc).__name__}: {exc}") from None

    return RunGuard(app, token=token, bound_host=host, max_body_bytes=max_body_bytes)


def may_load(path: str, roots: tuple[str, ...]) -> bool:
    """Whether ``path`` (links resolved) is under one of ``roots``, or is a weight stage or delta folder in the
    shared-memory stage root (:mod:`areal_local.shm`'s names) owned by this server's user."""
    from areal_core.server_guard import may_load as guard_may_load
    from areal_local import shm

    return guard_may_load(path, roots, str(shm.stage_root()), (shm.PREFIX, shm.DELTA_PREFIX))


def own_memory(model: Any) -> int:
    """Give every parameter and buffer of ``model`` memory of its own; the bytes copied.

    Why: ``from_pretrained`` in the file's dtype leaves the tensors as views of a private (copy-on-write)
    mapping of ``model.safetensors``, so the first weight update wrote every page of the file's mapping and
    took a copy-on-write fault for each: on the 2-core test machine the first load of SmolLM2-135M in
    float32 copied in 3.2 s, the next ones in 0.04 s (``/proc/self/maps`` showed the file mapped ``rw-p``).
    Copying once here moves that cost to the server's start, off the first training step's critical path,
    and lets the file's mapping go.
    """
    import torch

    copied = 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:  # a tied weight is one Parameter: copied once
            tensor.data = tensor.data.clone()
            copied += tensor.numel() * tensor.element_size()
    return copied


def load_engine(model_path: str, dtype: str, max_batch: int, threads: int | None = None,
                rebuild_in_background: bool = True) -> EngineLoop:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_local.generator import Generator

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, attn_implementation="sdpa").eval()
    own_memory(model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos = model.generation_config.eos_token_id
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                      *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    generator = Generator(model, eos_token_ids=eos_ids, max_batch=max_batch, load_workers=LOAD_WORKERS,
                          defer_derived=rebuild_in_background,
                          decode_fn=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    return EngineLoop(generator, generator.load_safetensors_dir, threads)


KEEP_ALIVE_S = 120  # seconds an idle HTTP connection stays open on the server; see main()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m areal_local.server", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model folder, or 'demo' for SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="the largest request body taken, in MiB (larger ones: HTTP 413)")
    parser.add_argument("--run-dir", action="append", default=[],
                        help="load weights only from under this folder (repeatable) or this user's /dev/shm stages")
    parser.add_argument("--rebuild", default="background", choices=["background", "foreground"],
                        help="when the packed copies of new weights are rebuilt: while generation resumes on the "
                             "weights themselves, or before it resumes")
    args = parser.parse_args(argv)
    # A native crash (a signal in a torch kernel) leaves its stack in the log the launcher reports.
    faulthandler.enable()
    from areal_core.allocator import retain_freed_memory

    print(f"areal_local.server: {retain_freed_memory()}", file=sys.stderr, flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from areal_core.config.dtype import resolve_dtype

    args.dtype = resolve_dtype(args.dtype)
    model = args.model
    if model == "demo":
        from areal_local.models import demo_model_path

        model = str(demo_model_path(args.dtype))
    else:  # a folder as it is; a hub id downloaded into the Hugging Face cache (areal_core.hub)
        from areal_core.models import resolve_model_path

        model = str(resolve_model_path(model, args.dtype))
    # Only the engine thread may run torch on several cores: a second multi-threaded OpenMP team (this
    # thread's, had it loaded the model at full width) throttles every kernel of the first (areal_core.threads).
    import torch

    from areal_core.threads import serial_torch

    threads = torch.get_num_threads()
    serial_torch()
    began = time.monotonic()
    engine = load_engine(model, args.dtype, args.max_batch, threads, rebuild_in_background=args.rebuild == "background")
    log.info("loaded %s (%s) in %.1f s", model, args.dtype, time.monotonic() - began)
    # The engine thread runs Python between torch ops; with the default 5 ms GIL switch
    # interval every HTTP request waited up to 5 ms for the event loop to get a turn
    # (benchmarks/transport.py on a tiny model: 146 -> 218 requests/s).
    sys.setswitchinterval(0.0002)
    engine.start()
    import uvicorn

    # Keep idle connections far longer than clients pool them (httpx: 5 s). With uvicorn's default of 5 s
    # both sides timed out together: the client reused a connection the server was closing, and a demo run
    # died with "ReadError" on /generate from a healthy server (a known httpx / uvicorn keep-alive race).
    from areal_core.server_guard import RUN_TOKEN_ENV, run_token

    token = run_token()
    if token is None:
        log.warning("no %s in the environment: any local process may drive this server (areal run gives each "
                    "run a secret; see docs/security.md)", RUN_TOKEN_ENV)
    app = build_app(engine, token=token, host=args.host, max_body_bytes=int(args.max_request_mb * 2**20),
                    load_roots=tuple(args.run_dir))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
