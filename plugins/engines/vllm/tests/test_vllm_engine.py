"""The vllm engine without a server: the version check, the server recipe, bad input."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import pytest

from areal_core.api import Context
from areal_core.config.schema import RunConfig
from areal_core.registry import resolve
from areal_vllm import engine as vllm_engine
from areal_vllm.engine import SUPPORTED_TEXT, VLLMEngine, VLLMEngineConfig, check_version, server_argv


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu"])
def test_supported_versions_pass(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "dev"])
def test_other_versions_are_refused_naming_the_range(version):
    with pytest.raises(RuntimeError) as info:
        check_version(version)
    message = str(info.value)
    assert repr(version) in message and SUPPORTED_TEXT in message and "install_vllm.sh" in message


def test_server_recipe_on_cpu_has_dev_mode_and_a_small_kv_cache():
    argv, env = server_argv("/opt/py", "/models/tiny", 8123, VLLMEngineConfig(kv_cache_gib=1, max_model_len=256))
    assert argv[:3] == ["/opt/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--max-model-len") + 1] == "256"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "--gpu-memory-utilization" not in argv
    # areal's worker extension, importable by the server's own interpreter from the plugin's server_path
    assert argv[argv.index("--worker-extension-cls") + 1] == "areal_vllm_worker.ArealWorkerExtension"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(vllm_engine.SERVER_PATH)
    assert (vllm_engine.SERVER_PATH / "areal_vllm_worker.py").is_file()


@pytest.mark.parametrize("check, modes", [("on", "on"), ("sample", "sample"), ("off", "")])
def test_the_servers_load_hook_digests_in_the_mode_the_run_checks_only(check, modes):
    config = RunConfig()
    config.model.path = "/models/tiny"
    config.rollout.weight_check = check
    recipe = VLLMEngine.server_process(Context(config=config, options=VLLMEngineConfig()), 0, 9)
    assert recipe.env["AREAL_VLLM_DIGEST_MODES"] == modes
    assert server_argv("py", "m", 1, VLLMEngineConfig())[1]["AREAL_VLLM_DIGEST_MODES"] == "on,sample"


def test_the_servers_pythonpath_keeps_this_process_entries_after_the_extension(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/site/a", "/site/b"]))
    _, env = server_argv("py", "m", 1, VLLMEngineConfig(), worker_extension="mine.Ext", python_path=["/ext"])
    assert env["PYTHONPATH"].split(os.pathsep) == ["/ext", "/site/a", "/site/b"]


def test_server_recipe_on_gpu_sets_memory_share_not_cpu_cache():
    argv, env = server_argv("py", "m", 1, VLLMEngineConfig(gpu_memory_utilization=0.5), device="gpu")
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_server_recipe_passes_the_placements_tensor_pipeline_and_expert_parallel_sizes():
    """A server placed over t x p devices is started over them (it ran with vLLM's default of one before)."""
    from areal_core.config.allocation import parse_allocation

    config = RunConfig()
    config.model.path = "/models/tiny"
    for text, flags in (("vllm:d2t4p2@gpu", ["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"]),
                        ("vllm:t2e2@gpu", ["--tensor-parallel-size", "2", "--enable-expert-parallel"]),
                        ("vllm:d2@gpu", [])):
        (placement,) = parse_allocation(text).components
        argv = VLLMEngine.server_process(Context(config=config, options=VLLMEngineConfig(extra_args=["--x"]),
                                                 placement=placement), 0, 9).argv
        given = [a for a in argv if a.startswith("--") and a.endswith(("-size", "-parallel"))]
        assert given == [f for f in flags if f.startswith("--")], text
        for flag, value in zip(flags, flags[1:]):
            if flag.startswith("--") and not value.startswith("--"):
                assert argv[argv.index(flag) + 1] == value, text
        assert argv[-1] == "--x"  # the user's own arguments come last, so they can override


def test_interpreter_comes_from_config_then_environment(monkeypatch, tmp_path):
    config = RunConfig()
    config.model.path = "/models/tiny"
    recipe = VLLMEngine.server_process(Context(config=config, options=VLLMEngineConfig(python="/x/python")), 0, 9)
    assert recipe.argv[0] == "/x/python" and "/x/python" in recipe.what
    monkeypatch.setenv("AREAL_VLLM_PYTHON", "/env/python")
    assert vllm_engine.default_python() == "/env/python"
    monkeypatch.delenv("AREAL_VLLM_PYTHON")
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here; the checkout's own may exist
    checkout = vllm_engine.Path(vllm_engine.__file__).resolve().parents[4]  # isolation: ok (the checkout's venv)
    assert vllm_engine.default_python() in (sys.executable, str(checkout / ".venv-vllm/bin/python"))


def test_create_needs_the_address():
    with pytest.raises(ValueError, match="address"):
        VLLMEngine.create(Context(config=RunConfig(), extras={}))


def test_update_from_a_missing_folder_is_refused_before_any_request(tmp_path):
    engine = VLLMEngine(None, "127.0.0.1:9")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        asyncio.run(engine.update_weights_from_disk(str(tmp_path / "missing"), 1))
    assert engine.version == 0


def test_unreachable_server_names_its_address_and_attempts():
    engine = VLLMEngine(None, "127.0.0.1:9", retries=1, retry_delay_s=0.01)

    async def body():
        try:
            await engine.request("GET", "/version")
        finally:
            await engine.aclose()

    with pytest.raises(ConnectionError, match=r"vLLM server at 127.0.0.1:9 is unreachable .* after 2 attempt"):
        asyncio.run(body())


def test_entry_point_resolves():
    assert resolve("inference_engine", "vllm") is VLLMEngine


def engine_on_double(double, **kwargs) -> VLLMEngine:
    return VLLMEngine(None, "127.0.0.1:9", transport=double.transport, **kwargs)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0"])
def test_start_refuses_a_server_outside_the_supported_range(protocol_double, version):
    engine = engine_on_double(protocol_double(version=version))
    with pytest.raises(RuntimeError) as info:
        asyncio.run(engine.start())
    assert repr(version) in str(info.value) and SUPPORTED_TEXT in str(info.value)


def test_start_accepts_a_supported_server_and_learns_its_model(protocol_double):
    engine = engine_on_double(protocol_double(version="0.32.0+cpu"))
    asyncio.run(engine.start())
    assert engine.server_version == "0.32.0+cpu" and engine.model == "double-model"


def test_tensor_update_prepares_the_next_bucket_while_the_server_loads_the_current_one(protocol_double):
    import torch

    double = protocol_double()
    tensors = [(f"model.layers.{i}.mlp.{part}.weight", torch.zeros(64, 64)) for i in range(3)
               for part in ("gate_proj", "up_proj")] + [("model.norm.weight", torch.zeros(64))]
    engine = engine_on_double(double, weight_bucket_mb=2 * 64 * 64 * 4 / 2**20)  # one layer a bucket
    asyncio.run(engine.update_weights_from_tensors(iter(tensors), 7))
    assert engine.version == 7
    assert len(double.reloads) == 4  # layer 0, layer 1, layer 2, norm
    sent = [name for r in double.reloads for name in r.names]
    assert sorted(sent) == sorted(name for name, _ in tensors)  # every tensor, once
    assert [r.next_ready for r in double.reloads] == [True, True, True, False], (
        "a bucket was not written while the server loaded the one before it")
    assert not any(r.folder.exists() for r in double.reloads)  # the /dev/shm copies are removed


def test_attached_servers_are_not_started_and_each_engine_takes_its_address():
    config = RunConfig()
    config.model.path = "/models/tiny"
    options = VLLMEngineConfig(addresses=["10.0.0.5:8001", "10.0.0.6:8001"])
    assert VLLMEngine.server_process(Context(config=config, options=options), 0, 9) is None
    engines = [VLLMEngine.create(Context(config=config, options=options, extras={"server_index": i, "address": None}))
               for i in (0, 1)]
    assert [e.address for e in engines] == ["10.0.0.5:8001", "10.0.0.6:8001"]


def test_a_continued_seeded_request_gets_a_seed_of_its_own(protocol_double):
    """vLLM restarts a request's generator from its seed: the continuation of an interrupted request (prompt +
    the tokens drawn so far, same seed) must not get the seed the first part had, or its draws repeat."""
    from areal_core.api import GenerationRequest, SamplingParams

    double = protocol_double()
    engine = engine_on_double(double)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1234)

    async def send(*requests):
        await engine.start()
        return [await engine.agenerate(r) for r in requests]

    asyncio.run(send(GenerationRequest([1, 2, 3], sampling, rid="r"),
                     GenerationRequest([1, 2, 3, 40, 41], sampling, rid="r"),
                     GenerationRequest([1, 2, 3], sampling, rid="again")))
    first, continued, again = (body["seed"] for body in double.completions)
    assert first != continued and first == again  # deterministic per (seed, what is continued)
    assert all(isinstance(seed, int) and 0 <= seed < 2**31 for seed in (first, continued))


def test_a_server_without_the_worker_extension_is_not_digested_and_says_how_to_fix_it(protocol_double, caplog):
    with_ext = engine_on_double(protocol_double())
    asyncio.run(with_ext.start())
    assert "weight_digest" in with_ext.capabilities
    without = engine_on_double(protocol_double(extension=False))
    with caplog.at_level(logging.WARNING, logger="areal.vllm"):
        asyncio.run(without.start())
    assert "weight_digest" not in without.capabilities and "weight_digest" in VLLMEngine.capabilities
    assert "--worker-extension-cls areal_vllm_worker.ArealWorkerExtension" in caplog.text


def test_weight_digest_refuses_an_unknown_mode_naming_it(protocol_double):
    engine = engine_on_double(protocol_double())
    with pytest.raises(ValueError, match="mode 'full': choose 'on'"):
        asyncio.run(engine.weight_digest("full"))
