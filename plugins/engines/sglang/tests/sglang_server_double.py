"""TEST DOUBLE of an SGLang server's native HTTP protocol, for testing the
sglang engine on machines where SGLang cannot serve (no GPU: its CPU kernels
are not on PyPI). It is not SGLang and samples nothing meaningful.

It speaks the documented endpoints with their request and answer shapes:
``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``, ``rid``;
answers ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` as
``[logprob, token_id, null]`` triples and ``finish_reason.type``),
``/pause_generation`` (mode ``abort``), ``/continue_generation``,
``/abort_request``, ``/update_weights_from_disk`` (``model_path``),
``/get_server_info`` (``version``), ``/health``.

Tokens are a deterministic function of (weights folder, context, position),
decoded at ``token_latency_s`` each, so pausing mid-request and continuing
from prompt + partial output gives the uninterrupted run's tokens. Run as
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


def build_app(version: str = "0.5.23", token_latency_s: float = 0.002, eos: int = 2) -> FastAPI:
    app = FastAPI()
    state = {"weights": "initial", "paused": False, "aborted": set(), "running": 0, "requests": 0}
    resumed = asyncio.Event()
    resumed.set()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/get_server_info")
    async def server_info():
        return {"version": version, "weights": state["weights"], "requests": state["requests"]}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not body.get("return_logprob"):
            return JSONResponse({"error": {"message": "the double needs input_ids and return_logprob"}}, 400)
        params = body.get("sampling_params") or {}
        rid = body.get("rid") or f"r{state['requests']}"
        state["requests"] += 1
        await resumed.wait()
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
        state["weights"] = path
        return {"success": True, "message": "Succeeded to update model weights."}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--version", default="0.5.23")
    parser.add_argument("--token-latency-s", type=float, default=0.002)
    args = parser.parse_args()
    uvicorn.run(build_app(args.version, args.token_latency_s), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
