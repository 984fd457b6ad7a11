"""TEST DOUBLE of an SGLang server's native HTTP protocol, for testing the
sglang engine on machines where SGLang cannot serve (no GPU: its CPU kernels
are not on PyPI). It is not SGLang and samples nothing meaningful.

It speaks the documented endpoints with their request and answer shapes:
``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``, ``rid``;
answers ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` as
``[logprob, token_id, null]`` triples and ``finish_reason.type``),
``/pause_generation`` (mode ``abort``), ``/continue_generation``,
``/abort_request``, ``/update_weights_from_disk`` (``model_path``),
``/init_weights_update_group`` (``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``group_name``, ``backend``: its ``--tp``
workers join a real torch.distributed gloo group as ranks ``rank_offset`` ..
``rank_offset + tp - 1``, as SGLang's ``ModelRunner.init_weights_update_group``
computes ``rank = rank_offset + tp_rank``; a name it holds already is refused,
as SGLang does: "group ... already exists"),
``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
``group_name``: every rank receives each tensor by broadcast from rank 0; a
group name it does not hold is refused),
``/destroy_weights_update_group``, ``/get_server_info`` (``version``,
``tp_size``; and, for tests only, ``groups``: name -> world size and ranks),
``/health``. A ``world_size`` that does not match the ranks that join fails
the way torch fails: the rendezvous waits, then times out.

Pause as SGLang does it (``TokenizerManager.pause_generation`` /
``generate_request`` in ``python/sglang/srt/managers/tokenizer_manager.py``):
mode ``abort`` aborts what is running and waits until nothing runs; a
``/generate`` that arrives while paused is HELD (``generate_request`` waits on
``is_pause_cond`` until ``continue_generation``) and then runs under whatever
weights are loaded by then. A held request whose client has gone is aborted
when it is let through (SGLang notices disconnected clients while it waits
for a request's output).

Tokens are a deterministic function of (weights, context, position),
decoded at ``token_latency_s`` each, so pausing mid-request and continuing
from prompt + partial output gives the uninterrupted run's tokens. The
weights are named by the path given to ``/update_weights_from_disk``, or,
once tensors are loaded (from a folder of safetensors or over the group), by
a digest of every tensor's name, dtype, shape and bytes: the same tensors
give the same tokens however they arrived. Run as
``python sglang_server_double.py --port N [--version V]``.
"""

from __future__ import annotations

import argparse
import asyncio
import zlib

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def token_at(weights: str, context: list[int], position: int) -> int:
    return zlib.crc32(f"{weights}:{context[-1] if context else 0}:{position}".encode()) % 900 + 50


def digest(tensors: dict) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return "tensors:" + h.hexdigest()[:16]


def load_folder(path: str) -> dict | None:
    """The tensors of the safetensors files in folder ``path``; None when it holds none."""
    from pathlib import Path

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    from safetensors.torch import load_file

    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def join_group(body: dict, tp: int, timeout_s: float) -> list:
    """The server's ``tp`` ranks joined to the group (one thread each: a rank's rendezvous waits for all)."""
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    world, offset = int(body["world_size"]), int(body["rank_offset"])

    def join(rank: int):
        store = dist.TCPStore(body["master_address"], int(body["master_port"]), world, is_master=False,
                              timeout=timeout)
        return rank, store, dist.ProcessGroupGloo(dist.PrefixStore(body["group_name"], store), rank, world, timeout)

    with ThreadPoolExecutor(tp) as pool:
        return list(pool.map(join, range(offset, offset + tp)))


