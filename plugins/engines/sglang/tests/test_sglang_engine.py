"""The sglang engine against a TEST DOUBLE of SGLang's HTTP protocol
(sglang_server_double.py, a real HTTP server process on 127.0.0.1): SGLang
itself cannot serve on a CPU-only machine. The conformance kit, continuation
after pause, weight updates, the version check."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from areal_core.api import Context, GenerationRequest, SamplingParams, ServerProcess
from areal_core.config.schema import RunConfig
from areal_core.registry import resolve
from areal_core.remote import ServerFleet, http_ready
from areal_core.testing import InferenceEngineConformance
from areal_sglang.engine import SUPPORTED_TEXT, SGLangEngine, SGLangEngineConfig, check_version, server_argv

DOUBLE = Path(__file__).with_name("sglang_server_double.py")
PROMPT = [5, 17, 33, 9]


def double_recipe(version: str = "0.5.23"):
    def recipe(index: int, port: int) -> ServerProcess:
        return ServerProcess([sys.executable, str(DOUBLE), "--port", str(port), "--version", version],
                             http_ready(port), f"the SGLang protocol double {index} on 127.0.0.1:{port}",
                             startup_timeout_s=60)

    return recipe


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with ServerFleet(tmp_path_factory.mktemp("sglang") / "logs") as f:
        f.launch(double_recipe(), 1, prefix="sglang-double")
        f.launch(double_recipe("0.4.9"), 1, prefix="sglang-old")
        yield f


class TestSGLangConformanceOnDouble(InferenceEngineConformance):
    component_name = "sglang"
    prompt_ids = PROMPT
    long_max_new_tokens = 2000
    pause_after_s = 0.05
    fleet_: ServerFleet

    @pytest.fixture(autouse=True)
    def _fleet(self, fleet):
        type(self).fleet_ = fleet

    def make(self, cls):
        return cls.create(Context(config=RunConfig(), extras={"address": self.fleet_.servers[0].address}))

    def weights_path_for_update(self):
        return "/weights/v1"


def run(coro):
    return asyncio.run(coro)


def test_continuation_after_pause_gives_the_uninterrupted_tokens(fleet):
    async def body():
        engine = SGLangEngine(None, fleet.servers[0].address)
        await engine.start()
        try:
            whole = await engine.agenerate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=200)))
            task = asyncio.ensure_future(engine.agenerate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=200))))
            await asyncio.sleep(0.1)
            await engine.pause()
            part = await task
            await engine.resume()
            rest = await engine.agenerate(GenerationRequest(PROMPT + part.output_ids, SamplingParams(
                max_new_tokens=200 - len(part.output_ids))))
            return whole, part, rest
        finally:
            await engine.aclose()

    whole, part, rest = run(body())
    assert part.stop_reason == "abort" and 0 < len(part.output_ids) < 200
    assert part.output_ids + rest.output_ids == whole.output_ids
    assert part.output_logprobs + rest.output_logprobs == whole.output_logprobs


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
    assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--mem-fraction-static") + 1] == "0.5"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "7000"


def test_create_needs_the_address():
    with pytest.raises(ValueError, match="address"):
        SGLangEngine.create(Context(config=RunConfig(), extras={}))


def test_entry_point_resolves():
    assert resolve("inference_engine", "sglang") is SGLangEngine
