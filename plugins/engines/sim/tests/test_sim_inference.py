"""The simulated inference engine keeps the real contract (the conformance kit) and spends the profile's time."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_core.api import Context, GenerationRequest, SamplingParams
from areal_core.testing import InferenceEngineConformance, scaled
from areal_sim.inference import SimEngineConfig, SimInferenceEngine
from areal_sim.profile import Lengths


class TestSimInferenceConformance(InferenceEngineConformance):
    component_name = "sim"
    long_max_new_tokens = 512

    def make(self, cls):
        # 7B on H800 at 40x: a 512-token generation takes ~0.14 s of wall time
        return cls.create(Context(options=SimEngineConfig(time_scale=40.0)))

    def weights_path_for_update(self) -> str:
        return "/the/sim/engine/reads/no/weights"


def _run(body, **options):
    async def main():
        engine = SimInferenceEngine(Context(options=SimEngineConfig(**options)))
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.aclose()

    return asyncio.run(main())


def test_a_lone_request_takes_the_profiles_decode_time():
    async def body(engine):
        began = time.monotonic()
        r = await engine.agenerate(GenerationRequest([1] * 100, SamplingParams(max_new_tokens=200, seed=3)))
        return r, time.monotonic() - began, engine

    r, wall, engine = _run(body, time_scale=20.0)
    step = engine.profile.inference.decode_step_s
    expected = sum(step(1, 100 + i) for i in range(len(r.output_ids))) + engine.profile.inference.prefill_s(100)
    assert engine.busy_s == pytest.approx(expected, rel=1e-9)
    assert wall >= 0.9 * expected / 20.0  # the modelled time is spent (at 20x); asyncio adds its own on top


def test_batching_is_cheaper_per_token_than_one_at_a_time_and_lengths_are_long_tailed():
    async def body(engine):
        # the profile's distribution at a smaller scale (median 200, cap 4000) keeps the test short
        object.__setattr__(engine.profile, "lengths", Lengths(median=200, sigma=1.0, cap=4000, prompt=50))
        requests = [GenerationRequest([1] * 50, SamplingParams(max_new_tokens=4000, seed=s)) for s in range(64)]
        return await asyncio.gather(*(engine.agenerate(r) for r in requests)), engine

    out, engine = _run(body, time_scale=1e6)
    lengths = sorted(len(r.output_ids) for r in out)
    assert lengths[-1] > 3 * lengths[len(lengths) // 2]  # stragglers
    alone = sum(engine.profile.inference.decode_step_s(1, 50 + i) for n in lengths for i in range(n))
    assert engine.busy_s < alone / 5  # the stragglers finish at small batches, so well short of 64x
    assert {r.stop_reason for r in out} <= {"stop", "length"}


def test_requests_wait_for_room_in_the_kv_cache():
    async def body(engine):
        object.__setattr__(engine.profile.inference, "kv_capacity_tokens", 1000)
        requests = [GenerationRequest([1] * 400, SamplingParams(max_new_tokens=100, seed=s)) for s in range(4)]
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in requests]
        await asyncio.sleep(0)
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, len(engine._running))
            await asyncio.sleep(0.0005)
        return peak

    assert _run(body, time_scale=50.0) == 2  # 2 x (400 + 100) fit in 1000 tokens, a third does not


def _reference_finish_times(prompts: list[int], targets: list[int], capacity: int, profile) -> tuple[list[float], int]:
    """Continuous batching step by step, written plainly (one loop iteration per decode step), with the KV cache
    managed as vLLM's scheduler does: before each step, while the running requests' next tokens do not fit, the
    one that joined last is preempted (to the head of the queue, keeping its tokens); then waiting requests join
    while their context and every running request's next token fit (one alone runs whatever its size), and the
    step's prefill covers each joiner's whole context. Every running request gets a token per step and finishes
    at the end of the step that gives it its last. (finish times, preemptions)"""
    table, prefill = profile.inference.decode_step_s, profile.inference.prefill_s
    waiting = list(range(len(prompts)))
    running: list[int] = []  # in the order they joined
    produced = [0] * len(prompts)
    finish = [0.0] * len(prompts)
    preempted = 0
    t = 0.0

    def used() -> int:
        return sum(prompts[i] + produced[i] for i in running)

    while waiting or running:
        while len(running) > 1 and used() + len(running) > capacity:
            waiting.insert(0, running.pop())
            preempted += 1
        joined = []
        while waiting and (not running or used() + len(running) + prompts[waiting[0]] + produced[waiting[0]] + 1
                           <= capacity):
            joined.append(waiting.pop(0))
            running.append(joined[-1])
        t += table(len(running), used() / len(running)) + prefill(sum(prompts[i] + produced[i] for i in joined))
        for i in list(running):
            produced[i] += 1
            if produced[i] == targets[i]:
                finish[i] = t
                running.remove(i)
    return finish, preempted


@pytest.mark.parametrize("scale", [1, 25])
def test_the_event_driven_engine_finishes_each_request_when_a_step_by_step_reference_does(scale):
    """300 requests at once into a KV cache that holds about a third of their final contexts, on a virtual clock:
    each one's finish time, and the number of preemptions, equal the plain step-by-step model's (which knows
    nothing of stretches or closed forms)."""
    from areal_core.clock import VirtualClock

    clock = VirtualClock(threads=0)
    loop = clock.new_event_loop()
    finished: dict[int, float] = {}

    async def main():
        engine = SimInferenceEngine(Context(options=SimEngineConfig(token_scale=scale)))
        object.__setattr__(engine.profile, "lengths", Lengths(median=400, sigma=1.0, cap=6000, prompt=50))
        object.__setattr__(engine.profile.inference, "kv_capacity_tokens", 30_000)
        await engine.start()

        async def one(i):
            r = await engine.agenerate(GenerationRequest([1] * (2 + i % 3), SamplingParams(max_new_tokens=10**6,
                                                                                           seed=i)))
            finished[i] = loop.time()
            return r

        out = await asyncio.gather(*(one(i) for i in range(300)))
        await engine.aclose()
        return out, engine

    began = time.perf_counter()
    out, engine = loop.run_until_complete(main())
    wall = time.perf_counter() - began
    loop.close()
    prompts = [len(r.input_ids) * scale for r in out]
    targets = [len(r.output_ids) * scale for r in out]
    reference, preempted = _reference_finish_times(prompts, targets, 30_000, engine.profile)
    assert [finished[i] for i in range(300)] == pytest.approx(reference, rel=1e-9)
    assert engine.preempted == preempted > 10  # the cache filled: requests were preempted and recomputed
    assert engine.recomputed_tokens > 0
    assert engine.tokens == sum(targets)
    assert max(targets) > 5 * sorted(targets)[150]  # long-tailed: stragglers at the end
    assert engine.events < 2 * 300 + 3 * preempted + 10  # one stretch per join / finish / full cache, not per step
    assert wall < scaled(10)  # a simulated minute or more of generation in seconds of wall time
    assert finished[max(finished, key=finished.get)] > 30


def test_a_pause_returns_the_tokens_of_the_steps_already_done_and_resumes_exactly():
    """Paused mid-stretch on a virtual clock: the output is what the steps up to the pause produced, and
    continuing the request gives the uninterrupted one's tokens."""
    from areal_core.clock import VirtualClock

    clock = VirtualClock(threads=0)
    loop = clock.new_event_loop()

    async def main():
        engine = SimInferenceEngine(Context(options=SimEngineConfig()))
        await engine.start()
        request = GenerationRequest([5] * 20, SamplingParams(max_new_tokens=300, seed=11))
        whole = await engine.agenerate(request)
        began = loop.time()
        task = asyncio.ensure_future(engine.agenerate(GenerationRequest([5] * 20, SamplingParams(max_new_tokens=300,
                                                                                              seed=11))))
        await asyncio.sleep(0.5)  # half a simulated second: some dozens of steps at 7B
        await engine.pause()
        partial = await task
        await engine.resume()
        table = engine.profile.inference.decode_step_s
        expected = table.steps_within(1, 20, loop.time() - began - engine.profile.inference.prefill_s(20), 300)
        rest = await engine.agenerate(GenerationRequest([5] * 20 + partial.output_ids,
                                                        SamplingParams(max_new_tokens=300 - len(partial.output_ids),
                                                                       seed=11)))
        await engine.aclose()
        return whole, partial, rest, expected

    whole, partial, rest, expected = loop.run_until_complete(main())
    loop.close()
    assert partial.stop_reason == "abort" and len(partial.output_ids) == expected > 10
    assert partial.output_ids + rest.output_ids == whole.output_ids