def receive(ranks: list, names: list, dtypes: list, shapes: list) -> dict:
    """Every rank receives every tensor (a real server keeps its shard; the double keeps rank 0's copy and
    checks that the ranks agree)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist

    def on(rank) -> dict:
        tensors = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            options = dist.BroadcastOptions()
            options.rootRank = 0
            rank[2].broadcast([tensor], options).wait()
            tensors[name] = tensor
        return tensors

    with ThreadPoolExecutor(len(ranks)) as pool:
        copies = list(pool.map(on, ranks))
    if any(digest(c) != digest(copies[0]) for c in copies[1:]):
        raise RuntimeError("the server's ranks received different tensors")
    return copies[0]


def build_app(version: str = "0.5.23", token_latency_s: float = 0.002, eos: int = 2, tp: int = 1,
              group_timeout_s: float = 60.0) -> FastAPI:
    app = FastAPI()
    state = {"weights": "initial", "paused": False, "aborted": set(), "running": 0, "requests": 0,
             "tensors": {}, "groups": {}, "buckets": 0, "held": 0}
    resumed = asyncio.Event()
    resumed.set()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/get_server_info")
    async def server_info():
        return {"version": version, "tp_size": tp, "weights": state["weights"], "requests": state["requests"],
                "buckets": state["buckets"], "held": state["held"],
                "groups": {name: {"world_size": world, "ranks": [r[0] for r in ranks]}
                           for name, (world, ranks) in state["groups"].items()}}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not body.get("return_logprob"):
            return JSONResponse({"error": {"message": "the double needs input_ids and return_logprob"}}, 400)
        params = body.get("sampling_params") or {}
        rid = body.get("rid") or f"r{state['requests']}"
        state["requests"] += 1
        if not resumed.is_set():  # held until /continue_generation, as SGLang's is_pause_cond does
            state["held"] += 1
            await resumed.wait()
            if await request.is_disconnected():
                return JSONResponse({"error": {"message": "client disconnected"}}, 499)
        out: list[int] = []
        finish: dict = {"type": "length", "length": params.get("max_new_tokens", 16)}
        state["running"] += 1
        try:
            for _ in range(int(params.get("max_new_tokens", 16))):
                await asyncio.sleep(token_latency_s)
                if state["paused"] or rid in state["aborted"]:
                    finish = {"type": "abort", "message": "Abort before completion"}
                    break
                token = token_at(state["weights"], ids + out, len(ids) + len(out))
                out.append(token)
                if token in (params.get("stop_token_ids") or []):
                    finish = {"type": "stop", "matched": token}
                    break
        finally:
            state["running"] -= 1
            state["aborted"].discard(rid)
        logprobs = [[-0.25 - (t % 7) / 10, t, None] for t in out]
        return {"text": "", "output_ids": out, "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
            "output_token_logprobs": logprobs}}

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await request.json()
        if body.get("mode", "abort") != "abort":
            return JSONResponse({"error": {"message": "the double implements mode abort only"}}, 400)
        state["paused"] = True
        resumed.clear()
        while state["running"]:
            await asyncio.sleep(0.001)
        return {}

    @app.post("/continue_generation")
    async def resume():
        state["paused"] = False
        resumed.set()
        return {}

    @app.post("/abort_request")
    async def abort(request: Request):
        body = await request.json()
        state["aborted"].add(body.get("rid"))
        return {}

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        body = await request.json()
        path = body.get("model_path")
        if not path:
            return {"success": False, "message": "model_path is required"}
        tensors = await asyncio.to_thread(load_folder, path)
        state["tensors"] = tensors or {}
        state["weights"] = digest(tensors) if tensors else path
        return {"success": True, "message": "Succeeded to update model weights."}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await request.json()
        if body.get("backend", "nccl") != "gloo":
            return {"success": False, "message": f"the double joins gloo groups only, not {body.get('backend')!r}"}
        if body.get("group_name") in state["groups"]:
            return {"success": False, "message": f"Failed to init process group: group {body['group_name']!r} "
                    "already exists"}
        try:
            ranks = await asyncio.to_thread(join_group, body, tp, group_timeout_s)
            state["groups"][body["group_name"]] = (int(body["world_size"]), ranks)
        except Exception as exc:
            return {"success": False, "message": f"Failed to init process group: {type(exc).__name__}: {exc}"}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_distributed(request: Request):
        body = await request.json()
        joined = state["groups"].get(body.get("group_name"))
        if joined is None:
            return {"success": False, "message": f"no weights update group named {body.get('group_name')!r}"}
        try:
            received = await asyncio.to_thread(receive, joined[1], body["names"], body["dtypes"], body["shapes"])
        except Exception as exc:
            return {"success": False, "message": f"Failed to update parameter online: {type(exc).__name__}: {exc}"}
        state["tensors"] = {**state["tensors"], **received}
        state["weights"] = digest(state["tensors"])
        state["buckets"] += 1
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        body = await request.json()
        if state["groups"].pop(body.get("group_name"), None) is None:
            return {"success": False, "message": f"no weights update group named {body.get('group_name')!r}"}
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--version", default="0.5.23")
    parser.add_argument("--token-latency-s", type=float, default=0.002)
    parser.add_argument("--tp", type=int, default=1, help="ranks the double joins a weight-update group with")
    parser.add_argument("--group-timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    uvicorn.run(build_app(args.version, args.token_latency_s, tp=args.tp, group_timeout_s=args.group_timeout_s),
                host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
