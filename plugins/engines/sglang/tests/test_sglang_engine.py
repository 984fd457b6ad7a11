"""The sglang engine against a TEST DOUBLE of SGLang's HTTP protocol
(sglang_server_double.py, a real HTTP server process on 127.0.0.1): SGLang
itself cannot serve on a CPU-only machine. The conformance kit, continuation
after pause, weight updates, the version check."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

from areal_core.api import Context, GenerationRequest, SamplingParams, ServerProcess
from areal_core.config.schema import RunConfig
from areal_core.registry import resolve
from areal_core.remote import ServerFleet, http_ready
from areal_core.testing import InferenceEngineConformance, scaled, wait_until
from areal_sglang.engine import SUPPORTED_TEXT, SGLangEngine, SGLangEngineConfig, check_version, server_argv

DOUBLE = Path(__file__).with_name("sglang_server_double.py")
PROMPT = [5, 17, 33, 9]


def double_recipe(version: str = "0.5.23", *args: str):
    def recipe(index: int, port: int) -> ServerProcess:
        return ServerProcess([sys.executable, str(DOUBLE), "--port", str(port), "--version", version, *args],
                             http_ready(port), f"the SGLang protocol double {index} on 127.0.0.1:{port}",
                             startup_timeout_s=scaled(60))

    return recipe


@pytest.fixture(scope="module")
def models(tmp_path_factory, make_model):
    """A tiny Llama-family model the server starts from, and other weights of it to load."""
    root = tmp_path_factory.mktemp("sglang-models")
    return make_model(root / "base", 0), make_model(root / "update", 1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, models):
    with ServerFleet(tmp_path_factory.mktemp("sglang") / "logs") as f:
        f.launch(double_recipe(), 1, prefix="sglang-double")
        f.launch(double_recipe("0.4.9"), 1, prefix="sglang-old")
        # the conformance kit's: started from a model, so it holds (and checksums) its weights in SGLang's layout
        f.launch(double_recipe("0.5.23", "--model-path", str(models[0])), 1, prefix="sglang-model")
        yield f


class TestSGLangConformanceOnDouble(InferenceEngineConformance):
    component_name = "sglang"
    prompt_ids = PROMPT
    long_max_new_tokens = 2000
    fleet_: ServerFleet
    update_: Path

    @pytest.fixture(autouse=True)
    def _fleet(self, fleet, models):
        type(self).fleet_, type(self).update_ = fleet, models[1]

    def make(self, cls):
        return cls.create(Context(config=RunConfig(), extras={"address": self.fleet_.servers[2].address}))

    def weights_path_for_update(self):
        return str(self.update_)


def run(coro):
    return asyncio.run(coro)


async def server_reports(address: str, check, what: str) -> dict:
    """The double's ``/get_server_info`` once ``check(info)`` holds, polled on a thread of its own (the engine's
    calls go on on the event loop meanwhile); fails after ``scaled(30)`` s naming ``what``."""
    def reported() -> dict | None:
        info = httpx.get(f"http://{address}/get_server_info", timeout=scaled(10)).json()
        return info if check(info) else None

    return await asyncio.to_thread(wait_until, reported, 30, what)


def test_continuation_after_pause_gives_the_uninterrupted_tokens(fleet):
    long = 500  # tokens: a second of decoding at the double's 2 ms a token, for the pause to land in

    async def body():
        address = fleet.servers[0].address
        engine = SGLangEngine(None, address)
        await engine.start()
        try:
            whole = await engine.agenerate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=long)))
            decoded = (await engine.request("GET", "/get_server_info"))["decoded"]
            task = asyncio.ensure_future(engine.agenerate(GenerationRequest(PROMPT, SamplingParams(
                max_new_tokens=long))))
            await server_reports(address, lambda info: info["decoded"] > decoded,
                                 "the request to decode its first token on the server")
            await engine.pause()
            part = await task
            await engine.resume()
            rest = await engine.agenerate(GenerationRequest(PROMPT + part.output_ids, SamplingParams(
                max_new_tokens=long - len(part.output_ids))))
            return whole, part, rest
        finally:
            await engine.aclose()

    whole, part, rest = run(body())
    assert part.stop_reason == "abort" and 0 < len(part.output_ids) < long
    assert part.output_ids + rest.output_ids == whole.output_ids
    assert part.output_logprobs + rest.output_logprobs == whole.output_logprobs


def test_a_request_that_arrives_while_paused_never_carries_the_old_version(fleet):
    """SGLang holds a request that reaches it while paused and runs it after /continue_generation, under the
    new weights (the double does the same). Such a request (in transit when the controller paused) must not
    come back with tokens stamped with the version it was sent at: it comes back aborted and empty, to be
    continued at the new version."""
    async def body():
        address = fleet.servers[0].address
        engine = SGLangEngine(None, address)
        await engine.start()
        try:
            await engine.pause()
            held_before = (await engine.request("GET", "/get_server_info"))["held"]
            late = asyncio.ensure_future(engine.agenerate(GenerationRequest(PROMPT, SamplingParams(
                max_new_tokens=16))))
            await server_reports(address, lambda info: info["held"] > held_before,
                                 "the request sent while paused to be held by the server")
            assert not late.done(), f"a request sent while paused was answered: {late.result()}"
            held = (await engine.request("GET", "/get_server_info"))["held"] - held_before
            await engine.update_weights_from_disk("/weights/after-pause", engine.version + 1)
            await engine.resume()
            late = await asyncio.wait_for(late, scaled(30))
            after = await engine.agenerate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4)))
            return held, late, after, engine.version
        finally:
            await engine.aclose()

    held, late, after, version = run(body())
    assert held == 1, "the request did not reach the server while it was paused: the test tested nothing"
    assert late.stop_reason == "abort" or set(late.output_versions) <= {version}, (
        f"{len(late.output_ids)} tokens generated after the update to version {version} carry "
        f"{sorted(set(late.output_versions))}")
    assert set(after.output_versions) == {version} and len(after.output_ids) == 4  # resumed for real


def test_weights_from_disk_change_tokens_and_version(fleet):
    async def body():
        engine = SGLangEngine(None, fleet.servers[0].address)
        await engine.start()
        try:
            before = await engine.agenerate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8)))
            await engine.update_weights_from_disk("/weights/v7", 7)
            after = await engine.agenerate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8)))
            info = await engine.request("GET", "/get_server_info")
            return before, after, info
        finally:
            await engine.aclose()

    before, after, info = run(body())
    assert info["weights"] == "/weights/v7"
    assert after.output_ids != before.output_ids and set(after.output_versions) == {7}


def test_an_unsupported_server_version_is_refused_at_start(fleet):
    async def body():
        engine = SGLangEngine(None, fleet.servers[1].address)
        try:
            await engine.start()
        finally:
            await engine.aclose()

    with pytest.raises(RuntimeError) as info:
        run(body())
    assert "'0.4.9'" in str(info.value) and SUPPORTED_TEXT in str(info.value)


@pytest.mark.parametrize("version", ["0.5.0", "0.5.23"])
def test_supported_versions_pass(version):
    check_version(version)


def test_server_recipe_uses_tensor_parallel_and_memory_share():
    argv = server_argv("/py", "/m", 7000, SGLangEngineConfig(mem_fraction_static=0.5), "bfloat16", 2)
    assert argv[:3] == ["/py", "-m", "areal_sglang_launch"]  # SGLang's launcher, given the run's secret and guard
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--mem-fraction-static") + 1] == "0.5"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "7000"


def test_create_needs_the_address():
    with pytest.raises(ValueError, match="address"):
        SGLangEngine.create(Context(config=RunConfig(), extras={}))


def test_entry_point_resolves():
    assert resolve("inference_engine", "sglang") is SGLangEngine


def test_weights_over_a_process_group_equal_the_same_weights_from_disk(fleet, tmp_path, make_weights):
    weights = make_weights
    from safetensors.torch import save_file

    folders = {}
    for seed in (1, 2):
        folders[seed] = tmp_path / f"w{seed}"
        folders[seed].mkdir()
        save_file(weights(seed), str(folders[seed] / "model.safetensors"))
    layer_mb = 2 * 64 * 64 * 2 / 2**20  # buckets of one layer: embeddings+layer 0, layer 1, layer 2, norm

    async def body():
        engine = SGLangEngine(None, fleet.servers[0].address, weight_bucket_mb=layer_mb, weight_group_backend="gloo",
                              request_timeout_s=60)
        await engine.start()
        greedy = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=12))
        try:
            await engine.update_weights_from_disk(str(folders[1]), 1)
            on_disk = await engine.agenerate(greedy)
            await engine.update_weights_from_disk(str(folders[2]), 2)
            other = await engine.agenerate(greedy)
            before = (await engine.request("GET", "/get_server_info"))["buckets"]
            await engine.update_weights_from_tensors(weights(1).items(), 3)
            over_group = await engine.agenerate(greedy)
            await engine.update_weights_from_tensors(weights(2).items(), 4)  # the same group again
            info = await engine.request("GET", "/get_server_info")
        finally:
            await engine.aclose()  # destroys the group on the server
        probe = SGLangEngine(None, fleet.servers[0].address)
        closed = await probe.request("GET", "/get_server_info")
        await probe.aclose()
        return on_disk, other, over_group, info, before, closed

    on_disk, other, over_group, info, before, closed = run(body())
    assert other.output_ids != on_disk.output_ids  # the two weight sets give different tokens
    assert over_group.output_ids == on_disk.output_ids, "tensors sent over the group differ from the same on disk"
    assert set(over_group.output_versions) == {3}
    assert info["buckets"] - before == 8  # 4 buckets per update, 2 updates
    assert len(info["groups"]) == 1, "a second update made a second group"
    assert closed["groups"] == {}, "aclose() left the weight-update group on the server"


def test_a_refused_weight_group_is_a_clear_error_not_a_hang(fleet):
    import torch

    async def body():
        # the double joins gloo groups only: it refuses nccl, as a server refuses a group it cannot join
        engine = SGLangEngine(None, fleet.servers[0].address, weight_group_backend="nccl",
                              request_timeout_s=scaled(3))
        await engine.start()
        try:
            await engine.update_weights_from_tensors([("model.norm.weight", torch.ones(4))], 1)
        finally:
            await engine.aclose()
        return engine

    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"SGLang server at .* could not join weight-update group .*gloo groups only"):
        run(body())
    assert time.monotonic() - began < scaled(30)


def test_the_weight_group_backend_is_checked():
    with pytest.raises(ValueError, match=r"rollout.weight_group_backend is 'mpi'"):
        SGLangEngineConfig(weight_group_backend="mpi")


def test_servers_run_from_their_own_interpreter(monkeypatch):
    config = RunConfig()
    config.model.path = "/models/tiny"
    chosen = SGLangEngine.server_process(Context(config=config, options=SGLangEngineConfig(python="/x/python")), 0, 9)
    assert chosen.argv[0] == "/x/python"
    monkeypatch.setenv("AREAL_SGLANG_PYTHON", "/env/python")
    assert SGLangEngine.server_process(Context(config=config, options=SGLangEngineConfig()), 0, 9).argv[0] == \
        "/env/python"


def test_attached_servers_are_not_started_and_each_engine_takes_its_address():
    config = RunConfig()
    config.model.path = "/models/tiny"
    options = SGLangEngineConfig(addresses=["10.0.0.5:30000"])
    assert SGLangEngine.server_process(Context(config=config, options=options), 0, 9) is None
    engine = SGLangEngine.create(Context(config=config, options=options, extras={"server_index": 0}))
    assert engine.address == "10.0.0.5:30000"
