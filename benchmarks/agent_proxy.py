"""What the agent workflow's OpenAI-compatible proxy costs, against calling the rollout controller's engine directly.

    .venv/bin/python benchmarks/agent_proxy.py [--calls 1000] [--sessions 2000] [--skip-embedded]
    .venv/bin/python benchmarks/agent_proxy.py --calls 200 --null-ms-per-token 10 --skip-sessions --skip-embedded

1. Null engine (answers at once), through a RolloutController:
   a. per call: one episode making ``--calls`` sequential calls, directly
      (``engine.agenerate`` on prompt ids tokenized once) and through the proxy
      (an in-process agent: chat template, HTTP, recording), once with the
      official ``openai`` client and once with plain ``httpx``; the difference
      is the proxy's absolute cost per call (with the httpx agent, the least
      client cost in it).
   b. sessions per second: ``--sessions`` episodes of one call each, 64 in
      flight, each its own session (key, recording, trajectory), the agent
      using one shared ``httpx`` client with 8 connections (httpcore's pool
      costs O(connections x queued requests) per request, so more connections
      measure the client, not the proxy) or a fresh ``openai`` client per
      session (what a typical agent pays). Agents, proxy and controller share
      this one process (and its GIL), as in-process agents do.
2. Embedded engine (``areal_local``, SmolLM2-135M-Instruct, float32, on CPU):
   ``--calls`` short calls (``--tokens`` new tokens each, greedy, so every
   call of both arms generates the same tokens) of one user message, one at a
   time, direct and through the proxy in alternating blocks of 50 so both arms
   see the same machine load; the proxy's share is the difference in time per
   call. Target: under 5 % added per call.

No pass / fail: it prints figures and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from areal_core.api import Context, GenerationRequest, Trajectory, Workflow
from areal_core.config.schema import RunConfig
from areal_core.rollout import RolloutController
from areal_agent.config import AgentConfig
from areal_agent.workflow import AgentWorkflow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controller_overhead import NullEngine  # noqa: E402  (a sibling benchmark's engine double)

MESSAGES = [{"role": "user", "content": "Count on: 1, 2, 3,"}]
TIMES: dict[str, list[float]] = {"direct": [], "proxy": []}
TOKENS: dict[str, int] = {"direct": 0, "proxy": 0}
BENCH = sys.modules[__name__]
sys.modules["agent_proxy_bench"] = BENCH


async def openai_agent(item: dict, base_url: str, api_key: str) -> float:
    """Makes item['calls'] sequential chat calls with the official client, timing each."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600) as client:
        for _ in range(item["calls"]):
            began = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=MESSAGES)
            TIMES["proxy"].append(time.perf_counter() - began)
            TOKENS["proxy"] += reply.usage.completion_tokens
    return 1.0


async def httpx_sequential_agent(item: dict, base_url: str, api_key: str) -> float:
    """The same calls over plain httpx: the proxy's cost without the openai client's own."""
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(item["calls"]):
            began = time.perf_counter()
            r = await client.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                                  json={"model": "policy", "messages": MESSAGES})
            TIMES["proxy"].append(time.perf_counter() - began)
            TOKENS["proxy"] += r.json()["usage"]["completion_tokens"]
    return 1.0


SHARED: dict[str, Any] = {}


async def httpx_agent(item: dict, base_url: str, api_key: str) -> float:
    client = SHARED.get("client")
    if client is None:
        client = SHARED["client"] = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=8))
    r = await client.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                          json={"model": "policy", "messages": MESSAGES})
    r.raise_for_status()
    return 1.0


async def fresh_openai_agent(item: dict, base_url: str, api_key: str) -> float:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600) as client:
        await client.chat.completions.create(model="policy", messages=MESSAGES)
    return 1.0


