"""An SGLang server started from the plugin's recipe with a run secret obeys only its run: the secret reaches
SGLang's own key check through ``areal_sglang_launch`` (never the command line), and areal's guard sits in
front of every route. SGLang cannot be installed here, so the recipe's interpreter finds a TEST DOUBLE of the
``sglang`` package (tests/sglang_package_double: SGLang's launcher and argument parser, serving the protocol
double); everything on areal's side (the recipe, the launcher module, the guard, the engine's client) is real."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import httpx
import pytest

from areal_core.api import Context, GenerationRequest, SamplingParams
from areal_core.config.schema import RunConfig
from areal_core.remote import ServerFleet
from areal_core.server_guard import RUN_TOKEN_ENV, new_run_token
from areal_core.testing import scaled
from areal_sglang.engine import SGLangEngine, SGLangEngineConfig

PACKAGE_DOUBLE = Path(__file__).with_name("sglang_package_double")


def launch(tmp_path: Path, model: Path, max_request_mb: float = 16.0, guard: bool = True):
    """One server from SGLangEngine.server_process, its interpreter finding the package double first;
    ``guard=False``: without the guard's file (a server started by hand from the launcher module)."""
    config = RunConfig()
    config.model.path, config.rollout.max_request_mb = str(model), max_request_mb
    config.output_dir, config.experiment, config.trial = str(tmp_path / "runs"), "exp", "trial"
    recipe = SGLangEngine.server_process(Context(config=config, options=SGLangEngineConfig(
        startup_timeout_s=scaled(60))), 0, 0)

    def with_double(index: int, port: int):
        process = SGLangEngine.server_process(Context(config=config, options=SGLangEngineConfig(
            startup_timeout_s=scaled(60))), index, port)
        process.env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DOUBLE), process.env["PYTHONPATH"]])
        if not guard:
            del process.env["AREAL_SERVER_GUARD_FILE"]
        return process

    fleet = ServerFleet(tmp_path / "logs")
    try:
        (server,) = fleet.launch(with_double, 1, prefix="sglang-launch")
    except BaseException:
        fleet.__exit__(None, None, None)
        raise
    return fleet, server, recipe


def test_the_secret_reaches_sglang_by_the_environment_and_every_route_obeys_the_run(tmp_path, monkeypatch,
                                                                                     make_model):
    model = make_model(tmp_path / "model", 0)
    token = new_run_token()
    monkeypatch.setenv(RUN_TOKEN_ENV, token)  # as under `areal run`, which draws one per run
    fleet, server, recipe = launch(tmp_path, model, max_request_mb=1.0)
    try:
        assert recipe.argv[1:3] == ["-m", "areal_sglang_launch"]
        assert token not in " ".join(recipe.argv) and token not in recipe.env.values()
        cmdline = Path(f"/proc/{server.managed.pid}/cmdline").read_bytes().decode()
        assert token not in cmdline and "areal_sglang_launch" in cmdline
        base = f"http://{server.address}"
        for path in ("/generate", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
                     "/init_weights_update_group", "/abort_request"):
            refused = httpx.post(f"{base}{path}", json={}, timeout=scaled(30))
            assert refused.status_code == 401, (path, refused.text)
        assert httpx.get(f"{base}/get_server_info", timeout=scaled(30)).status_code == 401
        assert httpx.get(f"{base}/health", timeout=scaled(30)).status_code == 200
        secret = {"Authorization": f"Bearer {token}"}
        page = httpx.post(f"{base}/pause_generation", headers={**secret, "Origin": "http://evil.example"},
                          json={"mode": "abort"}, timeout=scaled(30))
        assert page.status_code == 403, page.text
        rebound = httpx.post(f"{base}/pause_generation", headers={**secret, "Host": "evil.example"},
                             json={"mode": "abort"}, timeout=scaled(30))
        assert rebound.status_code == 421, rebound.text
        big = httpx.post(f"{base}/generate", headers=secret, content=b"x" * (2 << 20), timeout=scaled(30))
        assert big.status_code == 413, big.text

        # weights from disk only from under the run folder, the secret notwithstanding
        step = shutil.copytree(model, tmp_path / "runs" / "exp" / "trial" / "checkpoints" / "step-1")
        outside = httpx.post(f"{base}/update_weights_from_disk", headers=secret, json={"model_path": str(model)},
                             timeout=scaled(30))
        assert outside.status_code == 403 and "is not under the run folder" in outside.json()["detail"]

        engine = SGLangEngine(None, server.address)  # sends the run's secret from the environment

        async def body():
            try:
                await engine.start()
                await engine.pause()
                await engine.resume()
                await engine.update_weights_from_disk(str(step), 1)
                return await engine.agenerate(GenerationRequest([5, 17, 33], SamplingParams(max_new_tokens=4)))
            finally:
                await engine.aclose()

        out = asyncio.run(body())
        assert len(out.output_ids) == 4 and set(out.output_versions) == {1}
    finally:
        fleet.__exit__(None, None, None)


def test_without_a_run_secret_the_server_says_so_and_still_checks_host_and_origin(tmp_path, monkeypatch,
                                                                                    make_model):
    monkeypatch.delenv(RUN_TOKEN_ENV, raising=False)
    fleet, server, _ = launch(tmp_path, make_model(tmp_path / "model", 0))
    try:
        base = f"http://{server.address}"
        assert httpx.get(f"{base}/get_server_info", timeout=scaled(30)).status_code == 200
        page = httpx.post(f"{base}/pause_generation", headers={"Origin": "http://evil.example"},
                          json={"mode": "abort"}, timeout=scaled(30))
        assert page.status_code == 403
    finally:
        fleet.__exit__(None, None, None)
    assert "no AREAL_RUN_TOKEN in the environment" in server.log_path.read_text()


def test_sglangs_own_key_check_gets_the_secret(tmp_path, monkeypatch, make_model):
    """Without areal's guard in front, the secret still closes the server: SGLang checks it itself."""
    token = new_run_token()
    monkeypatch.setenv(RUN_TOKEN_ENV, token)
    fleet, server, _ = launch(tmp_path, make_model(tmp_path / "model", 0), guard=False)
    try:
        base = f"http://{server.address}"
        for headers in ({}, {"Authorization": "Bearer guess"}):
            refused = httpx.post(f"{base}/pause_generation", headers=headers, json={"mode": "abort"},
                                 timeout=scaled(30))
            assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}, refused.text
        info = httpx.get(f"{base}/get_server_info", headers={"Authorization": f"Bearer {token}"}, timeout=scaled(30))
        assert info.status_code == 200 and "version" in info.json()
    finally:
        fleet.__exit__(None, None, None)
