"""A real vLLM server started from the plugin's recipe with a run secret: every route, vLLM's pause and weight
routes included, obeys the run only (areal_core.server_guard in front of vLLM, `areal_vllm_guard`), and reloads
weights only from the run folder."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from areal_core.api import GenerationRequest, SamplingParams, ServerProcess
from areal_core.remote import ServerFleet, http_ready
from areal_core.server_guard import RUN_TOKEN_ENV, new_run_token
from areal_core.testing import scaled
from areal_vllm.engine import VLLMEngine, VLLMEngineConfig, default_python, server_argv

pytestmark = pytest.mark.slow
PYTHON = default_python()
if PYTHON == sys.executable or not Path(PYTHON).is_file():
    pytest.skip("no vLLM environment: .venv-vllm/bin/python is missing (and $AREAL_VLLM_PYTHON is unset); "
                "make it with: bash scripts/install_vllm.sh", allow_module_level=True)

OPTIONS = VLLMEngineConfig(kv_cache_gib=1, max_model_len=1024, startup_timeout_s=scaled(400))


def test_a_vllm_server_obeys_only_its_run(tmp_path, monkeypatch):
    from areal_core.testing import tiny_model

    # vLLM's CPU attention needs a head size of 32, 64, ...: the default tiny shape (16) crashes it
    model = tiny_model(tmp_path / "model", seed=0, hidden_size=128, heads=2, kv_heads=1, dtype="bfloat16",
                       max_position_embeddings=1024)
    run = tmp_path / "runs" / "exp" / "trial"  # the run folder: weights load from under it only
    shutil.copytree(model, run / "checkpoints" / "step-1")
    token = new_run_token()
    monkeypatch.setenv(RUN_TOKEN_ENV, token)  # the recipe takes it from here, as under `areal run`
    fleet = ServerFleet(tmp_path / "logs")

    def recipe(index: int, port: int) -> ServerProcess:
        argv, env = server_argv(PYTHON, str(model), port, OPTIONS, max_request_mb=1.0, load_roots=[str(run)])
        return ServerProcess(argv, http_ready(port), f"vLLM server {index}", env=env,
                             startup_timeout_s=OPTIONS.startup_timeout_s)

    try:
        (server,) = fleet.launch(recipe, 1, prefix="vllm-guard", threads=1)
        base = f"http://{server.address}"
        for method, path in [("POST", "/pause"), ("POST", "/resume"), ("POST", "/collective_rpc"),
                             ("POST", "/v1/completions"), ("GET", "/is_paused")]:
            refused = httpx.request(method, f"{base}{path}", json={}, timeout=scaled(30))
            assert refused.status_code == 401, (path, refused.text)
        assert httpx.get(f"{base}/health", timeout=scaled(30)).status_code == 200
        secret = {"Authorization": f"Bearer {token}"}
        page = httpx.post(f"{base}/pause", headers={**secret, "Origin": "http://evil.example"}, timeout=scaled(30))
        assert page.status_code == 403
        rebound = httpx.post(f"{base}/pause", headers={**secret, "Host": "evil.example"}, timeout=scaled(30))
        assert rebound.status_code == 421
        big = httpx.post(f"{base}/v1/completions", headers=secret, content=b"x" * (2 << 20), timeout=scaled(30))
        assert big.status_code == 413
        assert httpx.get(f"{base}/is_paused", headers=secret, timeout=scaled(30)).json()["is_paused"] is False
        for folder, status in [(model, 403), (run / "checkpoints" / "step-1", 200)]:  # the secret is not enough
            reload = httpx.post(f"{base}/collective_rpc", headers=secret, timeout=scaled(120),
                                json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
            assert reload.status_code == status, (folder, reload.text)
        assert "nor a weight bucket of this user's trainer" in httpx.post(
            f"{base}/collective_rpc", headers=secret, timeout=scaled(30),
            json={"method": "reload_weights", "args": [None, str(model)]}).json()["detail"]

        engine = VLLMEngine(None, server.address, log_path=server.log_path)  # sends the secret from the env

        async def body():
            try:
                await engine.start()
                await engine.pause()
                await engine.resume()
                return await engine.agenerate(GenerationRequest([5, 17, 33], SamplingParams(max_new_tokens=4)))
            finally:
                await engine.aclose()

        assert len(asyncio.run(body()).output_ids) == 4
    finally:
        fleet.stop()