class BenchWorkflow(Workflow):
    """``item['arm']`` = ``direct``: ``item['calls']`` sequential engine calls on the same prompt ids as the proxy
    sends; ``proxy``: the agent workflow's episode."""

    def __init__(self, agent_flow: AgentWorkflow) -> None:
        super().__init__()
        self.agent_flow = agent_flow
        self.prompt_ids = agent_flow.proxy.chat.full(MESSAGES, None)

    async def arun_episode(self, engine: Any, item: Any) -> list[Trajectory] | None:
        if item["arm"] != "direct":
            return await self.agent_flow.arun_episode(engine, item)
        for _ in range(item["calls"]):
            began = time.perf_counter()
            r = await engine.agenerate(GenerationRequest(list(self.prompt_ids), self.agent_flow.proxy.params(
                _Defaults(), 0)))
            TIMES["direct"].append(time.perf_counter() - began)
            TOKENS["direct"] += len(r.output_ids)
        n = len(self.prompt_ids)
        return [Trajectory(list(self.prompt_ids) + r.output_ids, [0] * n + [1] * len(r.output_ids),
                           [0.0] * n + r.output_logprobs, [-1] * n + r.output_versions, 1.0)]


class _Defaults:
    """A request body with nothing set: the proxy's sampling from rollout.sampling alone."""

    max_tokens = max_completion_tokens = temperature = top_p = stop = seed = None


def agent_flow(model_dir: str, agent: str, tokens: int, calls: int, temperature: float = 1.0) -> AgentWorkflow:
    config = RunConfig()
    config.model.path, config.model.dtype = model_dir, "float32"
    config.rollout.sampling.max_new_tokens, config.rollout.group_size = tokens, 1
    config.rollout.sampling.temperature = temperature
    # an episode is a block of up to ``calls`` calls: at 60 s a call it is stopped only if something hangs (the
    # default 600 s stopped a block of 50 short calls on a machine running other work at load 7)
    return AgentWorkflow(Context(config=config, options=AgentConfig(agent=agent, max_calls=calls + 1,
                                                                    agent_timeout_s=60.0 * (calls + 1),
                                                                    proxy_loop=PROXY_LOOP[0])))


PROXY_LOOP = ["episodes"]  # workflow.proxy_loop (--proxy-loop)
CPU: dict[str, float] = {"direct": 0.0, "proxy": 0.0}  # this process's CPU seconds (every thread) per arm


