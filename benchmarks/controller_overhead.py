"""How much the rollout controller costs, against running the same episodes bare.

    .venv/bin/python benchmarks/controller_overhead.py [--episodes 20000]

1. Null engine (answers at once): episodes admitted and completed per second
   through the controller (staleness admission, batches handed to a trainer
   thread, weight-update pauses between batches) vs. the same workflow calls
   gathered on a bare asyncio loop. Target: >= 10,000 episodes/s.
2. Realistic latency (each token takes a few ms, lengths vary): wall time
   through the controller vs. a bare loop running the same episodes with the
   same concurrency; the difference is the controller's share of wall time.

No pass / fail: it prints figures and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from areal_core.api import GenerationRequest, GenerationResponse, InferenceEngine, SamplingParams, Trajectory, Workflow
from areal_core.rollout import RolloutController


class NullEngine(InferenceEngine):
    """Answers every request at once with max_new_tokens tokens, or after ``latency(request)`` seconds."""

    capabilities = frozenset({"pause", "update_weights_from_disk"})

    def __init__(self, per_token_s: float = 0.0) -> None:
        super().__init__()
        self.per_token_s = per_token_s
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def agenerate(self, request):
        n = request.sampling.max_new_tokens
        if self.per_token_s:
            await asyncio.sleep(self.per_token_s * n)
        return GenerationResponse(request.rid, request.input_ids, [7] * n, [-1.0] * n, [self._version] * n, "length")

    async def pause(self):
        pass

    async def resume(self):
        pass

    async def update_weights_from_disk(self, path, version):
        self._version = version


class OneShotWorkflow(Workflow):
    async def arun_episode(self, engine, item):
        r = await engine.agenerate(GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=item["length"]),
                                                     rid=str(item["id"])))
        return [Trajectory([1, 2, 3] + r.output_ids, [0, 0, 0] + [1] * len(r.output_ids),
                           [0.0] * 3 + r.output_logprobs, [-1] * 3 + r.output_versions, 1.0)]


def data(n: int, seed: int = 0, max_length: int = 4) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": i, "length": rng.randint(1, max_length)} for i in range(n)]


def through_controller(engine: NullEngine, items: list[dict], batch_size: int, eta: int, concurrency: int) -> float:
    began = time.perf_counter()
    with RolloutController([engine], OneShotWorkflow(), batch_size=batch_size, max_head_offpolicyness=eta,
                           max_concurrent_rollouts=concurrency) as ctrl:
        for step in range(len(items) // batch_size):
            ctrl.prepare_batch(items, timeout=600)
            ctrl.update_weights_from_disk("/dev/null", step + 1)
    return time.perf_counter() - began


def bare(engine: NullEngine, items: list[dict], concurrency: int) -> float:
    async def main() -> None:
        workflow, gate = OneShotWorkflow(), asyncio.Semaphore(concurrency)

        async def one(item):
            async with gate:
                await workflow.arun_episode(engine, item)

        await asyncio.gather(*(one(item) for item in items))

    began = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--eta", type=int, default=4)
    args = parser.parse_args()

    items = data(args.episodes)
    print(f"1) null engine, {args.episodes} episodes, batch {args.batch_size}, eta {args.eta}")
    t_bare = bare(NullEngine(), items, concurrency=1024)
    t_ctrl = through_controller(NullEngine(), items, args.batch_size, args.eta, concurrency=1024)
    print(f"   bare asyncio loop   {args.episodes / t_bare:>10,.0f} episodes/s")
    print(f"   rollout controller  {args.episodes / t_ctrl:>10,.0f} episodes/s   "
          f"(target >= 10,000; {t_bare / t_ctrl:.2f}x the bare loop's rate)")

    n, per_token = 2000, 0.002
    items = data(n, seed=1, max_length=16)
    print(f"2) realistic latency: {n} episodes of 1-16 tokens at {per_token * 1e3:.0f} ms/token, 64 in flight")
    t_bare = bare(NullEngine(per_token), items, concurrency=64)
    t_ctrl = through_controller(NullEngine(per_token), items, batch_size=64, eta=args.eta, concurrency=64)
    print(f"   bare asyncio loop   {t_bare:6.2f} s")
    print(f"   rollout controller  {t_ctrl:6.2f} s   (ratio {t_ctrl / t_bare:.3f}; controller share of wall "
          f"time {max(0.0, t_ctrl - t_bare) / t_ctrl:.1%}, including {n // 64} weight-update pauses)")


if __name__ == "__main__":
    main()
