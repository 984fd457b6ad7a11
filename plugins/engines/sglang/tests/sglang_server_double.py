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
``tp_size``; and, for tests only, ``groups``: name -> world size and ranks,
``requests`` received, ``held`` (arrived while paused), ``running`` and
``decoded``, the tokens decoded since start: what a test waits for),
``/health``. A ``world_size`` that does not match the ranks that join fails
the way torch fails: the rendezvous waits, then times out.

``/weights_checker`` (action ``checksum``), as SGLang 0.5.23 answers it
(``http_server.check_weights``, ``utils/weight_checker._compute_checksum``):
``success``, ``message``, and per tensor-parallel rank its ``checksums`` (per
parameter name, ``tensor_hash`` as 16 hex digits), ``per_gpu_checksum`` and
``parallelism_info``. Started with ``--model-path`` (a folder with a Llama-family
``config.json``; its safetensors, if any, are loaded at start as SGLang does), the
double holds the weights IN SGLANG'S LAYOUT, written here from the layer facts
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding`` weight loaders), not from the plugin's mapping: each of
its ``--tp`` ranks holds a ``qkv_proj`` whose q, k, v parts are copied at their
offsets (kv heads replicated when tp exceeds them), a ``gate_up_proj``, its
columns of ``o_proj`` / ``down_proj``, its rows of the vocabulary padded to 64
with zero rows, whole norms; tied embeddings drop ``lm_head.weight``. Weights
are cast to ``--dtype`` (``auto``: the config's, float32 as float16). Without
``--model-path``, or for another architecture, tensors are held as sent. The
hash: ``--hash cpu`` is SGLang's ``tensor_hash`` of a CPU tensor (the first 8
bytes of SHA-256, big-endian); ``--hash gpu`` its CUDA kernel's algorithm (the
double reports device ``cuda`` then), taken from the plugin's numpy port, which
``gpu_hash_vectors.py`` checks against SGLang's real kernel. ``--corrupt``
makes the loader wrong on purpose: ``swap-kv:L`` writes layer L's k at v's
offset and v at k's, ``skip:PREFIX`` leaves every tensor whose name starts with
PREFIX (a bucket) unloaded.

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
import hashlib
import json
import re
import zlib
from pathlib import Path

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


LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class HeldWeights:
    """The parameters each tensor-parallel rank of the server holds (see the module), loaded tensor by tensor."""

    def __init__(self, config: dict, tp: int, dtype: str, corrupt: str = "") -> None:
        import torch

        self.tp, self.corrupt = tp, corrupt
        self.ranks: list[dict] = [{} for _ in range(tp)]
        self.llama = bool(config) and (config.get("architectures") or [""])[0] in LLAMA_FAMILY
        self.config = config
        if dtype == "auto":
            dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
            dtype = "float16" if dtype == "float32" else dtype
        self.dtype = getattr(torch, dtype) if config else None  # no model config: held as sent


    def load(self, name: str, tensor) -> None:
        if self.corrupt.startswith("skip:") and name.startswith(self.corrupt[5:]):
            return
        tensor = tensor if self.dtype is None else tensor.to(self.dtype)
        for rank in range(self.tp):
            if not self.llama:
                self.ranks[rank][name] = tensor.clone()
            else:
                self._load_llama(rank, name, tensor)

    def _load_llama(self, rank: int, name: str, w) -> None:
        import torch

        c, tp, held = self.config, self.tp, self.ranks[rank]
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        qkv = re.match(r"(.+)\.([qkv])_proj\.(weight|bias)$", name)
        gate_up = re.match(r"(.+)\.(gate|up)_proj\.(weight|bias)$", name)
        if qkv:
            q_rows = heads // tp * head_dim
            kv_rows = max(1, kv_heads // tp) * head_dim
            kv_index = rank // (tp // kv_heads) if tp >= kv_heads else rank  # replicated kv heads
            part = qkv.group(2)
            layer = re.search(r"layers\.(\d+)\.", name)
            if self.corrupt == f"swap-kv:{layer.group(1) if layer else ''}" and part in "kv":
                part = "v" if part == "k" else "k"
            offset = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[part]
            rows = q_rows if part == "q" else kv_rows
            index = rank if qkv.group(2) == "q" else kv_index
            key = f"{qkv.group(1)}.qkv_proj.{qkv.group(3)}"
            param = held.setdefault(key, torch.zeros((q_rows + 2 * kv_rows, *w.shape[1:]), dtype=self.dtype))
            param[offset:offset + rows] = w[index * rows:(index + 1) * rows]
        elif gate_up:
            rows = w.shape[0] // tp
            key = f"{gate_up.group(1)}.gate_up_proj.{gate_up.group(3)}"
            param = held.setdefault(key, torch.zeros((2 * rows, *w.shape[1:]), dtype=self.dtype))
            offset = 0 if gate_up.group(2) == "gate" else rows
            param[offset:offset + rows] = w[rank * rows:(rank + 1) * rows]
        elif re.search(r"\.(o_proj|down_proj)\.weight$", name):
            cols = w.shape[1] // tp
            held[name] = w[:, rank * cols:(rank + 1) * cols].clone()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name == "lm_head.weight" and c.get("tie_word_embeddings"):
                return  # SGLang's lm_head is embed_tokens then: the tensor sent is dropped
            vocab, pad = c["vocab_size"], 64
            if ((vocab + pad - 1) // pad * pad) % tp:
                pad *= tp
            per_rank = (vocab + pad - 1) // pad * pad // tp
            param = torch.zeros((per_rank, w.shape[1]), dtype=self.dtype)
            mine = w[rank * per_rank:min((rank + 1) * per_rank, vocab)]
            param[:mine.shape[0]] = mine
            held[name] = param
        else:
            held[name] = w.clone()  # norms, row-parallel biases: whole on every rank

    def checksums(self, hash_kind: str) -> list[dict]:
        """``/weights_checker``'s ``ranks``: each rank's checksums, as SGLang's ``_compute_checksum`` answers."""
        import torch

        if hash_kind == "gpu":
            from areal_sglang.weight_layout import gpu_hash as kernel  # checked against SGLang's kernel
        else:
            def kernel(t) -> int:
                data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                return int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], "big")
        out = []
        for rank, held in enumerate(self.ranks):
            checksums = {name: f"{kernel(t):016x}" for name, t in held.items()}
            overall = hashlib.sha256()
            for name in sorted(checksums):
                overall.update(name.encode())
                overall.update(checksums[name].encode())
            out.append({"checksums": checksums, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": {
                "role": "target", "tp_rank": rank, "tp_size": self.tp, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                "pp_size": 1, "rank": rank, "size": self.tp}})
        return out


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
              group_timeout_s: float = 60.0, model_path: str = "", dtype: str = "auto", hash_kind: str = "cpu",
              corrupt: str = "") -> FastAPI:
    app = FastAPI()
    state = {"weights": "initial", "paused": False, "aborted": set(), "running": 0, "requests": 0,
             "tensors": {}, "groups": {}, "buckets": 0, "held": 0, "decoded": 0}
    config_file = Path(model_path) / "config.json" if model_path else None
    config = json.loads(config_file.read_text()) if config_file and config_file.is_file() else {}
    weights = HeldWeights(config, tp, dtype, corrupt)
    for name, tensor in (load_folder(model_path) or {}).items() if model_path else ():
        weights.load(name, tensor)
    resumed = asyncio.Event()
    resumed.set()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/get_server_info")
    async def server_info():
        return {"version": version, "tp_size": tp, "model_path": model_path, "dtype": dtype,
                "device": "cuda" if hash_kind == "gpu" else "cpu",
                "weights": state["weights"], "requests": state["requests"],
                "buckets": state["buckets"], "held": state["held"], "running": state["running"],
                "decoded": state["decoded"],
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
                state["decoded"] += 1
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
        for name, tensor in state["tensors"].items():
            weights.load(name, tensor)
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
        for name, tensor in received.items():
            weights.load(name, tensor)
        state["weights"] = digest(state["tensors"])
        state["buckets"] += 1
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/weights_checker")
    async def check_weights(request: Request):
        body = await request.json()
        if body.get("action", "checksum") != "checksum":
            return JSONResponse({"success": False, "message": "the double implements action checksum only"}, 400)
        ranks = await asyncio.to_thread(weights.checksums, hash_kind)
        engine = hashlib.sha256()
        for rank in ranks:
            engine.update(rank["per_gpu_checksum"].encode())
        return {"success": True, "message": "", "ranks": ranks, "per_engine_checksum": engine.hexdigest()}

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
    parser.add_argument("--model-path", default="", help="a folder with config.json (and safetensors to load)")
    parser.add_argument("--dtype", default="auto", help="the dtype the weights are held in (SGLang's --dtype)")
    parser.add_argument("--hash", default="cpu", choices=["cpu", "gpu"], help="tensor_hash of a CPU or CUDA tensor")
    parser.add_argument("--corrupt", default="", help="swap-kv:LAYER or skip:PREFIX: a loader bug on purpose")
    args = parser.parse_args()
    uvicorn.run(build_app(args.version, args.token_latency_s, tp=args.tp, group_timeout_s=args.group_timeout_s,
                          model_path=args.model_path, dtype=args.dtype, hash_kind=args.hash, corrupt=args.corrupt),
                host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