def run_blocks(ctrl: RolloutController, calls: int, block: int) -> None:
    for b in range(max(1, calls // block)):
        for arm in (("direct", "proxy") if b % 2 == 0 else ("proxy", "direct")):
            began = time.process_time()
            ctrl.submit({"id": f"{arm}-{b}", "arm": arm, "calls": block})
            ctrl.wait(1, timeout=3600)
            CPU[arm] += time.process_time() - began


def reset() -> None:
    TIMES["direct"].clear(), TIMES["proxy"].clear()
    TOKENS.update(direct=0, proxy=0)
    CPU.update(direct=0.0, proxy=0.0)


def per_call(label: str, arm: str) -> float:
    times = TIMES[arm]
    mean = statistics.fmean(times)
    print(f"   {label:<34} {mean * 1e3:8.3f} ms/call (median {statistics.median(times) * 1e3:.3f}, "
          f"{len(times)} calls, {TOKENS[arm] / len(times):.1f} tokens/call; this process's CPU "
          f"{CPU[arm] / len(times) * 1e3:.2f} ms/call)")
    return mean


def null_engine(args: argparse.Namespace, model_dir: str) -> None:
    per_token_s = args.null_ms_per_token / 1e3
    print(f"1a) null engine ({args.null_ms_per_token:g} ms a token), {args.calls} sequential calls of "
          f"{args.null_tokens} tokens, direct vs proxy")
    for client, agent in (("openai client", "openai_agent"), ("plain httpx", "httpx_sequential_agent")):
        reset()
        flow = agent_flow(model_dir, f"agent_proxy_bench:{agent}", args.null_tokens, args.calls)
        with RolloutController([NullEngine(per_token_s)], BenchWorkflow(flow), batch_size=1,
                               max_head_offpolicyness=64) as ctrl:
            run_blocks(ctrl, args.calls, 50)
        direct = per_call("direct (controller's engine)", "direct")
        proxy = per_call(f"through the proxy, {client}", "proxy")
        print(f"   proxy cost per call ({client}): {(proxy - direct) * 1e3:.3f} ms mean, "
              f"{(statistics.median(TIMES['proxy']) - statistics.median(TIMES['direct'])) * 1e3:.3f} ms median")
        flow.close()
    if args.skip_sessions:
        return
    for name, agent in (("shared httpx client", "httpx_agent"), ("fresh openai client each", "fresh_openai_agent")):
        flow = agent_flow(model_dir, f"agent_proxy_bench:{agent}", args.null_tokens, 1)
        n = args.sessions
        with RolloutController([NullEngine()], flow, batch_size=32, max_head_offpolicyness=4,
                               max_concurrent_rollouts=64) as ctrl:
            items = iter([{"id": i} for i in range(n + 64 * 5)])
            ctrl.prepare_batch(items, timeout=600)  # warm-up: the proxy starts
            began = time.perf_counter()
            for step in range(n // 32):
                ctrl.prepare_batch(items, timeout=600)
                ctrl.update_weights_from_disk("/dev/null", step + 1)
            seconds = time.perf_counter() - began
        print(f"1b) null engine, {n // 32 * 32} one-call sessions, 64 in flight, {name}: "
              f"{n // 32 * 32 / seconds:,.0f} sessions/s")
        SHARED.pop("client", None)  # bound to that controller's (now closed) loop
        flow.close()


def embedded_engine(args: argparse.Namespace) -> None:
    from areal_core.registry import resolve
    from areal_core.remote import ServerFleet
    from areal_core.models import resolve_model_path

    model_dir = str(resolve_model_path("", "float32"))
    LocalEngine = resolve("inference_engine", "local")
    config = RunConfig()
    config.model.path, config.model.dtype = model_dir, "float32"
    print(f"2) embedded engine (SmolLM2-135M-Instruct float32, CPU), {args.calls} calls of <= {args.tokens} "
          f"tokens, one at a time, alternating blocks of 50")
    reset()
    with tempfile.TemporaryDirectory() as logs, ServerFleet(Path(logs)) as fleet:
        context = Context(config=config, options=LocalEngine.config_class())
        (server,) = fleet.launch(lambda index, port: LocalEngine.server_process(context, index, port), 1,
                                 prefix="local")
        engine = LocalEngine.create(Context(config=config, options=LocalEngine.config_class(),
                                            extras={"address": server.address, "log_path": str(server.log_path)}))
        # greedy: every call of both arms generates the same tokens, so the arms differ only in the path
        flow = agent_flow(model_dir, "agent_proxy_bench:openai_agent", args.tokens, args.calls, temperature=0.0)
        with RolloutController([engine], BenchWorkflow(flow), batch_size=1, max_head_offpolicyness=64) as ctrl:
            run_blocks(ctrl, 100, 50)  # warm-up, not counted
            reset()
            run_blocks(ctrl, args.calls, 50)
        flow.close()
    direct, proxy = per_call("direct (controller's engine)", "direct"), per_call("through the proxy", "proxy")
    tokens_direct = TOKENS["direct"] / len(TIMES["direct"])
    tokens_proxy = TOKENS["proxy"] / len(TIMES["proxy"])
    print(f"   proxy adds {(proxy - direct) * 1e3:.2f} ms per call = {(proxy - direct) / direct:+.1%} "
          f"(target < 5 %); per generated token: {(proxy / tokens_proxy) / (direct / tokens_direct) - 1:+.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per call on the embedded engine")
    parser.add_argument("--null-tokens", type=int, default=8)
    parser.add_argument("--null-ms-per-token", type=float, default=0.0,
                        help="1a's engine takes this long a token (e.g. 10: an 80 ms call, like a small model's)")
    parser.add_argument("--skip-sessions", action="store_true", help="leave out 1b")
    parser.add_argument("--proxy-loop", choices=["episodes", "thread"], default="episodes",
                        help="workflow.proxy_loop: the proxy on the controller's event loop, or on its own thread")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--skip-null", action="store_true")
    args = parser.parse_args()
    PROXY_LOOP[0] = args.proxy_loop
    print(f"workflow.proxy_loop = {args.proxy_loop}")
    if not args.skip_null:
        from areal_core.testing import tiny_model

        folder = tiny_model(Path(tempfile.mkdtemp(prefix="agent-bench-")) / "model")
        null_engine(args, str(folder))
    if not args.skip_embedded:
        embedded_engine(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
