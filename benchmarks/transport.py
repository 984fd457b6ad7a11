"""What the embedded engine's HTTP transport costs, against calling its generator in-process.

    .venv/bin/python benchmarks/transport.py [--requests 200] [--concurrency 16]

Same tiny random model (so the model's own time is small and the transport's
share shows), same requests: greedy, 4 prompt tokens, ``--new-tokens`` new
tokens each, ``--concurrency`` in flight. Prints requests/s for the in-process
generator loop and for the real server process over HTTP on 127.0.0.1, the
ratio, and the added latency per request. No pass / fail.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def in_process(model_dir: Path, n: int, concurrency: int, new_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from areal_core.api import SamplingParams
    from areal_local.generator import Generator

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    gen = Generator(model, eos_token_ids=[], max_batch=concurrency)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    began, submitted, done = time.perf_counter(), 0, 0
    while done < n:
        while submitted < n and gen.num_running + gen.num_waiting < concurrency:
            gen.add(f"r{submitted}", [5, 6, 7, submitted % 100 + 10], sampling)
            submitted += 1
        done += len(gen.step())
    return time.perf_counter() - began


def over_http(model_dir: Path, n: int, concurrency: int, new_tokens: int) -> float:
    from areal_core.api import Context, GenerationRequest, SamplingParams
    from areal_core.config.schema import RunConfig
    from areal_core.processes import ProcessSpec, Supervisor, free_port
    from areal_local.engine import LocalEngine, LocalEngineConfig

    config = RunConfig()
    config.model.path, config.model.dtype = str(model_dir), "float32"
    port = free_port()
    recipe = LocalEngine.server_process(Context(config=config, options=LocalEngineConfig(max_batch=concurrency)),
                                        0, port)
    with tempfile.TemporaryDirectory() as logs, Supervisor(Path(logs)) as sup:
        server = sup.start(ProcessSpec("rollout-0", recipe.argv, threads=1))
        sup.wait_ready(server, recipe.ready, 300, recipe.what)

        async def main() -> float:
            engine = LocalEngine.create(Context(config=config, extras={"address": f"127.0.0.1:{port}"}))
            await engine.start()
            gate = asyncio.Semaphore(concurrency)
            sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)

            async def one(i: int) -> None:
                async with gate:
                    await engine.agenerate(GenerationRequest([5, 6, 7, i % 100 + 10], sampling))

            began = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            took = time.perf_counter() - began
            await engine.aclose()
            return took

        return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    from areal_local.models import tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny", max_position_embeddings=256)
        t_local = in_process(model, args.requests, args.concurrency, args.new_tokens)
        t_http = over_http(model, args.requests, args.concurrency, args.new_tokens)
    n = args.requests
    print(f"{n} greedy requests of {args.new_tokens} tokens, {args.concurrency} in flight, tiny model, 1 thread")
    print(f"  generator in-process   {n / t_local:8.1f} requests/s")
    print(f"  server over HTTP       {n / t_http:8.1f} requests/s   ratio {t_local / t_http:.2f}; "
          f"{(t_http - t_local) / n * 1e3:+.2f} ms per request")


if __name__ == "__main__":
    main()