def test_with_shared_prompts_a_groups_identical_prompts_are_prefilled_once():
    """The embedded engine runs identical sequences joining together once (a group's samples share the prompt): a
    profile that says so charges one prefill (its fixed part plus the tokens) for the group."""
    import dataclasses

    async def body(engine, shared: bool):
        inference = dataclasses.replace(engine.profile.inference, shared_prompts=shared, prefill_s_fixed=0.5)
        object.__setattr__(engine.profile, "inference", inference)
        group = [GenerationRequest([7] * 100, SamplingParams(max_new_tokens=1, seed=s)) for s in range(8)]
        await asyncio.gather(*(engine.agenerate(r) for r in group))
        return engine.busy_s - engine.profile.inference.decode_step_s(8, 100)  # one decode step after it

    for shared, prompts in ((True, 1), (False, 8)):
        prefill = _run(lambda e: body(e, shared), time_scale=1e6)
        per_token = SimInferenceEngine(Context(options=SimEngineConfig())).profile.inference.prefill_s_per_token
        assert prefill == pytest.approx(0.5 + prompts * 100 * per_token, rel=1e-6)


def test_on_a_shared_cpu_an_export_beside_training_costs_both_roles_half_of_it():
    """The real fsdp engine exports on a thread of its own beside training at eta > 0: the simulated trainer does
    not wait for it; half its time goes on the next optimizer step, half on the server's next weight update."""
    import torch

    from areal_sim.train import SimTrainConfig, SimTrainEngine

    def trainer(contended):
        engine = SimTrainEngine(Context(options=SimTrainConfig(profile="smollm2-135m-cpu", contended=contended,
                                                               time_scale=1e6)))
        engine.initialize()
        return engine

    batch = {"input_ids": [1] * 40, "loss_mask": [0] * 20 + [1] * 20, "logprobs": [-1.0] * 40,
             "advantages": [0.5] * 40, "seq_lens": [20, 20], "cu_seqlens": [0, 20, 40], "group_index": [0, 0],
             "position_ids": list(range(20)) * 2}

    def loss(logprobs, entropy, mb):
        return -(logprobs * mb["loss_mask"].float()).sum(), {}

    inline, beside = trainer(False), trainer(True)
    assert not inline.beside and beside.beside
    export_s = beside.profile.weights.export_s
    named = dict(pair for bucket in beside.export_tensors(1 << 26) for pair in bucket)
    assert beside.busy_s == 0.0 and float(named["sim.stall_s"]) == pytest.approx(export_s / 2)
    alone = trainer(True)
    alone.train_batch(batch, loss)
    beside.train_batch(batch, loss)
    assert beside.busy_s == pytest.approx(alone.busy_s + export_s / 2)
    beside.train_batch(batch, loss)  # owed once only
    assert beside.busy_s == pytest.approx(2 * alone.busy_s + export_s / 2)
    # the controller's share: per sample trained, only when the roles run at once
    assert alone.profile.train.side_s_per_sample > 0.0 and inline.profile.train.side_s_per_sample == 0.0
    named = dict(pair for bucket in inline.export_tensors(1 << 26) for pair in bucket)
    assert inline.busy_s == pytest.approx(inline.profile.weights.export_s) and float(named["sim.stall_s"]) == 0.0

    async def body(engine):
        await engine.update_weights_from_tensors([("sim.version", torch.tensor(1)),
                                                  ("sim.stall_s", torch.tensor(0.25, dtype=torch.float64))], 1)
        return engine

    engine = _run(body, profile="smollm2-135m-cpu", contended=True, time_scale=1e6)
    assert engine.version == 1 and engine.busy_s == pytest.approx(engine.profile.weights.transfer_s() + 0.25)


def test_on_a_shared_cpu_the_controllers_share_is_charged_per_request_while_the_roles_run_at_once():
    async def body(engine):
        await asyncio.gather(*(engine.agenerate(GenerationRequest([5] * 30, SamplingParams(max_new_tokens=8, seed=i)))
                               for i in range(4)))
        return engine

    apart = _run(body, profile="smollm2-135m-cpu", contended=False, time_scale=1e6)
    at_once = _run(body, profile="smollm2-135m-cpu", contended=True, time_scale=1e6)
    side = at_once.profile.inference.side_s_per_request
    assert side > 0.0 and apart.profile.inference.side_s_per_request == 0.0
    # the same requests: the decoding slowed by the contention, plus the controller's share of each of the 4
    scale = at_once.profile.cpu.inference_contention
    assert at_once.busy_s == pytest.approx(apart.busy_s * scale + 4 * side, rel=1e-6)


@pytest.mark.parametrize("seeded", [True, False])
def test_an_interrupted_request_continues_to_its_original_length(seeded):
    """Interruption changes when a request's tokens come, never how many: the same 64 requests through the
    controller's interruptible facade, once uninterrupted and once paused twice mid-generation, give each
    request the same number of tokens (the continuation does not draw a new length)."""
    from areal_core.clock import VirtualClock
    from areal_core.rollout.interruptible import InterruptibleEngine

    def lengths(pauses: list[float]) -> tuple[list[int], int]:
        clock = VirtualClock(threads=0)
        loop = clock.new_event_loop()

        async def main():
            engine = SimInferenceEngine(Context(options=SimEngineConfig()))
            object.__setattr__(engine.profile, "lengths", Lengths(median=300, sigma=1.0, cap=3000, prompt=50))
            await engine.start()
            facade = InterruptibleEngine([engine])
            requests = [GenerationRequest([3] * 50, SamplingParams(max_new_tokens=2000, seed=i if seeded else None),
                                          rid=f"r{i}") for i in range(64)]
            tasks = [asyncio.ensure_future(facade.agenerate(r)) for r in requests]
            for at in pauses:
                await asyncio.sleep(at)
                facade.close_gate()
                await engine.pause()
                await engine.resume()
                facade.open_gate()
            out = await asyncio.gather(*tasks)
            await engine.aclose()
            return [len(r.output_ids) for r in out], engine.aborted

        try:
            return loop.run_until_complete(main())
        finally:
            loop.close()

    whole, _ = lengths([])
    interrupted, aborted = lengths([2.0, 3.0])
    assert aborted > 20  # the pauses did cut requests short (else this compares nothing)
    assert interrupted == whole
